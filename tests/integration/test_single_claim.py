"""A sandbox's work is claimed once, by one runner, on real PostgreSQL through the api.

A provision retried after a lost answer can leave two pods of one sandbox, each with a token
of its own (the earlier try's redeemed before it was revoked). Whichever runner claims first
runs the work; the other can no longer claim, heartbeat or report, and no runner registers
for a sandbox whose work is claimed. The claiming runner's own repeated claim (its answer
lost) is answered as the first."""

from __future__ import annotations

import uuid

from fastapi.testclient import TestClient
from sqlalchemy import select

from corral.shared.store.db import Database
from corral.shared.store.models import Sandbox
from corral.shared.store.tokens import mint_registration_token
from tests.integration.test_api import admin_headers, awaiting_item, client

__all__ = ["client"]  # the api fixture, shared with test_api


def _register(client: TestClient, token: str) -> dict[str, str]:
    answer = client.post("/v1/runner/register", json={"token": token})
    assert answer.status_code == 200, answer.text
    return {"Authorization": f"Bearer {answer.json()['session_token']}"}


def test_the_work_of_a_sandbox_is_claimed_once_by_one_runner(
    client: TestClient, pg_db: Database
) -> None:
    item_id, first = awaiting_item(pg_db, f"org-{uuid.uuid4().hex[:8]}")
    with pg_db.session() as session:  # the pods of two tries of its provision
        sandbox = session.scalars(select(Sandbox).where(Sandbox.work_item_id == item_id)).one()
        second = mint_registration_token(session, sandbox, ttl_s=60)
        late = mint_registration_token(session, sandbox, ttl_s=60)
    as_first, as_second = _register(client, first), _register(client, second)

    assert client.post("/v1/runner/claim", json={}, headers=as_first).status_code == 200
    assert client.post("/v1/runner/claim", json={}, headers=as_second).status_code == 401
    assert client.post("/v1/runner/heartbeat", json={}, headers=as_second).status_code == 401
    done = {"exit_code": 0, "result": "second"}
    assert client.post("/v1/runner/complete", json=done, headers=as_second).status_code == 401
    assert client.post("/v1/runner/register", json={"token": late}).status_code == 401

    again = client.post("/v1/runner/claim", json={}, headers=as_first)  # its answer was lost
    assert again.status_code == 200 and again.json()["work_item_id"] == item_id
    done = {"exit_code": 0, "result": "first"}
    assert client.post("/v1/runner/complete", json=done, headers=as_first).json() == {
        "state": "succeeded"
    }
    view = client.get(f"/v1/work-items/{item_id}", headers=admin_headers()).json()
    assert view["result"] == "first"
    events = client.get(f"/v1/work-items/{item_id}/events", headers=admin_headers()).json()
    claims = [e for e in events["events"] if e["entity"] == "work_item" and e["to"] == "running"]
    assert len(claims) == 1
