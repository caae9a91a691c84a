"""Result bundles through the api on PostgreSQL: upload, refusals, download, review (of the
bundle downloaded, by its SHA-256, once the item has ended, with the ``review`` scope), and
``corral bundle`` reading what the api kept."""

from __future__ import annotations

import hashlib
import uuid
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from typer.testing import CliRunner

from corral.cli.app import app
from corral.shared import runtime
from corral.shared.store.db import Database
from tests.bundle_archives import Member, archive, deleted_entry, file_entry, manifest
from tests.integration.api_clients import ClientFactory
from tests.integration.test_api import admin_headers, awaiting_item, message
from tests.integration.test_org_keys import bearer, make_key

GZIP = {"Content-Type": "application/gzip"}
# Org keys' scopes, for who may review: only review and admin hold the review scope.
SCOPE_SETS = (("dispatch",), ("read",), ("dispatch", "read"), ("review",), ("admin",))


def org() -> str:
    return f"org-{uuid.uuid4().hex[:8]}"


def running(
    client: TestClient, db: Database, owner: str | None = None, **fields: Any
) -> tuple[str, dict[str, str]]:
    """A claimed item of ``owner`` (else a new org; its message with ``fields``) and its
    runner session's headers."""
    item_id, token = awaiting_item(db, owner or org(), **fields)
    session = client.post("/v1/runner/register", json={"token": token}).json()["session_token"]
    headers = {"Authorization": f"Bearer {session}"}
    claimed = client.post("/v1/runner/claim", json={}, headers=headers)
    assert claimed.status_code == 200, claimed.text
    return item_id, headers


def bundle(files: dict[str, bytes], *, extra: tuple[tuple[str, bytes], ...] = ()) -> bytes:
    """A bundle adding ``files`` and deleting old.txt, with ``extra`` members after."""
    entries = [file_entry(path, data) for path, data in files.items()]
    members: list[Member] = [manifest(*entries, deleted_entry("old.txt"))]
    members += [(f"files/{path}", data) for path, data in files.items()] + list(extra)
    return archive(members).getvalue()


def view(client: TestClient, item_id: str) -> dict[str, Any]:
    answer: dict[str, Any] = client.get(f"/v1/work-items/{item_id}", headers=admin_headers()).json()
    return answer


def downloaded_sha256(client: TestClient, item_id: str) -> str:
    """The digest a reviewer's download of the item's bundle names."""
    got = client.get(f"/v1/work-items/{item_id}/bundle", headers=admin_headers())
    assert got.status_code == 200, got.text
    assert got.headers["x-corral-bundle-sha256"] == hashlib.sha256(got.content).hexdigest()
    return got.headers["x-corral-bundle-sha256"]


def held_for_review(client: TestClient, db: Database, owner: str | None = None) -> str:
    """An item that ended with a bundle held for review."""
    item_id, headers = running(client, db, owner, review={"required": True})
    stored = client.put(
        "/v1/runner/bundle", content=bundle({"a.txt": b"x"}), headers=GZIP | headers
    )
    assert stored.json() == {"review": "review_requested"}
    done = client.post("/v1/runner/complete", json={"exit_code": 0}, headers=headers)
    assert done.json() == {"state": "succeeded"}
    return item_id


def bundle_events(client: TestClient, item_id: str) -> list[tuple[str | None, str, str]]:
    events = client.get(f"/v1/work-items/{item_id}/events", headers=admin_headers()).json()
    return [(e["from"], e["to"], e["actor"]) for e in events["events"] if e["entity"] == "bundle"]


