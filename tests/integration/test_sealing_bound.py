"""Sealed values are bound to their place, on real PostgreSQL: a sealed env value copied
from one item's stored payload into another's (of another org, or of the same org), a
provider credential row or a webhook secret copied to another org, is not opened: the
runner's claim and the provision path fail that item with ``sealed_elsewhere`` and never
hand the value over, while the item it was taken from still runs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import select

from corral.providers.credentials import CredentialResolver
from corral.scheduler.batch import accept_batch
from corral.shared.keyring import Keyring, SealedElsewhereError
from corral.shared.messages import DispatchRequest
from corral.shared.store import webhooks
from corral.shared.store.credential_store import SqlCredentialStore
from corral.shared.store.db import Database, make_engine
from corral.shared.store.models import ProviderCredential, WebhookEndpoint, WorkItem
from corral.worker.provision import Outcome, provision_item
from tests.integration import test_secret_key_change as key_change
from tests.integration.test_api import awaiting_item
from tests.seeding import SETTINGS

NEW_KEY = key_change.NEW_KEY
database_url = key_change.database_url  # the fixtures: a database with acme's pool
client_with_new_key = key_change.client_with_new_key

SECRET = "acme-only-token-4711"


def _sealed_item(db: Database, org: str) -> tuple[str, str]:
    """An item of ``org`` waiting for its runner, its env sealed as intake seals it."""
    item_id, token = awaiting_item(db, org, env={"API_TOKEN": SECRET})
    with db.session() as session:
        item = session.get_one(WorkItem, item_id)
        item.payload = db.sealer.seal(item.payload, item.org_id, item.id)
    return item_id, token


def _claim(client: TestClient, token: str) -> tuple[int, str]:
    registered = client.post("/v1/runner/register", json={"token": token})
    assert registered.status_code == 200, registered.text
    headers = {"Authorization": f"Bearer {registered.json()['session_token']}"}
    answer = client.post("/v1/runner/claim", json={}, headers=headers)
    return answer.status_code, answer.text


def _failed_elsewhere(db: Database, item_id: str) -> None:
    with db.session() as session:
        item = session.get_one(WorkItem, item_id)
        assert (item.state, item.error_code) == ("failed", "sealed_elsewhere")
        assert SECRET not in (item.error_message or "")
        assert "another org, item or field" in (item.error_message or "")


@pytest.mark.parametrize("thief_org", ["globex", "acme"])
def test_an_env_value_copied_into_another_items_payload_is_not_handed_to_its_runner(
    client_with_new_key: tuple[TestClient, Database], thief_org: str
) -> None:
    client, db = client_with_new_key
    victim_id, victim_token = _sealed_item(db, "acme")
    thief_id, thief_token = awaiting_item(db, thief_org)
    with db.session() as session:
        victim = session.get_one(WorkItem, victim_id)
        thief = session.get_one(WorkItem, thief_id)
        thief.payload = {**thief.payload, "env": dict(victim.payload["env"])}

    status, text = _claim(client, thief_token)
    assert status == 409 and SECRET not in text
    assert json.loads(text)["detail"]["error"] == "sealed_elsewhere"
    _failed_elsewhere(db, thief_id)

    status, text = _claim(client, victim_token)  # the item it came from still runs
    assert status == 200 and json.loads(text)["env"]["API_TOKEN"] == SECRET


def test_an_env_value_copied_into_another_item_fails_its_provision(
    database_url: str, tmp_path: Path
) -> None:
    rt, provider = key_change.worker_runtime(database_url, tmp_path, NEW_KEY)
    db = rt.db
    try:
        requests = [
            DispatchRequest.model_validate(
                {
                    "org": "acme",
                    "project": "web",
                    "profile": "default",
                    "work": {"kind": "shell", "command": "true"},
                    **extra,
                }
            )
            for extra in ({"env": {"API_TOKEN": SECRET}}, {"env": {"API_TOKEN": "mine"}})
        ]
        victim, thief = accept_batch(db, requests, actor="test", settings=SETTINGS)
        with db.session() as session:
            stolen = session.get_one(WorkItem, victim.item_id).payload["env"]
            row = session.get_one(WorkItem, thief.item_id)
            row.payload = {**row.payload, "env": dict(stolen)}
        assert provision_item(rt, thief.item_id, actor="worker:test") is Outcome.FAILED
        assert "provision" not in provider.methods()
        _failed_elsewhere(db, thief.item_id)
        assert provision_item(rt, victim.item_id, actor="worker:test") is Outcome.PROVISIONED
    finally:
        db.dispose()


def test_a_credential_row_copied_to_another_org_does_not_open(database_url: str) -> None:
    db = Database(make_engine(database_url))
    try:
        resolver = CredentialResolver(
            SqlCredentialStore(db.engine), keyring=Keyring(NEW_KEY), environ={}
        )
        resolver.put("acme", "e2b", SECRET)
        with db.session() as session:
            row = session.scalars(
                select(ProviderCredential).where(ProviderCredential.org_id == "acme")
            ).one()
            session.add(
                ProviderCredential(org_id="globex", provider_id="e2b", ciphertext=row.ciphertext)
            )
        with pytest.raises(SealedElsewhereError) as raised:
            resolver.resolve("globex", "e2b")
        assert SECRET not in str(raised.value)
        assert resolver.resolve("acme", "e2b").get_secret_value() == SECRET
    finally:
        db.dispose()


def test_a_webhook_secret_copied_to_another_orgs_endpoint_does_not_open(
    database_url: str,
) -> None:
    db, keyring = Database(make_engine(database_url)), Keyring(NEW_KEY)
    try:
        with db.session() as session:
            acme, secret = webhooks.create_endpoint(
                session,
                keyring,
                "acme",
                "https://hooks.example.test/a",
                ["item.final"],
                allow_http=False,
            )
            globex, _ = webhooks.create_endpoint(
                session,
                keyring,
                "globex",
                "https://hooks.example.test/g",
                ["item.final"],
                allow_http=False,
            )
        with db.session() as session:
            stolen = session.get_one(WebhookEndpoint, acme["id"]).secret_sealed
            session.get_one(WebhookEndpoint, globex["id"]).secret_sealed = stolen
        with db.session() as session, pytest.raises(SealedElsewhereError) as raised:
            webhooks.signing_target(session, keyring, globex["id"])
        assert secret not in str(raised.value)
        with db.session() as session:
            target = webhooks.signing_target(session, keyring, acme["id"])
            assert target is not None and target.secret == secret
    finally:
        db.dispose()
