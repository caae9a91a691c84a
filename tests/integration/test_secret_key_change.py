"""CORRAL_SECRET_KEY changed while items were in flight, on real PostgreSQL: an item whose
env values were sealed with the old key fails at once (``secret_key_mismatch``, saying to
restore the old key), both where a provider worker opens them and where a runner claims,
instead of waiting for the reaper or answering 500."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from pydantic import SecretStr
from sqlalchemy import select

from corral.providers.testing import InMemoryProvider
from corral.scheduler.admin.pools import ProfileCreate, create_profile
from corral.scheduler.api.app import create_app
from corral.scheduler.batch import accept_batch
from corral.shared import runtime
from corral.shared.broker import celery_app
from corral.shared.messages import DispatchRequest
from corral.shared.settings import CoreSettings
from corral.shared.store.db import Database, make_engine
from corral.shared.store.models import AuthMode, Pool, RegistrationToken, Sandbox, WorkItem
from corral.shared.store.sealing import Sealer
from corral.worker.provision import Outcome, provision_item
from tests.integration.test_api import ADMIN, awaiting_item
from tests.seeding import SETTINGS

OLD_KEY = "old-key-Ab3Cd5Ef7Gh9Jk2Lm4Np6Qr8St0Uv1"
NEW_KEY = "new-key-Wx3Yz5Ab7Cd9Ef2Gh4Jk6Lm8Np0Qr1"
SECRET = "the-sealed-value-4711"


def _failed_with_mismatch(db: Database, item_id: str) -> WorkItem:
    with db.session() as session:
        item = session.get_one(WorkItem, item_id)
        session.expunge(item)
    assert (item.state, item.error_code) == ("failed", "secret_key_mismatch")
    assert "Restore the previous CORRAL_SECRET_KEY" in (item.error_message or "")
    assert SECRET not in (item.error_message or "")
    return item


def worker_runtime(
    database_url: str, tmp_path: Path, key: str
) -> tuple[runtime.Runtime, InMemoryProvider]:
    """A provider worker's runtime with the secret key ``key``, and its in-memory provider."""
    settings = CoreSettings(state_dir=tmp_path, secret_key=SecretStr(key))
    db = Database(make_engine(database_url, settings=settings), sealer=Sealer(key))
    rt = runtime.Runtime(settings=settings, db=db)
    provider = InMemoryProvider()
    rt.use_provider(provider)
    return rt, provider


@pytest.fixture
def database_url(fresh_pg_url: str) -> str:
    db = Database(make_engine(fresh_pg_url))
    try:
        create_profile(db, ProfileCreate(name="default", model="m", auth_mode=AuthMode.BYOK))
        with db.session() as session:
            pool = Pool(id="pool-mem", org_id="acme", name="mem", provider_id="in-memory")
            pool.max_concurrent, pool.sandbox_config = 10, {}
            session.add(pool)
    finally:
        db.dispose()
    return fresh_pg_url


def test_a_provision_with_another_key_fails_the_item_at_once(
    database_url: str, tmp_path: Path
) -> None:
    sealing = Database(make_engine(database_url), sealer=Sealer(OLD_KEY))
    request = DispatchRequest.model_validate(
        {
            "org": "acme",
            "project": "web",
            "profile": "default",
            "env": {"API_TOKEN": SECRET},
            "work": {"kind": "shell", "command": "true"},
        }
    )
    [taken] = accept_batch(sealing, [request], actor="test", settings=SETTINGS)
    sealing.dispose()
    assert taken.outcome.queue == "provision.in-memory"

    rt, provider = worker_runtime(database_url, tmp_path, NEW_KEY)
    db = rt.db
    try:
        outcome = provision_item(rt, taken.item_id, actor="worker:test")
        assert outcome is Outcome.FAILED
        assert "provision" not in provider.methods()  # no sandbox was made
        _failed_with_mismatch(db, taken.item_id)
        with db.session() as session:
            [sandbox] = session.scalars(
                select(Sandbox).where(Sandbox.work_item_id == taken.item_id)
            ).all()
            assert (sandbox.status, sandbox.lease_until) == ("failed", None)
            [token] = session.scalars(
                select(RegistrationToken).where(RegistrationToken.sandbox_id == sandbox.id)
            ).all()
            assert token.redeemed_at is not None  # revoked: no runner can register
        # A second delivery of the task finds the item ended: nothing is retried.
        assert provision_item(rt, taken.item_id, actor="worker:test") is Outcome.SKIPPED
    finally:
        db.dispose()


