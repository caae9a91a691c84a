"""The s3 bundle store through boto3 against the S3 stand-in on loopback (never a cloud), on
its own and behind the api; and what a misconfigured store says."""

from __future__ import annotations

import hashlib
import io
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from corral.shared.errors import ConfigurationError
from corral.shared.settings import CoreSettings
from corral.shared.store.bundle_store import BundleStoreError, S3BundleStore, make_bundle_store
from corral.shared.store.db import Database
from tests.bundle_archives import archive, file_entry, manifest
from tests.integration.api_clients import ClientFactory
from tests.integration.test_api import admin_headers
from tests.integration.test_bundles_api import GZIP, running
from tests.standins.s3 import S3Standin

BUCKET = "corral-bundles"


@pytest.fixture
def s3(monkeypatch: pytest.MonkeyPatch) -> Iterator[S3Standin]:
    with S3Standin(bucket=BUCKET) as standin:
        # boto3's own credential chain, as in a deployment; nothing else is read from here.
        monkeypatch.setenv("AWS_ACCESS_KEY_ID", standin.access_key)
        monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", standin.secret_key)
        monkeypatch.delenv("AWS_PROFILE", raising=False)
        yield standin


@pytest.fixture(autouse=True)
def closed_clients(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Every S3 store a test makes (the api's too) closes its client's connections after it:
    left to the garbage collector, their sockets would warn in whichever test runs then."""
    made: list[S3BundleStore] = []
    original = S3BundleStore.__init__

    def recorded(self: S3BundleStore, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        made.append(self)

    monkeypatch.setattr(S3BundleStore, "__init__", recorded)
    yield
    for store in made:
        store.close()


def s3_settings(standin: S3Standin, **overrides: object) -> dict[str, object]:
    return {
        "bundle_store": "s3",
        "bundle_s3_bucket": BUCKET,
        "bundle_s3_endpoint_url": standin.endpoint_url,
        "bundle_s3_region": "us-east-1",
        **overrides,
    }


def test_the_store_puts_reads_and_deletes_objects_multipart_too(s3: S3Standin) -> None:
    store = make_bundle_store(CoreSettings(**s3_settings(s3)))  # type: ignore[arg-type]
    assert isinstance(store, S3BundleStore)
    small, large = b"bundle bytes", bytes(range(256)) * 40_000  # 10 MB: a multipart upload
    store.put("wi-1.tar.gz", io.BytesIO(small))
    store.put("wi-2.tar.gz", io.BytesIO(large))
    assert s3.objects == {"bundles/wi-1.tar.gz": small, "bundles/wi-2.tar.gz": large}
    with store.open("wi-2.tar.gz") as stream:
        assert stream.read() == large
    store.delete("wi-1.tar.gz")
    assert list(s3.objects) == ["bundles/wi-2.tar.gz"]
    with pytest.raises(BundleStoreError, match="could not read the bundle from S3"):
        store.open("wi-1.tar.gz")


def test_a_refused_credential_or_a_missing_bucket_is_a_store_error(
    s3: S3Standin, monkeypatch: pytest.MonkeyPatch
) -> None:
    missing = make_bundle_store(CoreSettings(**s3_settings(s3, bundle_s3_bucket="nope")))  # type: ignore[arg-type]
    with pytest.raises(BundleStoreError, match="NoSuchBucket"):
        missing.put("k", io.BytesIO(b"x"))
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIAWRONG")
    refused = make_bundle_store(CoreSettings(**s3_settings(s3)))  # type: ignore[arg-type]
    with pytest.raises(BundleStoreError, match="InvalidAccessKeyId"):
        refused.put("k", io.BytesIO(b"x"))
    assert s3.objects == {}


def test_the_api_keeps_large_bundles_in_s3_and_streams_them_back(
    s3: S3Standin, make_client: ClientFactory, pg_db: Database
) -> None:
    client = make_client(**s3_settings(s3, bundle_inline_max_bytes=0))
    item_id, headers = running(client, pg_db, bundle=True)
    body = archive([manifest(file_entry("a.txt", b"alpha")), ("files/a.txt", b"alpha")])
    stored = client.put("/v1/runner/bundle", content=body.getvalue(), headers={**headers, **GZIP})
    assert stored.status_code == 200, stored.text
    key = f"{item_id}-{hashlib.sha256(body.getvalue()).hexdigest()[:32]}.tar.gz"
    assert s3.objects == {f"bundles/{key}": body.getvalue()}
    got = client.get(f"/v1/work-items/{item_id}/bundle", headers=admin_headers())
    assert got.status_code == 200 and got.content == body.getvalue()
    assert (
        client.get(f"/v1/work-items/{item_id}", headers=admin_headers()).json()["bundle"]["store"]
        == "s3"
    )


def test_a_misconfigured_s3_store_is_refused_saying_what_to_set(
    make_client: ClientFactory, pg_db: Database, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    with pytest.raises(ConfigurationError, match="needs CORRAL_BUNDLE_S3_BUCKET"):
        make_bundle_store(CoreSettings(bundle_store="s3"))
    monkeypatch.setitem(sys.modules, "boto3", None)  # as if the s3 extra were not installed
    with pytest.raises(ConfigurationError, match=r"pip install 'corral\[s3\]'"):
        make_bundle_store(CoreSettings(bundle_store="s3", bundle_s3_bucket=BUCKET))
    client = make_client(bundle_store="s3", bundle_inline_max_bytes=0)
    _, headers = running(client, pg_db, bundle=True)
    body = archive([manifest()]).getvalue()
    answer = client.put("/v1/runner/bundle", content=body, headers={**headers, **GZIP})
    assert answer.status_code == 503 and answer.json()["error"] == "bundle_store_unconfigured"