@pytest.mark.parametrize("inline_max", [1_000_000, 0], ids=["in-the-database", "filesystem"])
def test_a_bundle_is_kept_and_streamed_back_byte_for_byte(
    make_client: ClientFactory, pg_db: Database, tmp_path: Path, inline_max: int
) -> None:
    client = make_client(bundle_inline_max_bytes=inline_max, bundle_dir=tmp_path / "store")
    item_id, headers = running(client, pg_db, bundle=True)
    archive = bundle({"a.txt": b"alpha\n", "dir/b.bin": b"\x00\x01"})
    stored = client.put("/v1/runner/bundle", content=archive, headers={**headers, **GZIP})
    assert stored.status_code == 200, stored.text
    assert stored.json() == {"review": "not_required"}
    key = f"{item_id}-{hashlib.sha256(archive).hexdigest()[:32]}.tar.gz"
    assert list((tmp_path / "store").glob("*.tar.gz")) == (
        [] if inline_max else [tmp_path / "store" / key]
    )
    # The runner session reads its own; the admin any.
    for who in (headers, admin_headers()):
        got = client.get(f"/v1/work-items/{item_id}/bundle", headers=who)
        assert got.status_code == 200 and got.content == archive
        assert got.headers["x-corral-bundle-review"] == "not_required"
    shown = view(client, item_id)["bundle"]
    assert shown["changes"] == 3 and shown["sha256"] == hashlib.sha256(archive).hexdigest()
    assert shown["store"] == ("database" if inline_max else "filesystem")
    done = client.post("/v1/runner/complete", json={"exit_code": 0}, headers=headers)
    assert done.json() == {"state": "succeeded"}
    other_id, other = running(client, pg_db)
    assert client.get(f"/v1/work-items/{item_id}/bundle", headers=other).status_code == 404
    assert client.get(f"/v1/work-items/{other_id}/bundle", headers=other).status_code == 404


def test_a_bundle_sent_again_replaces_the_object_and_none_is_taken_after_the_end(
    make_client: ClientFactory, pg_db: Database, tmp_path: Path
) -> None:
    client = make_client(bundle_inline_max_bytes=0, bundle_dir=tmp_path / "store")
    item_id, headers = running(client, pg_db, bundle=True)
    first, second = bundle({"a.txt": b"one\n"}), bundle({"a.txt": b"two\n"})
    for upload in (first, second):
        sent = client.put("/v1/runner/bundle", content=upload, headers={**headers, **GZIP})
        assert sent.status_code == 200, sent.text
    # The second replaced the first, whose object is gone.
    assert [p.name for p in (tmp_path / "store").glob("*.tar.gz")] == [
        f"{item_id}-{hashlib.sha256(second).hexdigest()[:32]}.tar.gz"
    ]
    done = client.post("/v1/runner/complete", json={"exit_code": 0}, headers=headers)
    assert done.json() == {"state": "succeeded"}
    late = bundle({"a.txt": b"changed after the end\n"})
    refused = client.put("/v1/runner/bundle", content=late, headers={**headers, **GZIP})
    assert refused.status_code == 409
    # Nothing was written for it: the kept bundle and its object are the second's.
    assert len(list((tmp_path / "store").glob("*.tar.gz"))) == 1
    got = client.get(f"/v1/work-items/{item_id}/bundle", headers=admin_headers())
    assert got.content == second
    assert got.headers["x-corral-bundle-sha256"] == hashlib.sha256(second).hexdigest()


def test_a_path_traversal_in_a_hand_made_bundle_is_refused_and_fails_the_item(
    make_client: ClientFactory, pg_db: Database
) -> None:
    client = make_client()
    item_id, headers = running(client, pg_db, bundle=True)
    archive = bundle({"a.txt": b"x"}, extra=(("files/../../etc/cron.d/evil", b"* * * * *"),))
    refused = client.put("/v1/runner/bundle", content=archive, headers={**headers, **GZIP})
    assert refused.status_code == 422
    assert refused.json()["error"] == "bundle_invalid"
    assert "leaves the bundle" in refused.json()["detail"][0]["message"]
    assert "cron" not in refused.text  # the path is not quoted back
    shown = view(client, item_id)
    assert shown["state"] == "failed" and shown["error"]["code"] == "bundle_invalid"
    assert shown["bundle"] is None
    # The runner's completion after it keeps the item as it is.
    done = client.post("/v1/runner/complete", json={"exit_code": 0}, headers=headers)
    assert done.json() == {"state": "failed"}


