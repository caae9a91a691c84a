"""`corral secret-key rotate` on real PostgreSQL: every sealed value (an in-flight item's
env, a value of the old format, a provider credential and configuration, a webhook secret)
is sealed again under the new key while the old one is still readable; an item in flight
is claimed with its env both during (old key in CORRAL_SECRET_KEY_PREVIOUS) and after the
rotation (old key dropped); a second run finds nothing to do; `check` says when the
previous key can go."""

from __future__ import annotations

import base64
import contextlib
import json
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from cryptography.fernet import Fernet
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.kdf.hkdf import HKDF
from fastapi.testclient import TestClient
from pydantic import SecretStr
from typer.testing import CliRunner

from corral.cli.app import app
from corral.providers.credentials import CredentialResolver
from corral.scheduler.api.app import create_app
from corral.shared import runtime
from corral.shared.broker import celery_app
from corral.shared.keyring import SEALED_V1, Keyring, key_id
from corral.shared.settings import CoreSettings
from corral.shared.store import provider_configs, rekey, secrets, webhooks
from corral.shared.store.credential_store import SqlCredentialStore
from corral.shared.store.db import Database, make_engine
from corral.shared.store.models import WorkItem
from corral.shared.store.sealing import Sealer
from tests.integration import test_secret_key_change as key_change
from tests.integration.test_api import ADMIN, awaiting_item
from tests.lock_waits import wait_for_lock_wait

OLD, NEW = key_change.OLD_KEY, key_change.NEW_KEY
SECRET = "in-flight-token-0815"
database_url = key_change.database_url  # the fixture: a database with acme's pool


def _v1(key: str, text: str) -> str:
    """A value as sealed before v2 (one Fernet key for everything, no place)."""
    derived = HKDF(
        algorithm=hashes.SHA256(), length=32, salt=None, info=b"corral provider credentials"
    ).derive(key.encode())
    return SEALED_V1 + Fernet(base64.urlsafe_b64encode(derived)).encrypt(text.encode()).decode()


@contextlib.contextmanager
def _api(url: str, key: str, previous: str | None) -> Iterator[TestClient]:
    settings = CoreSettings(
        database_url=url,
        admin_token=SecretStr(ADMIN),
        broker_url="memory://",
        secret_key=SecretStr(key),
        secret_key_previous=SecretStr(previous) if previous else None,
    )
    celery_app.configure(settings)
    keyring = Keyring(key, [previous] if previous else [])
    db = Database(make_engine(url, settings=settings), sealer=Sealer(keyring=keyring))
    runtime.install(runtime.Runtime(settings=settings, db=db))
    try:
        with TestClient(create_app(), raise_server_exceptions=False) as client:
            yield client
    finally:
        runtime.reset()
        db.dispose()


def _claimed_env(client: TestClient, token: str) -> dict[str, str]:
    registered = client.post("/v1/runner/register", json={"token": token})
    assert registered.status_code == 200, registered.text
    headers = {"Authorization": f"Bearer {registered.json()['session_token']}"}
    answer = client.post("/v1/runner/claim", json={}, headers=headers)
    assert answer.status_code == 200, answer.text
    env: dict[str, str] = answer.json()["env"]
    return env


def _item(db: Database, seal: str) -> tuple[str, str]:
    """An acme item waiting for its runner, its env sealed with the old key (``v2``) or in
    the old format (``v1``)."""
    item_id, token = awaiting_item(db, "acme", env={"API_TOKEN": SECRET})
    with db.session() as session:
        item = session.get_one(WorkItem, item_id)
        if seal == "v2":
            item.payload = Sealer(OLD).seal(item.payload, item.org_id, item.id)
        else:
            item.payload = {**item.payload, "env": {"API_TOKEN": _v1(OLD, SECRET)}}
    return item_id, token


def _seed_under_the_old_key(database_url: str) -> dict[str, Any]:
    """Items (two of the new format, one of the old), a credential, a provider config and
    a webhook endpoint, each sealed under OLD."""
    old_db = Database(make_engine(database_url), sealer=Sealer(OLD))
    try:
        claimed_during, during_token = _item(old_db, "v2")
        claimed_after, after_token = _item(old_db, "v2")
        _, legacy_token = _item(old_db, "v1")
        CredentialResolver(SqlCredentialStore(old_db.engine), secret_key=OLD).put(
            "acme", "e2b", "credential-of-acme"
        )
        provider_configs.store(old_db, "e2b", {"api_key": "config-secret"})
        secrets.set_secret(old_db, "acme", "deploy-token", "named-secret-of-acme")
        with old_db.session() as session:
            endpoint, hook_secret = webhooks.create_endpoint(
                session,
                Keyring(OLD),
                "acme",
                "https://hooks.example.test/a",
                ["item.final"],
                allow_http=False,
            )
    finally:
        old_db.dispose()
    return {
        "claimed_during": claimed_during,
        "claimed_after": claimed_after,
        "during_token": during_token,
        "after_token": after_token,
        "legacy_token": legacy_token,
        "endpoint": endpoint,
        "hook_secret": hook_secret,
    }


