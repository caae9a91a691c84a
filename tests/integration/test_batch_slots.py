"""A batch takes its pools' slots with guarded updates on PostgreSQL: a pool's counter never
passes its limit, whatever another router did between the batch's read and its update."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import pytest
from sqlalchemy import event, select, update

from corral.scheduler.batch import Taken, accept_batch
from corral.shared.db import Database
from corral.shared.messages import DispatchRequest
from corral.shared.models import ItemState, LifecycleEvent, Pool, WorkItem
from corral.shared.org_limits import set_limit
from tests.lock_waits import wait_for_lock_wait
from tests.seeding import org_with_pool


@pytest.fixture
def pool(pg_db: Database) -> Iterator[tuple[str, str]]:
    """(org, pool id) of a pool of 10 slots."""
    org = org_with_pool(pg_db, "s")
    yield org, f"pool-{org}"


def _requests(org: str, count: int) -> list[DispatchRequest]:
    work = {"kind": "shell", "command": "true"}
    message = {"org": org, "project": "p", "profile": "default", "work": work}
    return [DispatchRequest.model_validate(message) for _ in range(count)]


def _states(db: Database, org: str) -> list[str]:
    with db.session() as session:
        return sorted(session.scalars(select(WorkItem.state).where(WorkItem.org_id == org)))


def _in_use(db: Database, pool_id: str) -> int:
    with db.session() as session:
        return int(session.scalar(select(Pool.slots_in_use).where(Pool.id == pool_id)) or 0)


def _statements(
    db: Database, requests: list[DispatchRequest]
) -> tuple[list[tuple[str, bool]], list[Taken]]:
    """Each statement ``accept_batch`` sent, with whether it ran outside a transaction, and
    what it answered."""
    seen: list[tuple[str, bool]] = []

    def note(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        seen.append((statement, bool(conn.connection.dbapi_connection.autocommit)))

    event.listen(db.engine, "before_cursor_execute", note)
    try:
        taken = accept_batch(db, requests, actor="test")
    finally:
        event.remove(db.engine, "before_cursor_execute", note)
    return seen, taken


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
            target=lambda: done.append(accept_batch(pg_db, _requests(org, 3), actor="test"))
        )
        batch.start()
        wait_for_lock_wait(pg_db, "the batch's guarded update")
    batch.join(timeout=30)
    assert done, "the batch did not finish"
    # Routed again on the fresh counter: one slot was left.
    assert _states(pg_db, org) == [ItemState.ROUTED.value] + [ItemState.WAITING_CAPACITY.value] * 2
    assert _in_use(pg_db, pool_id) == 10


def test_concurrent_batches_never_take_more_slots_than_the_pool_has(
    pg_db: Database, pool: tuple[str, str]
) -> None:
    org, pool_id = pool
    threads = [
        threading.Thread(
            target=accept_batch, args=(pg_db, _requests(org, 4)), kwargs={"actor": "t"}
        )
        for _ in range(6)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    states = _states(pg_db, org)
    assert states.count(ItemState.ROUTED.value) == 10
    assert states.count(ItemState.WAITING_CAPACITY.value) == 14
    assert _in_use(pg_db, pool_id) == 10


def test_a_batch_with_keys_seen_before_takes_slots_for_its_new_items_only(
    pg_db: Database, pool: tuple[str, str]
) -> None:
    # Keys are not looked up before the write: the second batch's insert is refused by the
    # unique key, and the batch is written again knowing the items it names.
    org, pool_id = pool
    first = _requests(org, 2)
    first = [r.model_copy(update={"idempotency_key": f"k{n}"}) for n, r in enumerate(first)]
    before = accept_batch(pg_db, first, actor="test")
    again = [first[1], first[1].model_copy(update={"idempotency_key": "k-new"}), first[0]]
    after = accept_batch(pg_db, again, actor="test")
    assert [t.created for t in after] == [False, True, False]
    assert [t.existed for t in after] == [True, False, True]
    assert (after[0].item_id, after[2].item_id) == (before[1].item_id, before[0].item_id)
    assert _states(pg_db, org) == [ItemState.ROUTED.value] * 3
    assert _in_use(pg_db, pool_id) == 3


def test_a_one_pool_batch_is_written_in_one_statement_with_every_column(
    pg_db: Database, pool: tuple[str, str]
) -> None:
    org, pool_id = pool
    seen, taken = _statements(pg_db, _requests(org, 3))
    writes = [s for s, _ in seen if not s.lstrip().startswith("SELECT")]
    assert len(writes) == 1, writes
    assert "INSERT INTO work_items " in writes[0] and "INSERT INTO lifecycle_events " in writes[0]
    assert _in_use(pg_db, pool_id) == 3
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
    # An org's budgets are read at most once per budget_check_interval_s (then cached).
    seen, _ = _statements(pg_db, _requests(org, 2))
    seen = [(s, autocommit) for s, autocommit in seen if "FROM budgets" not in s]
    assert [autocommit for _, autocommit in seen] == [True, True], seen
    read, write = (statement for statement, _ in seen)
    assert "json_object_agg" in read and "JOIN pools" in read
    assert "corral_slots_taken" in write
    assert _states(pg_db, org) == [ItemState.ROUTED.value] * 2
    assert _in_use(pg_db, pool_id) == 2


def test_a_limited_orgs_batch_is_routed_in_a_transaction_that_locks_its_limit(
    pg_db: Database, pool: tuple[str, str]
) -> None:
    org, pool_id = pool
    with pg_db.session() as session:
        set_limit(session, org, 1)
    seen, _ = _statements(pg_db, _requests(org, 2))
    locked = [s for s, autocommit in seen if "FROM org_limits" in s and "FOR UPDATE" in s]
    assert len(locked) == 1, seen
    assert not next(autocommit for s, autocommit in seen if s == locked[0])
    assert "corral_slots_taken" in seen[-1][0] and not seen[-1][1]  # the write, in it too
    assert _states(pg_db, org) == [ItemState.ROUTED.value, ItemState.WAITING_CAPACITY.value]
    assert _in_use(pg_db, pool_id) == 1