def test_bundles_over_the_limits_are_refused_and_fail_the_item_bundle_too_large(
    make_client: ClientFactory, pg_db: Database
) -> None:
    client = make_client(bundle_max_bytes=100_000)
    # The body itself is over the route's limit: 413 before it is read.
    _, headers = running(client, pg_db, bundle=True)
    body = bytes(2_500_000)
    over = client.put("/v1/runner/bundle", content=body, headers={**headers, **GZIP})
    assert over.status_code == 413 and over.json()["error"] == "body_too_large"
    # A small archive that inflates past the limit: refused as it is read.
    item_id, headers = running(client, pg_db, bundle=True)
    archive = bundle({"zeros.bin": bytes(200_000)})
    assert len(archive) < 10_000
    refused = client.put("/v1/runner/bundle", content=archive, headers={**headers, **GZIP})
    assert refused.status_code == 413 and refused.json()["error"] == "bundle_too_large"
    assert refused.json()["limit_bytes"] == 100_000
    shown = view(client, item_id)
    assert shown["error"]["code"] == "bundle_too_large"
    assert "limit of 100000 bytes" in shown["error"]["message"]
    # A runner that kept its bundle back says so in its completion.
    kept_id, kept = running(client, pg_db, bundle=True)
    body = {"exit_code": 0, "error_code": "bundle_too_large", "error": "over the limit of 1 byte"}
    assert client.post("/v1/runner/complete", json=body, headers=kept).json() == {"state": "failed"}
    assert view(client, kept_id)["error"]["code"] == "bundle_too_large"


def test_the_claim_carries_the_bundle_limits_and_the_git_input(
    make_client: ClientFactory, pg_db: Database
) -> None:
    client = make_client(bundle_max_patches=7)
    git = {"url": "https://example.invalid/repo.git", "ref": "main"}
    _, token = awaiting_item(
        pg_db,
        org(),
        inputs={"git": git},
        review={"required": True},
        egress={"allow_network": True},
    )
    session = client.post("/v1/runner/register", json={"token": token}).json()["session_token"]
    claim = client.post(
        "/v1/runner/claim", json={}, headers={"Authorization": f"Bearer {session}"}
    ).json()
    assert claim["bundle"] == {
        "max_bytes": 100_000_000,
        "max_manifest_bytes": 5_000_000,
        "max_patches": 7,
    }
    assert claim["inputs"] == {"git": {**git, "secret": None}}  # every field, always sent
    _, plain = running(client, pg_db)
    assert client.post("/v1/runner/claim", json={}, headers=plain).json()["bundle"] is None


def test_review_accept_and_reject_are_lifecycle_events_over_the_api(
    make_client: ClientFactory, pg_db: Database
) -> None:
    client = make_client()
    decided = {}
    for decision in ("accept", "reject"):
        item_id, headers = running(client, pg_db, review={"required": True})
        archive = bundle({"a.txt": b"x"})
        stored = client.put("/v1/runner/bundle", content=archive, headers={**headers, **GZIP})
        assert stored.json() == {"review": "review_requested"}
        client.post("/v1/runner/complete", json={"exit_code": 0}, headers=headers)
        # Only the admin decides.
        path = f"/v1/work-items/{item_id}/bundle/{decision}"
        seen = {"sha256": hashlib.sha256(archive).hexdigest()}
        assert client.post(path, json=seen, headers=headers).status_code == 401
        answer = client.post(path, json=seen, headers=admin_headers())
        assert answer.status_code == 200, answer.text
        decided[decision] = (item_id, answer.json()["review"])
        again = client.post(path, json=seen, headers=admin_headers())
        assert again.json()["review"] == answer.json()["review"]
        assert bundle_events(client, item_id) == [
            (None, "review_requested", "runner"),
            ("review_requested", answer.json()["review"], "api"),
        ]
        shown = view(client, item_id)
        assert shown["state"] == "succeeded"  # the item's outcome is the work's
        assert shown["bundle"]["review"] == answer.json()["review"]
        assert shown["bundle"]["reviewed_by"] == "api"
    assert decided["accept"][1] == "accepted" and decided["reject"][1] == "rejected"
    # A decided bundle is not decided again the other way.
    accepted_id = decided["accept"][0]
    seen = {"sha256": downloaded_sha256(client, accepted_id)}
    again = client.post(
        f"/v1/work-items/{accepted_id}/bundle/reject", json=seen, headers=admin_headers()
    )
    assert again.status_code == 409 and again.json()["error"] == "bundle_conflict"
    missing = client.post(
        f"/v1/work-items/{uuid.uuid4().hex}/bundle/accept", json=seen, headers=admin_headers()
    )
    assert missing.status_code == 404


