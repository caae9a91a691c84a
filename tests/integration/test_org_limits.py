"""An org's limit on work in flight across all its pools, on PostgreSQL: batches and the
re-drive of waiting items never route past it, even when they race."""

from __future__ import annotations

import threading
import uuid
from collections.abc import Iterator

import pytest
from sqlalchemy import select, update

from corral.scheduler.batch import accept_batch
from corral.scheduler.intake import route_item
from corral.shared.messages import DispatchRequest
from corral.shared.store.db import Database
from corral.shared.store.lifecycle import transition
from corral.shared.store.models import ItemState, ModelProfile, Pool, WorkItem
from corral.shared.store.org_limits import OrgRoom, in_flight, set_limit
from tests.lock_waits import wait_for_lock_wait
from tests.seeding import SETTINGS


@pytest.fixture
def org(pg_db: Database) -> Iterator[str]:
    """An org with two pools of 5 slots each and a limit of 3 across them."""
    org_id = f"lim{uuid.uuid4().hex[:8]}"
    with pg_db.session() as session:
        if session.get(ModelProfile, "default") is None:
            session.add(ModelProfile(name="default", model="m", auth_mode="byok"))
        for name in ("a", "b"):
            session.add(
                Pool(
                    id=f"pool-{org_id}-{name}",
                    org_id=org_id,
                    name=name,
                    provider_id="local",
                    max_concurrent=5,
                )
            )
        session.flush()
        set_limit(session, org_id, 3)
    yield org_id


def _requests(org_id: str, count: int) -> list[DispatchRequest]:
    work = {"kind": "shell", "command": "true"}
    message = {"org": org_id, "project": "p", "profile": "default", "work": work}
    return [DispatchRequest.model_validate(message) for _ in range(count)]


def _by_state(db: Database, org_id: str) -> dict[str, list[str]]:
    found: dict[str, list[str]] = {}
    with db.session() as session:
        for item_id, state in session.execute(
            select(WorkItem.id, WorkItem.state).where(WorkItem.org_id == org_id)
        ):
            found.setdefault(state, []).append(item_id)
    return found


def test_a_batch_routes_up_to_the_org_limit_and_the_rest_wait(pg_db: Database, org: str) -> None:
    accept_batch(pg_db, _requests(org, 5), actor="test", settings=SETTINGS)
    states = _by_state(pg_db, org)
    assert len(states[ItemState.ROUTED.value]) == 3
    assert len(states[ItemState.WAITING_CAPACITY.value]) == 2
    with pg_db.session() as session:
        assert in_flight(session, org) == 3  # both pools had room: the org's limit held them


def test_a_batch_waits_for_another_router_of_the_org_and_sees_what_it_took(
    pg_db: Database, org: str
) -> None:
    with pg_db.session() as session:  # a disabled pool: routing never touches its row
        session.add(
            Pool(
                id=f"pool-{org}-c",
                org_id=org,
                name="c",
                provider_id="local",
                max_concurrent=5,
                active=False,
            )
        )
    done: list[object] = []
    with pg_db.session() as other:
        # Another router of the org holds its limit's lock and has taken 3 slots (on the
        # disabled pool, so no pool row is shared) without committing: the batch must wait
        # for it, then see those 3 and route nothing.
        OrgRoom.read(other, [org])
        other.execute(update(Pool).where(Pool.id == f"pool-{org}-c").values(slots_in_use=3))
        batch = threading.Thread(
            target=lambda: done.append(
                accept_batch(pg_db, _requests(org, 3), actor="t", settings=SETTINGS)
            )
        )
        batch.start()
        wait_for_lock_wait(pg_db, "the batch's read of the org's limit")
    batch.join(timeout=30)
    assert done, "the batch did not finish"
    assert sorted(_by_state(pg_db, org)) == [ItemState.WAITING_CAPACITY.value]


def test_racing_batches_never_pass_the_org_limit(pg_db: Database, org: str) -> None:
    threads = [
        threading.Thread(
            target=accept_batch,
            args=(pg_db, _requests(org, 3)),
            kwargs={"actor": "t", "settings": SETTINGS},
        )
        for _ in range(4)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    states = _by_state(pg_db, org)
    assert len(states[ItemState.ROUTED.value]) == 3
    assert len(states[ItemState.WAITING_CAPACITY.value]) == 9


def test_a_waiting_item_is_routed_again_once_the_org_has_room(pg_db: Database, org: str) -> None:
    accept_batch(pg_db, _requests(org, 4), actor="test", settings=SETTINGS)
    states = _by_state(pg_db, org)
    (waiting,) = states[ItemState.WAITING_CAPACITY.value]
    assert (
        route_item(pg_db, waiting, actor="test", settings=SETTINGS).state
        is ItemState.WAITING_CAPACITY
    )
    with pg_db.session() as session:  # one routed item ends: its slot is the org's again
        done = session.get_one(WorkItem, states[ItemState.ROUTED.value][0])
        transition(session, done, ItemState.CANCELLED, actor="test")
    assert route_item(pg_db, waiting, actor="test", settings=SETTINGS).state is ItemState.ROUTED
    with pg_db.session() as session:
        assert in_flight(session, org) == 3


def test_an_org_without_a_limit_fills_its_pools(pg_db: Database, org: str) -> None:
    with pg_db.session() as session:
        set_limit(session, org, None)
    accept_batch(pg_db, _requests(org, 12), actor="test", settings=SETTINGS)
    states = _by_state(pg_db, org)
    assert len(states[ItemState.ROUTED.value]) == 10  # two pools of 5
    assert len(states[ItemState.WAITING_CAPACITY.value]) == 2
