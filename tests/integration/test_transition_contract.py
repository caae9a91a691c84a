"""Every work-item transition, written both ways the store writes one: the ORM's
``transition`` (one row the caller holds) and the set-based ``transition_items`` (a batch the
caller has locked). From identical rows, each move leaves the same item columns, the same
audit row, the same pool slot count and the same requests to end the item's sandboxes, on
SQLite and on PostgreSQL. The lifecycle's one table (``ITEM_TRANSITIONS``) decides them all;
this holds both writers to it."""

from __future__ import annotations

import itertools
import uuid
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest
from sqlalchemy import select

from corral.shared.store.db import Database, utcnow
from corral.shared.store.lifecycle import ItemMove, transition, transition_items
from corral.shared.store.models import (
    SLOT_HOLDING_STATES,
    ItemState,
    LifecycleEvent,
    Pool,
    Sandbox,
    WorkItem,
)

# Moves the store makes: from every state that is not final, to every other state.
MOVES = [
    (before, after)
    for before, after in itertools.product(ItemState, ItemState)
    if before != after and not before.is_final
]
STAMPS = ("updated_at", "routed_at", "provisioned_at", "claimed_at", "finished_at")


@pytest.fixture(params=["sqlite", "postgresql"])
def db(request: pytest.FixtureRequest) -> Iterator[Database]:
    name = "sqlite_db" if request.param == "sqlite" else "pg_db"
    yield request.getfixturevalue(name)


def _world(db: Database, state: ItemState) -> tuple[str, str]:
    """A pool and an item of it in ``state`` (holding a slot when the state does), with a
    live sandbox: the ids of the item and the pool."""
    suffix = uuid.uuid4().hex[:10]
    pool_id, item_id = f"pool-{suffix}", f"wi-{suffix}"
    holds = state in SLOT_HOLDING_STATES
    then = utcnow() - timedelta(minutes=5)
    with db.session() as session:
        session.add(
            Pool(
                id=pool_id,
                org_id=f"org{suffix}",
                name="p",
                provider_id="local",
                max_concurrent=5,
                slots_in_use=1 if holds else 0,
            )
        )
        session.flush()
        session.add(
            WorkItem(
                id=item_id,
                org_id=f"org{suffix}",
                project_id="p",
                profile="default",
                payload={},
                state=state.value,
                pool_id=pool_id,
                attempts=1,
                created_at=then,
                updated_at=then,
            )
        )
        session.flush()
        session.add(
            Sandbox(
                id=f"sb-{suffix}",
                work_item_id=item_id,
                attempt=1,
                org_id=f"org{suffix}",
                pool_id=pool_id,
                provider_id="local",
                status="running",
            )
        )
    return item_id, pool_id


def _left(db: Database, item_id: str, pool_id: str) -> dict[str, Any]:
    """What a move left: the item's state, which stamps it set, its audit rows, the pool's
    slots and whether the sandbox was asked to end."""
    with db.session() as session:
        item = session.get_one(WorkItem, item_id)
        events = session.execute(
            select(LifecycleEvent.from_state, LifecycleEvent.to_state, LifecycleEvent.detail)
            .where(LifecycleEvent.work_item_id == item_id)
            .order_by(LifecycleEvent.id)
        ).all()
        return {
            "state": item.state,
            "stamped": sorted(
                c
                for c in STAMPS
                if getattr(item, c) != item.created_at and getattr(item, c) is not None
            ),
            "error": (item.error_code, item.error_message),
            "events": [tuple(event) for event in events],
            "slots": session.get_one(Pool, pool_id).slots_in_use,
            "end_requested": session.scalar(
                select(Sandbox.end_requested_at.is_not(None)).where(Sandbox.work_item_id == item_id)
            ),
        }


@pytest.mark.parametrize(("before", "after"), MOVES, ids=lambda s: s.value)
def test_both_writers_leave_the_same_rows(
    db: Database, before: ItemState, after: ItemState
) -> None:
    error = ("work_failed", "exited with code 3") if after.is_final else (None, None)
    one_id, one_pool = _world(db, before)
    with db.session() as session:
        item = session.get_one(WorkItem, one_id)
        item.error_code, item.error_message = error
        transition(session, item, after, actor="test", detail="moved")
    batch_id, batch_pool = _world(db, before)
    with db.session() as session:
        move = ItemMove(
            batch_id,
            batch_pool,
            before.value,
            after,
            detail="moved",
            error_code=error[0],
            error_message=error[1],
        )
        transition_items(session, [move], actor="test")
    assert _left(db, one_id, one_pool) == _left(db, batch_id, batch_pool)