def test_a_review_decides_on_the_bundle_downloaded_never_one_that_replaced_it(
    make_client: ClientFactory, pg_db: Database
) -> None:
    client = make_client()
    item_id, headers = running(client, pg_db, review={"required": True})
    first, second = bundle({"a.txt": b"reviewed\n"}), bundle({"a.txt": b"slipped in\n"})
    client.put("/v1/runner/bundle", content=first, headers=GZIP | headers)
    seen_first = downloaded_sha256(client, item_id)  # the reviewer reads A ...
    client.put("/v1/runner/bundle", content=second, headers=GZIP | headers)  # ... B replaces it
    client.post("/v1/runner/complete", json={"exit_code": 0}, headers=headers)
    path = f"/v1/work-items/{item_id}/bundle"
    for decision in ("accept", "reject"):
        stale = client.post(
            f"{path}/{decision}", json={"sha256": seen_first}, headers=admin_headers()
        )
        assert stale.status_code == 409, stale.text
        assert stale.json()["error"] == "bundle_changed"
        [problem] = stale.json()["detail"]
        assert problem["field"] == "sha256" and "download it again" in problem["message"]
        assert hashlib.sha256(second).hexdigest() not in stale.text  # told to read it, not given
    assert view(client, item_id)["bundle"]["review"] == "review_requested"
    assert [to for _, to, _ in bundle_events(client, item_id)] == ["review_requested"] * 2
    # Read again, B is what is decided on (the digest in either case).
    seen_second = downloaded_sha256(client, item_id)
    assert seen_second == hashlib.sha256(second).hexdigest()
    accepted = client.post(
        f"{path}/accept", json={"sha256": seen_second.upper()}, headers=admin_headers()
    )
    assert accepted.status_code == 200 and accepted.json()["review"] == "accepted"
    assert bundle_events(client, item_id)[-1] == ("review_requested", "accepted", "api")


def test_a_review_names_a_well_formed_sha256(make_client: ClientFactory, pg_db: Database) -> None:
    client = make_client()
    item_id = held_for_review(client, pg_db)
    path = f"/v1/work-items/{item_id}/bundle/accept"
    for body in ({"sha256": "abc"}, {"sha256": "g" * 64}, {"sha256": 7}, {}):
        refused = client.post(path, json=body, headers=admin_headers())
        assert refused.status_code == 422, (body, refused.text)
        assert refused.json()["detail"][0]["field"] == "sha256", refused.text
    assert view(client, item_id)["bundle"]["review"] == "review_requested"


