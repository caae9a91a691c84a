"""A batch takes its pools' slots with guarded updates on PostgreSQL: a pool's counter never
passes its limit, whatever another router did between the batch's read and its update."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest
from sqlalchemy import select, update

from corral.scheduler.batch import accept_batch
from corral.shared.store.db import Database
from corral.shared.store.models import ItemState, LifecycleEvent, Pool, WorkItem
from corral.shared.store.org_limits import set_limit
from tests.batches import in_use, requests_for, statements, states
from tests.lock_waits import wait_for_lock_wait
from tests.seeding import SETTINGS, org_with_pool


@pytest.fixture
def pool(pg_db: Database) -> Iterator[tuple[str, str]]:
    """(org, pool id) of a pool of 10 slots."""
    org = org_with_pool(pg_db, "s")
    yield org, f"pool-{org}"


def test_slots_taken_between_the_read_and_the_update_route_the_batch_again(
    pg_db: Database, pool: tuple[str, str]
) -> None:
    org, pool_id = pool
    done: list[object] = []
    with pg_db.session() as other:
        # Another router has taken 9 of the 10 slots and not committed yet: the batch reads
        # 0 in use, routes its 3 items there, and its guarded update waits for this row.
        other.execute(update(Pool).where(Pool.id == pool_id).values(slots_in_use=9))
        batch = threading.Thread(
            target=lambda: done.append(
                accept_batch(pg_db, requests_for(org, 3), actor="test", settings=SETTINGS)
            )
        )
        batch.start()
        wait_for_lock_wait(pg_db, "the batch's guarded update")
    batch.join(timeout=30)
    assert done, "the batch did not finish"
    # Routed again on the fresh counter: one slot was left.
    assert states(pg_db, org) == [ItemState.ROUTED.value] + [ItemState.WAITING_CAPACITY.value] * 2
    assert in_use(pg_db, pool_id) == 10


def test_concurrent_batches_never_take_more_slots_than_the_pool_has(
    pg_db: Database, pool: tuple[str, str]
) -> None:
    org, pool_id = pool
    threads = [
        threading.Thread(
            target=accept_batch,
            args=(pg_db, requests_for(org, 4)),
            kwargs={"actor": "t", "settings": SETTINGS},
        )
        for _ in range(6)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    found = states(pg_db, org)
    assert found.count(ItemState.ROUTED.value) == 10
    assert found.count(ItemState.WAITING_CAPACITY.value) == 14
    assert in_use(pg_db, pool_id) == 10


def test_a_batch_with_keys_seen_before_takes_slots_for_its_new_items_only(
    pg_db: Database, pool: tuple[str, str]
) -> None:
    # Keys are not looked up before the write: the second batch's insert is refused by the
    # unique key, and the batch is written again knowing the items it names.
    org, pool_id = pool
    first = requests_for(org, 2)
    first = [r.model_copy(update={"idempotency_key": f"k{n}"}) for n, r in enumerate(first)]
    before = accept_batch(pg_db, first, actor="test", settings=SETTINGS)
    again = [first[1], first[1].model_copy(update={"idempotency_key": "k-new"}), first[0]]
    after = accept_batch(pg_db, again, actor="test", settings=SETTINGS)
    assert [t.created for t in after] == [False, True, False]
    assert [t.existed for t in after] == [True, False, True]
    assert (after[0].item_id, after[2].item_id) == (before[1].item_id, before[0].item_id)
    assert states(pg_db, org) == [ItemState.ROUTED.value] * 3
    assert in_use(pg_db, pool_id) == 3


def test_a_one_pool_batch_is_written_in_one_statement_with_every_column(
    pg_db: Database, pool: tuple[str, str]
) -> None:
    org, pool_id = pool
    seen, taken = statements(pg_db, requests_for(org, 3))
    writes = [s for s, _ in seen if not s.lstrip().startswith("SELECT")]
    assert len(writes) == 1, writes
    assert "INSERT INTO work_items " in writes[0] and "INSERT INTO lifecycle_events " in writes[0]
    assert in_use(pg_db, pool_id) == 3
    with pg_db.session() as session:
        items = session.scalars(select(WorkItem).where(WorkItem.org_id == org)).all()
        assert sorted(item.id for item in items) == sorted(t.item_id for t in taken)
        for item in items:
            assert (item.state, item.pool_id, item.attempts) == ("routed", pool_id, 1)
            assert (item.log_bytes, item.log_lines, item.log_dropped_lines) == (0, 0, 0)
            assert item.created_at == item.routed_at
        moves = session.scalars(
            select(LifecycleEvent.to_state)
            .where(LifecycleEvent.work_item_id.in_([item.id for item in items]))
            .order_by(LifecycleEvent.id)
        ).all()
    assert sorted(moves) == ["received"] * 3 + ["routed"] * 3


def test_a_one_pool_batch_is_one_read_and_one_write_outside_a_transaction(
    pg_db: Database, pool: tuple[str, str]
) -> None:
    # Two round trips and no BEGIN or COMMIT: each statement commits on its own, and the
    # write takes the slots or writes nothing (the race test above).
    org, pool_id = pool
    # An org's budgets are read at most once per budget_check_interval_s, and the queues'
    # consumers (which flag an item no worker would provision) every SERVED_CACHE_S: cached.
    seen, _ = statements(pg_db, requests_for(org, 2))
    cached = ("FROM budgets", "FROM queue_consumers")
    seen = [(s, autocommit) for s, autocommit in seen if not any(c in s for c in cached)]
    assert [autocommit for _, autocommit in seen] == [True, True], seen
    read, write = (statement for statement, _ in seen)
    assert "json_object_agg" in read and "JOIN pools" in read
    assert "corral_slots_taken" in write
    assert states(pg_db, org) == [ItemState.ROUTED.value] * 2
    assert in_use(pg_db, pool_id) == 2


def test_a_limited_orgs_batch_is_routed_in_a_transaction_that_locks_its_limit(
    pg_db: Database, pool: tuple[str, str]
) -> None:
    org, pool_id = pool
    with pg_db.session() as session:
        set_limit(session, org, 1)
    seen, _ = statements(pg_db, requests_for(org, 2))
    locked = [s for s, autocommit in seen if "FROM org_limits" in s and "FOR UPDATE" in s]
    assert len(locked) == 1, seen
    assert not next(autocommit for s, autocommit in seen if s == locked[0])
    assert "corral_slots_taken" in seen[-1][0] and not seen[-1][1]  # the write, in it too
    assert states(pg_db, org) == [ItemState.ROUTED.value, ItemState.WAITING_CAPACITY.value]
    assert in_use(pg_db, pool_id) == 1