def test_rotation_reseals_everything_while_items_in_flight_finish(
    database_url: str, tmp_path: Path
) -> None:
    seeded = _seed_under_the_old_key(database_url)
    claimed_during, claimed_after = seeded["claimed_during"], seeded["claimed_after"]
    during_token, after_token = seeded["during_token"], seeded["after_token"]
    legacy_token, endpoint, hook_secret = (
        seeded["legacy_token"],
        seeded["endpoint"],
        seeded["hook_secret"],
    )
    rotating = Keyring(NEW, [OLD])
    db = Database(make_engine(database_url), sealer=Sealer(keyring=rotating))
    try:
        before = rekey.check(db, rotating)
        assert not before.done and len(before.stale["work_items"]) == 3
        assert [len(before.stale[t]) for t in ("provider_credentials", "provider_configs")] == [
            1,
            1,
        ]

        with _api(database_url, NEW, OLD) as client:  # during: the old key still readable
            assert _claimed_env(client, during_token)["API_TOKEN"] == SECRET
            report = rekey.rotate(db, rotating, batch=2)
        assert report.resealed == {
            "work_items": 3,
            "named_secrets": 1,
            "provider_credentials": 1,
            "provider_configs": 1,
            "webhook_endpoints": 1,
        }
        assert report.done and rekey.check(db, rotating).done
        assert sum(rekey.rotate(db, rotating).resealed.values()) == 0  # nothing left to do
        with db.session() as session:
            payload = session.get_one(WorkItem, claimed_after).payload
        assert payload["env"]["API_TOKEN"].startswith(f"corral-sealed:v2:{key_id(NEW)}:")
        assert SECRET not in json.dumps(payload)
    finally:
        db.dispose()

    # After: the old key is dropped, and everything still opens.
    with _api(database_url, NEW, None) as client:
        assert _claimed_env(client, after_token)["API_TOKEN"] == SECRET
        assert _claimed_env(client, legacy_token)["API_TOKEN"] == SECRET
    new_db = Database(make_engine(database_url), sealer=Sealer(NEW))
    try:
        resolver = CredentialResolver(SqlCredentialStore(new_db.engine), secret_key=NEW)
        assert resolver.resolve("acme", "e2b").get_secret_value() == "credential-of-acme"
        assert secrets.resolve_secret(new_db, "acme", "deploy-token") == "named-secret-of-acme"
        settings = CoreSettings(state_dir=tmp_path)
        config = provider_configs.effective_config(new_db, settings, "e2b").config
        assert config == {"api_key": "config-secret"}
        with new_db.session() as session:
            target = webhooks.signing_target(session, Keyring(NEW), endpoint["id"])
        assert target is not None and target.secret == hook_secret
        assert claimed_during  # claimed during the rotation, before the others
    finally:
        new_db.dispose()


def test_the_commands_rotate_and_say_when_the_previous_key_can_go(
    database_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    old_db = Database(make_engine(database_url), sealer=Sealer(OLD))
    try:
        _item(old_db, "v2")
    finally:
        old_db.dispose()
    monkeypatch.setenv("CORRAL_DATABASE_URL", database_url)
    monkeypatch.setenv("CORRAL_SECRET_KEY", NEW)
    monkeypatch.setenv("CORRAL_SECRET_KEY_PREVIOUS", OLD)
    runner = CliRunner()
    checked = runner.invoke(app, ["secret-key", "check"])
    assert checked.exit_code == 1 and "work_items: 1 to reseal" in checked.output
    rotated = runner.invoke(app, ["secret-key", "rotate"])
    assert rotated.exit_code == 0, rotated.output
    assert "work_items: 1 resealed" in rotated.output
    assert "CORRAL_SECRET_KEY_PREVIOUS can go" in rotated.output
    assert OLD not in rotated.output and NEW not in rotated.output
    monkeypatch.delenv("CORRAL_SECRET_KEY_PREVIOUS")
    assert runner.invoke(app, ["secret-key", "check"]).exit_code == 0


def test_a_write_racing_the_rotation_is_not_lost(database_url: str) -> None:
    old_db = Database(make_engine(database_url), sealer=Sealer(OLD))
    try:
        item_id, _ = _item(old_db, "v2")
    finally:
        old_db.dispose()
    rotating = Keyring(NEW, [OLD])
    db = Database(make_engine(database_url), sealer=Sealer(keyring=rotating))
    rotation: list[rekey.Report] = []
    try:
        with db.session() as session:  # a writer holds the row while the rotation starts
            item = session.get_one(WorkItem, item_id, with_for_update=True)
            worker = threading.Thread(target=lambda: rotation.append(rekey.rotate(db, rotating)))
            worker.start()
            wait_for_lock_wait(db, "the rotation")
            changed = {**item.payload, "env": {"API_TOKEN": "written-meanwhile"}}
            item.payload = Sealer(OLD).seal(changed, item.org_id, item.id)
        worker.join(timeout=60)
        assert not worker.is_alive() and rotation[0].done
        with db.session() as session:
            stored = session.get_one(WorkItem, item_id)
            opened = Sealer(NEW).open(stored.payload, stored.org_id, stored.id)
        assert opened["env"] == {"API_TOKEN": "written-meanwhile"}  # kept, and resealed
    finally:
        db.dispose()