def test_a_bundle_is_not_reviewed_while_its_item_runs(
    make_client: ClientFactory, pg_db: Database
) -> None:
    client = make_client()
    item_id, headers = running(client, pg_db, review={"required": True})
    client.put("/v1/runner/bundle", content=bundle({"a.txt": b"x"}), headers=GZIP | headers)
    seen = {"sha256": downloaded_sha256(client, item_id)}
    for decision in ("accept", "reject"):
        early = client.post(
            f"/v1/work-items/{item_id}/bundle/{decision}", json=seen, headers=admin_headers()
        )
        assert early.status_code == 409, early.text
        assert early.json()["error"] == "item_running"
        assert "work item is running" in early.json()["detail"][0]["message"]
    assert view(client, item_id)["bundle"]["review"] == "review_requested"
    client.post("/v1/runner/complete", json={"exit_code": 0}, headers=headers)
    ended = client.post(
        f"/v1/work-items/{item_id}/bundle/accept", json=seen, headers=admin_headers()
    )
    assert ended.status_code == 200 and ended.json()["review"] == "accepted"


def test_the_review_scope_decides_and_dispatch_or_read_do_not(
    make_client: ClientFactory, pg_db: Database
) -> None:
    client = make_client()
    owner = org()
    keys = {scopes: make_key(client, owner, *scopes) for scopes in SCOPE_SETS}
    for scopes, key in keys.items():
        for decision in ("accept", "reject"):
            item_id = held_for_review(client, pg_db, owner)
            seen = {"sha256": downloaded_sha256(client, item_id)}
            answer = client.post(
                f"/v1/work-items/{item_id}/bundle/{decision}", json=seen, headers=bearer(key)
            )
            if "review" in scopes or "admin" in scopes:
                assert answer.status_code == 200, (scopes, answer.text)
            else:
                assert answer.status_code == 403, (scopes, answer.text)
                assert "review scope" in answer.text
                assert view(client, item_id)["bundle"]["review"] == "review_requested"
    # A review key reads what it reviews, and dispatches nothing.
    reviewer = bearer(keys[("review",)])
    item_id = held_for_review(client, pg_db, owner)
    assert client.get(f"/v1/work-items/{item_id}/bundle", headers=reviewer).status_code == 200
    assert client.post("/v1/dispatch", json=message(owner), headers=reviewer).status_code == 403


