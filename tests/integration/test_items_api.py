"""The api for callers of work items: a dispatch answers the item's state (and a dispatch
error's reason), an org key lists and searches its own org's items a page at a time, and a
read may wait for the item to end."""

from __future__ import annotations

import asyncio
import threading
import time
import uuid

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import update

from corral.scheduler.admin.pools import PoolCreate, ProfileCreate, create_pool, create_profile
from corral.scheduler.api import items_api
from corral.shared.runtime import Runtime
from corral.shared.settings import CoreSettings
from corral.shared.store.db import Database
from corral.shared.store.lifecycle import transition
from corral.shared.store.models import AuthMode, ItemState, WorkItem
from tests.conftest import TEST_SECRET_KEY
from tests.integration.api_clients import ClientFactory
from tests.integration.test_api import message
from tests.integration.test_org_keys import bearer, make_key


@pytest.fixture
def client(make_client: ClientFactory) -> TestClient:
    return make_client(secret_key=TEST_SECRET_KEY)


def _org(db: Database) -> str:
    org = f"items-{uuid.uuid4().hex[:8]}"
    create_profile(db, ProfileCreate(name="default", model="m", auth_mode=AuthMode.BYOK))
    create_pool(db, PoolCreate(org_id=org, name="p", provider_id="local"))
    return org


def test_a_dispatch_answers_the_items_state_and_a_dispatch_errors_reason(
    client: TestClient, pg_db: Database
) -> None:
    org = _org(pg_db)
    key = make_key(client, org, "dispatch")
    routed = client.post("/v1/dispatch", json=message(org), headers=bearer(key))
    assert routed.status_code == 202 and routed.json()["state"] == "routed", routed.text
    assert routed.json()["error"] is None
    refused = client.post("/v1/dispatch", json=message(org, profile="nope"), headers=bearer(key))
    body = refused.json()
    assert (body["state"], body["error"]["code"]) == ("dispatch_error", "unknown_profile"), body
    again = client.post(
        "/v1/dispatch",
        json=message(org, profile="nope"),
        headers=bearer(key) | {"Idempotency-Key": "k1"},
    )
    repeat = client.post(
        "/v1/dispatch",
        json=message(org, profile="nope"),
        headers=bearer(key) | {"Idempotency-Key": "k1"},
    )
    assert repeat.status_code == 200 and repeat.json() == again.json() | {"created": False}


def test_an_org_key_lists_its_own_items_a_page_at_a_time(
    client: TestClient, pg_db: Database
) -> None:
    org, other = _org(pg_db), _org(pg_db)
    key = make_key(client, org, "dispatch")
    ids = []
    for number in range(5):
        headers = bearer(key) | {"Idempotency-Key": f"key-{number}"}
        ids.append(client.post("/v1/dispatch", json=message(org), headers=headers).json()["id"])
    client.post(
        "/v1/dispatch", json=message(other), headers=bearer(make_key(client, other, "dispatch"))
    )
    seen, cursor = [], None
    while True:
        query = {"limit": 2} | ({"cursor": cursor} if cursor else {})
        page = client.get("/v1/work-items", params=query, headers=bearer(key)).json()
        seen += [row["id"] for row in page["items"]]
        assert all(row["org"] == org for row in page["items"])
        cursor = page["next_cursor"]
        if cursor is None:
            break
    assert seen == list(reversed(ids))  # newest first, each once, none of the other org's
    found = client.get(
        "/v1/work-items", params={"idempotency_key": "key-3"}, headers=bearer(key)
    ).json()
    assert [row["id"] for row in found["items"]] == [ids[3]]
    with pg_db.session() as session:  # as a corral.dispatch message's item carries it
        session.execute(update(WorkItem).where(WorkItem.id == ids[1]).values(task_id="task-1"))
    by_task = client.get("/v1/work-items", params={"task_id": "task-1"}, headers=bearer(key))
    assert [(row["id"], row["task_id"]) for row in by_task.json()["items"]] == [(ids[1], "task-1")]
    routed = client.get("/v1/work-items", params={"state": "routed"}, headers=bearer(key)).json()
    assert len(routed["items"]) == 5
    # Another org's items are never listed, whatever the key asks for.
    refused = client.get("/v1/work-items", params={"org": other}, headers=bearer(key))
    assert refused.status_code == 404
    bad = client.get("/v1/work-items", params={"cursor": "not-a-cursor"}, headers=bearer(key))
    assert bad.status_code == 422 and "cursor" in bad.text


