"""A runner's report hands its slot on in the api's own process: the next waiting item is
routed and its provision sent by the time the report's answer is back, with no message to
the maintenance worker (corral.scheduler.hand_on); its sandbox's end goes with the api's
next batch of ends (corral.scheduler.end_batches)."""

from __future__ import annotations

import uuid
from typing import Any

import pytest

from corral.providers.base import SandboxState
from corral.scheduler.end_batches import END_BATCHES
from corral.shared.broker.celery_app import app as celery_app
from corral.shared.store.db import Database
from corral.shared.store.lifecycle import sandbox_transition, transition
from corral.shared.store.models import ItemState, Sandbox, WorkItem
from corral.shared.store.tokens import mint_registration_token
from tests.integration.api_clients import ClientFactory
from tests.seeding import admitted_item, org_with_pool


def _sandbox_awaiting_its_runner(db: Database, item_id: str) -> str:
    """The routed item's sandbox is up: the runner's registration token."""
    with db.session() as session:
        item = session.get(WorkItem, item_id)
        assert item is not None and item.state == ItemState.ROUTED.value
        sandbox = Sandbox(
            id=f"sb-{uuid.uuid4().hex}",
            work_item_id=item_id,
            attempt=item.attempts,
            org_id=item.org_id,
            pool_id=item.pool_id,
            provider_id="local",
            status=SandboxState.PROVISIONING.value,
        )
        session.add(sandbox)
        session.flush()
        for state in (ItemState.PROVISIONING, ItemState.AWAITING_CLAIM):
            transition(session, item, state, actor="test")
        sandbox_transition(session, sandbox, SandboxState.READY, actor="test")
        return mint_registration_token(session, sandbox, ttl_s=60)


def test_a_report_hands_its_slot_on_before_its_answer_is_back(
    make_client: ClientFactory, pg_db: Database, monkeypatch: pytest.MonkeyPatch
) -> None:
    client = make_client(end_batch_s=30)  # the sandbox's end waits for the flush below
    org = org_with_pool(pg_db, "hand", max_concurrent=1)
    running, waiting = admitted_item(pg_db, org), admitted_item(pg_db, org)
    assert _state(pg_db, waiting) == ItemState.WAITING_CAPACITY.value
    token = _sandbox_awaiting_its_runner(pg_db, running)
    registered = client.post("/v1/runner/register", json={"token": token})
    headers = {"Authorization": f"Bearer {registered.json()['session_token']}"}
    assert client.post("/v1/runner/claim", json={}, headers=headers).status_code == 200
    sent: list[tuple[str, Any]] = []
    monkeypatch.setattr(celery_app, "send_task", lambda name, **kw: sent.append((name, kw["args"])))

    answer = client.post("/v1/runner/complete", json={"exit_code": 0}, headers=headers)

    assert answer.status_code == 200 and answer.json() == {"state": "succeeded"}, answer.text
    assert _state(pg_db, waiting) == ItemState.ROUTED.value
    # The next item's provision, and no re-drive: its sandbox's end waits for its batch.
    assert sent == [("corral.provision", [waiting])]
    END_BATCHES.flush()
    sandbox_id = registered.json()["sandbox_id"]
    assert sent[1:] == [("corral.terminate_many", [[sandbox_id], "finished"])]


def _state(db: Database, item_id: str) -> str:
    with db.session() as session:
        item = session.get(WorkItem, item_id)
        assert item is not None
        return item.state