def test_corral_bundle_writes_the_files_out_after_review_and_refuses_to_leave_dir(
    make_client: ClientFactory, pg_db: Database, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    client = make_client(bundle_dir=tmp_path / "store", bundle_inline_max_bytes=0)
    item_id, headers = running(client, pg_db, review={"required": True})
    archive = bundle({"a.txt": b"alpha\n", "deep/b.txt": b"beta\n"})
    client.put("/v1/runner/bundle", content=archive, headers={**headers, **GZIP})
    monkeypatch.setattr("corral.cli.output.runtime", runtime.current)  # corral bundle
    monkeypatch.setattr("corral.cli.commands._runtime", runtime.current)  # corral show
    cli = CliRunner()
    out = tmp_path / "out"
    held = cli.invoke(app, ["bundle", item_id, "-o", str(out)])
    assert held.exit_code == 1 and "review_requested: accept it first" in held.output
    assert not out.exists()
    shown = cli.invoke(app, ["bundle", item_id])
    assert shown.exit_code == 0, shown.output
    assert "add     deep/b.txt" in shown.output and "old.txt  (listed, not deleted)" in shown.output
    digest = hashlib.sha256(archive).hexdigest()
    assert f"  sha256 {digest}" in shown.output
    client.post("/v1/runner/complete", json={"exit_code": 0}, headers=headers)
    # accept names the bundle reviewed, and says where its digest is.
    unnamed = cli.invoke(app, ["bundle", "accept", item_id])
    assert unnamed.exit_code == 2 and "--sha256 DIGEST" in unnamed.output
    assert f"corral bundle {item_id}` prints it" in unnamed.output
    other = cli.invoke(app, ["bundle", "accept", item_id, "--sha256", "0" * 64])
    assert other.exit_code == 2 and "download it again" in other.output
    accepted = cli.invoke(app, ["bundle", "accept", item_id, "--sha256", digest])
    assert accepted.exit_code == 0 and f"{item_id}: bundle accepted" in accepted.output
    show = cli.invoke(app, ["show", item_id])
    assert (
        "review accepted" in show.output and "review_requested -> accepted  by cli" in show.output
    )
    # A symlink in DIR that leads out of it is not written through.
    outside = tmp_path / "outside"
    outside.mkdir()
    out.mkdir()
    (out / "deep").symlink_to(outside)
    escaped = cli.invoke(app, ["bundle", item_id, "-o", str(out)])
    assert escaped.exit_code == 1 and "refusing to write outside" in escaped.output
    assert list(outside.iterdir()) == []
    (out / "deep").unlink()
    written = cli.invoke(app, ["bundle", item_id, "-o", str(out)])
    assert written.exit_code == 0, written.output
    assert (out / "a.txt").read_bytes() == b"alpha\n"
    assert (out / "deep" / "b.txt").read_bytes() == b"beta\n"
    assert not (out / "old.txt").exists() and "wrote 2 files" in written.output


def test_a_failed_attempts_bundle_is_discarded_when_its_lease_retries_the_item(
    make_client: ClientFactory, pg_db: Database, tmp_path: Path
) -> None:
    from sqlalchemy import update

    from corral.shared.store.models import WorkItem

    client = make_client(bundle_dir=tmp_path / "store")
    item_id, headers = running(client, pg_db, bundle=True, review={"required": True})
    with pg_db.session() as session:  # as routing stores what the message's lease chose
        session.execute(
            update(WorkItem)
            .where(WorkItem.id == item_id)
            .values(lease={"retry_on_work_failed": True, "max_attempts": 3})
        )
    half_done = bundle({"half.txt": b"half-done\n"})
    stored = client.put("/v1/runner/bundle", content=half_done, headers={**headers, **GZIP})
    assert stored.json()["review"] == "review_requested"
    done = client.post("/v1/runner/complete", json={"exit_code": 1}, headers=headers)
    assert done.json()["state"] == "received", done.text  # requeued for attempt 2
    view = client.get(f"/v1/work-items/{item_id}", headers=admin_headers()).json()
    assert view["bundle"]["review"] == "discarded"
    assert (
        client.get(f"/v1/work-items/{item_id}/bundle", headers=admin_headers()).status_code == 404
    )
    seen = {"sha256": hashlib.sha256(half_done).hexdigest()}
    accept = client.post(
        f"/v1/work-items/{item_id}/bundle/accept", json=seen, headers=admin_headers()
    )
    assert accept.status_code == 409
    again = client.put("/v1/runner/bundle", content=half_done, headers={**headers, **GZIP})
    assert again.status_code == 409  # the ended attempt keeps nothing


def test_a_refused_bundle_of_an_attempt_that_ended_meanwhile_fails_nothing(
    make_client: ClientFactory, pg_db: Database, monkeypatch: pytest.MonkeyPatch
) -> None:
    from sqlalchemy import update

    from corral.shared.store import bundle_records
    from corral.shared.store.bundles import BundleInvalidError
    from corral.shared.store.models import WorkItem

    client = make_client()
    item_id, headers = running(client, pg_db, bundle=True)

    def requeued_while_read(*args: Any, **kwargs: Any) -> Any:
        # While this attempt's upload is read, the item moves on: attempt 2 now runs.
        with pg_db.session() as session:
            session.execute(update(WorkItem).where(WorkItem.id == item_id).values(attempts=2))
        raise BundleInvalidError("not a bundle")

    monkeypatch.setattr(bundle_records, "read_bundle", requeued_while_read)
    refused = client.put("/v1/runner/bundle", content=b"x", headers={**headers, **GZIP})
    assert refused.status_code == 422 and refused.json()["error"] == "bundle_invalid"
    shown = view(client, item_id)
    assert shown["state"] == "running" and shown["error"] is None  # attempt 2 runs on