@pytest.fixture
def client_with_new_key(database_url: str) -> Iterator[tuple[TestClient, Database]]:
    settings = CoreSettings(
        database_url=database_url,
        admin_token=SecretStr(ADMIN),
        broker_url="memory://",
        secret_key=SecretStr(NEW_KEY),
    )
    celery_app.configure(settings)
    db = Database(make_engine(database_url, settings=settings), sealer=Sealer(NEW_KEY))
    runtime.install(runtime.Runtime(settings=settings, db=db))
    try:
        with TestClient(create_app(), raise_server_exceptions=False) as client:
            yield client, db
    finally:
        runtime.reset()
        db.dispose()


def _sealed_with_old_key(db: Database) -> tuple[str, str]:
    """An item awaiting its claim whose env value was sealed with the old key: its id and
    its registration token."""
    item_id, token = awaiting_item(db, "acme")
    with db.session() as session:
        item = session.get_one(WorkItem, item_id)
        env = {**item.payload, "env": {"API_TOKEN": SECRET}}
        item.payload = Sealer(OLD_KEY).seal(env, item.org_id, item.id)
    return item_id, token


def test_a_claim_with_another_key_fails_the_item_and_answers_why(
    client_with_new_key: tuple[TestClient, Database],
) -> None:
    client, db = client_with_new_key
    item_id, token = _sealed_with_old_key(db)
    registered = client.post("/v1/runner/register", json={"token": token})
    assert registered.status_code == 200, registered.text
    headers = {"Authorization": f"Bearer {registered.json()['session_token']}"}

    answer = client.post("/v1/runner/claim", json={}, headers=headers)
    assert answer.status_code == 409, answer.text
    detail = answer.json()["detail"]
    assert detail["error"] == "secret_key_mismatch"
    assert "Restore the previous CORRAL_SECRET_KEY" in detail["message"]
    assert SECRET not in answer.text
    _failed_with_mismatch(db, item_id)

    # The runner's retry of its claim hears that the item is over, and the item's view
    # says why; the value appears nowhere.
    again = client.post("/v1/runner/claim", json={}, headers=headers)
    assert (again.status_code, again.json()["detail"]) == (409, "work item is failed")
    shown = client.get(f"/v1/work-items/{item_id}", headers={"Authorization": f"Bearer {ADMIN}"})
    assert shown.json()["error"]["code"] == "secret_key_mismatch"
    assert SECRET not in json.dumps(shown.json())


def test_a_registration_asking_to_claim_such_an_item_leaves_it_to_the_claim_which_says_why(
    client_with_new_key: tuple[TestClient, Database],
) -> None:
    client, db = client_with_new_key
    item_id, token = _sealed_with_old_key(db)
    registered = client.post("/v1/runner/register", json={"token": token, "claim": True})
    assert registered.status_code == 200, registered.text
    assert registered.json()["claim"] is None and SECRET not in registered.text
    with db.session() as session:
        assert session.get_one(WorkItem, item_id).state == "awaiting_claim"  # left as it was
    headers = {"Authorization": f"Bearer {registered.json()['session_token']}"}
    answer = client.post("/v1/runner/claim", json={}, headers=headers)
    assert (answer.status_code, answer.json()["detail"]["error"]) == (409, "secret_key_mismatch")
    _failed_with_mismatch(db, item_id)
