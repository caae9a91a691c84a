"""Accepting and routing a batch in one transaction, and the pools' slot counters."""

from __future__ import annotations

from sqlalchemy import select

from corral.scheduler.batch import accept_batch
from corral.scheduler.intake import accept, route_item
from corral.shared import runtime
from corral.shared.store.db import Database
from corral.shared.store.lifecycle import transition
from corral.shared.store.models import ItemState, Pool, WorkItem
from corral.shared.store.slots import reconcile_slot_counts
from corral.worker import maintenance
from tests.seeding import SETTINGS
from tests.unit.test_intake import ACTOR, dispatch, events, load, make_pool, make_profile


def slots(db: Database, pool_id: str) -> int:
    with db.session() as session:
        pool = session.get(Pool, pool_id)
        assert pool is not None
        return pool.slots_in_use


def test_a_batch_is_written_routed_and_its_slots_taken_at_once(sqlite_db: Database) -> None:
    make_profile(sqlite_db)
    pool_id = make_pool(sqlite_db, max_concurrent=2)
    requests = [
        dispatch(idempotency_key="a"),
        dispatch(idempotency_key="b"),
        dispatch(idempotency_key="a"),  # the same key again in the same batch
        dispatch(idempotency_key="c"),  # the pool is full by now
        dispatch(idempotency_key="d", profile="nosuch"),
    ]
    taken = accept_batch(sqlite_db, requests, actor=ACTOR, settings=SETTINGS)
    assert [t.created for t in taken] == [True, True, False, True, True]
    assert taken[2].item_id == taken[0].item_id and not taken[2].existed
    states = [load(sqlite_db, t.item_id).state for t in taken]
    assert states == ["routed", "routed", "routed", "waiting_capacity", "dispatch_error"]
    assert [t.outcome.queue for t in taken[:2]] == ["provision.local"] * 2
    assert slots(sqlite_db, pool_id) == 2
    assert events(sqlite_db, taken[0].item_id) == [(None, "received"), ("received", "routed")]
    failed = load(sqlite_db, taken[4].item_id)
    assert (failed.error_code, failed.finished_at is not None) == ("unknown_profile", True)

    again = accept_batch(sqlite_db, [dispatch(idempotency_key="b")], actor=ACTOR, settings=SETTINGS)
    assert (again[0].item_id, again[0].created, again[0].existed) == (taken[1].item_id, False, True)


def test_leaving_a_slot_holding_state_frees_the_slot_and_drift_is_corrected(
    sqlite_db: Database,
) -> None:
    make_profile(sqlite_db)
    pool_id = make_pool(sqlite_db, max_concurrent=1)
    first = accept(sqlite_db, dispatch(idempotency_key="x"), actor=ACTOR)
    assert (
        route_item(sqlite_db, first.item_id, actor=ACTOR, settings=SETTINGS).state
        is ItemState.ROUTED
    )
    second = accept(sqlite_db, dispatch(idempotency_key="y"), actor=ACTOR)
    assert (
        route_item(sqlite_db, second.item_id, actor=ACTOR, settings=SETTINGS).state
        is ItemState.WAITING_CAPACITY
    )
    assert slots(sqlite_db, pool_id) == 1
    with sqlite_db.session() as session:
        item = session.get(WorkItem, first.item_id)
        assert item is not None
        transition(session, item, ItemState.CANCELLED, actor=ACTOR)
    assert slots(sqlite_db, pool_id) == 0
    # The freed slot is owed to the waiting item: the re-drive hands it on (admission order).
    redriven = maintenance.redrive(runtime.Runtime(settings=SETTINGS, db=sqlite_db), actor=ACTOR)
    assert [(o.item_id, o.state) for o in redriven.routed] == [(second.item_id, ItemState.ROUTED)]

    with sqlite_db.session() as session:  # a counter that drifted, whatever the cause
        pool = session.get(Pool, pool_id)
        assert pool is not None
        pool.slots_in_use = 7
    assert reconcile_slot_counts(sqlite_db) == {pool_id: (7, 1)}
    assert slots(sqlite_db, pool_id) == 1
    assert reconcile_slot_counts(sqlite_db) == {}
    with sqlite_db.session() as session:
        assert session.scalar(select(Pool.slots_in_use).where(Pool.id == pool_id)) == 1