def test_a_read_waits_for_the_item_to_end(client: TestClient, pg_db: Database) -> None:
    org = _org(pg_db)
    key = make_key(client, org, "dispatch")
    item_id = client.post("/v1/dispatch", json=message(org), headers=bearer(key)).json()["id"]
    started = time.monotonic()
    quick = client.get(f"/v1/work-items/{item_id}", params={"wait": 0.3}, headers=bearer(key))
    assert quick.json()["state"] == "routed" and time.monotonic() - started >= 0.3

    def finish() -> None:
        time.sleep(0.5)
        with pg_db.session() as session:
            item = session.get_one(WorkItem, item_id)
            transition(session, item, ItemState.CANCELLED, actor="test")

    threading.Thread(target=finish).start()
    started = time.monotonic()
    waited = client.get(f"/v1/work-items/{item_id}", params={"wait": 30}, headers=bearer(key))
    assert waited.json()["state"] == "cancelled"
    assert time.monotonic() - started < 10  # answered when it ended, not at the deadline
    too_long = client.get(f"/v1/work-items/{item_id}", params={"wait": 61}, headers=bearer(key))
    assert too_long.status_code == 422


def test_one_orgs_waits_do_not_crowd_out_anothers(client: TestClient, pg_db: Database) -> None:
    """Org A holds as many waits as one org may: its next wait answers at once, while org
    B's wait still holds until B's item ends."""
    waits = items_api.Waits(total=4, per_org=2)
    rt = Runtime(settings=CoreSettings(), db=pg_db)
    a, b = _org(pg_db), _org(pg_db)
    a_item = client.post(
        "/v1/dispatch", json=message(a), headers=bearer(make_key(client, a, "dispatch"))
    )
    b_item = client.post(
        "/v1/dispatch", json=message(b), headers=bearer(make_key(client, b, "dispatch"))
    )
    a_id, b_id = a_item.json()["id"], b_item.json()["id"]

    async def scene() -> tuple[float, float]:
        held = [
            asyncio.create_task(items_api.wait_until_final(rt, a_id, 30, org_id=a, waits=waits))
            for _ in range(2)
        ]
        while waits.held.get(a) != 2:
            await asyncio.sleep(0.01)
        started = time.monotonic()
        await items_api.wait_until_final(rt, a_id, 30, org_id=a, waits=waits)
        a_third = time.monotonic() - started
        b_wait = asyncio.create_task(
            items_api.wait_until_final(rt, b_id, 30, org_id=b, waits=waits)
        )
        started = time.monotonic()
        await asyncio.sleep(0.5)
        assert not b_wait.done()  # B's wait holds: the item is not final
        await asyncio.to_thread(_cancel, pg_db, b_id)
        await b_wait
        b_held = time.monotonic() - started
        await asyncio.to_thread(_cancel, pg_db, a_id)
        await asyncio.gather(*held)
        return a_third, b_held

    a_third, b_held = asyncio.run(scene())
    assert a_third < 5  # answered at once, not held to its 30 s
    assert 0.5 <= b_held < 10  # held, and answered when B's item ended
    assert waits.held == {}  # every wait given back


def _cancel(db: Database, item_id: str) -> None:
    with db.session() as session:
        transition(session, session.get_one(WorkItem, item_id), ItemState.CANCELLED, actor="test")
