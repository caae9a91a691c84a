"""Ending a batch of sandboxes on SQLite (the embedded database of ``corral dev``): the
same set-based statements as on PostgreSQL, with its settling, slots and ledger."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy import event, select

from corral.providers.testing import InMemoryProvider
from corral.shared.runtime import Runtime
from corral.shared.settings import CoreSettings
from corral.shared.store.db import Database
from corral.shared.store.lifecycle import transition
from corral.shared.store.models import (
    CostEvent,
    ItemState,
    LifecycleEvent,
    Pool,
    Sandbox,
    TerminationReason,
    WorkItem,
)
from corral.worker.provision import Outcome, provision_item
from corral.worker.termination import EndRequest, end_sandbox, end_sandboxes
from tests.seeding import in_memory_pool
from tests.unit.test_provision import routed_item


@pytest.fixture
def rt(sqlite_db: Database, tmp_path: Path) -> Iterator[Runtime]:
    runtime = Runtime(settings=CoreSettings(state_dir=tmp_path, max_attempts=2), db=sqlite_db)
    runtime.use_provider(InMemoryProvider())
    in_memory_pool(sqlite_db)
    yield runtime


def _provisioned(rt: Runtime) -> tuple[str, str]:
    """A routed and provisioned item, waiting for its runner: (item id, sandbox id)."""
    item_id = routed_item(rt)
    assert provision_item(rt, item_id, actor="test") is Outcome.PROVISIONED
    with rt.db.session() as session:
        sandbox_id = session.scalars(
            select(Sandbox.id).where(Sandbox.work_item_id == item_id)
        ).one()
    return item_id, sandbox_id


def test_a_batch_requeues_fails_leaves_alone_and_bills_each_sandbox_once(rt: Runtime) -> None:
    (requeued, first), (gone, second), (done, third), (ended, fourth) = (
        _provisioned(rt) for _ in range(4)
    )
    end_sandbox(rt, fourth, reason=TerminationReason.CANCELLED, actor="api")
    with rt.db.session() as session:  # the second sandbox is its item's last attempt
        session.get_one(WorkItem, gone).attempts = 2
        session.get_one(Sandbox, second).attempt = 2

    endings = end_sandboxes(
        rt,
        [
            EndRequest(first, TerminationReason.NEVER_CLAIMED, "never claimed"),
            EndRequest(second, TerminationReason.GONE, "the provider no longer has it", kill=False),
            EndRequest(third, TerminationReason.FINISHED),
            EndRequest(fourth, TerminationReason.DEADLINE),
        ],
        actor="reaper",
    )

    assert endings.errors == {}
    assert {
        sandbox_id: (outcome.reason, outcome.requeued, outcome.failed)
        for sandbox_id, outcome in endings.ended.items()
    } == {
        first: (TerminationReason.NEVER_CLAIMED, requeued, None),
        second: (TerminationReason.GONE, None, gone),
        third: (TerminationReason.FINISHED, None, None),
    }
    with rt.db.session() as session:
        items = {i.id: i for i in session.scalars(select(WorkItem))}
        sandboxes = {s.id: s for s in session.scalars(select(Sandbox))}
        billed = Counter(session.scalars(select(CostEvent.sandbox_id)))
        endings_logged = Counter(
            session.scalars(
                select(LifecycleEvent.entity_id).where(
                    LifecycleEvent.entity == "sandbox",
                    LifecycleEvent.to_state.in_(["terminated", "failed"]),
                )
            )
        )
        slots = session.get_one(Pool, "pool-mem").slots_in_use
    assert [items[i].state for i in (requeued, gone, done, ended)] == [
        "received",
        "failed",
        "awaiting_claim",
        "awaiting_claim",
    ]
    assert items[gone].error_message == ("the provider no longer has it; gave up after 2 attempts")
    assert [sandboxes[s].status for s in (first, second, third, fourth)] == [
        "terminated",
        "failed",
        "terminated",
        "terminated",
    ]
    assert sandboxes[fourth].termination_reason == "cancelled"  # ended before: left alone
    assert all(sandbox.cost_due_at is None for sandbox in sandboxes.values())
    assert billed == endings_logged == Counter([first, second, third, fourth])
    assert slots == 2  # the requeued and the failed item gave theirs back


def test_the_works_own_end_reads_no_attempts_and_writes_its_cost_in_one_transaction(
    rt: Runtime,
) -> None:
    _, sandbox_id = _provisioned(rt)
    statements: list[str] = []
    commits: list[bool] = []

    def executed(_c: object, _cur: object, statement: str, *_rest: object) -> None:
        statements.append(statement)

    def committed(_c: object) -> None:
        commits.append(True)

    event.listen(rt.db.engine, "before_cursor_execute", executed)
    event.listen(rt.db.engine, "commit", committed)
    try:
        ended = end_sandbox(rt, sandbox_id, reason=TerminationReason.FINISHED, actor="test")
    finally:
        event.remove(rt.db.engine, "before_cursor_execute", executed)
        event.remove(rt.db.engine, "commit", committed)

    assert ended.ended and ended.reason is TerminationReason.FINISHED
    # Its attempts matter only to an end that may requeue or fail the item.
    assert not [s for s in statements if "count(" in s.lower()], statements
    assert len(commits) == 2  # the sandbox's read, then its end with its cost event
    with rt.db.session() as session:
        assert session.scalars(select(CostEvent.sandbox_id)).all() == [sandbox_id]


def test_a_cancelled_items_sandbox_ends_as_cancelled_whichever_end_comes_first(
    rt: Runtime,
) -> None:
    # The cancel asks for its sandbox's end (cancelled); its runner, told at its heartbeat,
    # reports the cancelled work, whose batch of ends asks too (finished), and may be first.
    (cancelled, first), (_, second), (other, third) = (_provisioned(rt) for _ in range(3))
    with rt.db.session() as session:
        for item_id in (cancelled, other):
            item = session.get_one(WorkItem, item_id)
            transition(session, item, ItemState.CANCELLED, actor="test", detail="cancel requested")
    # Another cancelled item's sandbox, ended by the cancel's own end first: the same record.
    end_sandbox(rt, third, reason=TerminationReason.CANCELLED, actor="maintenance")

    endings = end_sandboxes(
        rt,
        [
            EndRequest(first, TerminationReason.FINISHED),
            EndRequest(second, TerminationReason.FINISHED),
        ],
        actor="maintenance",
    )
    late = end_sandbox(rt, first, reason=TerminationReason.CANCELLED, actor="maintenance")

    assert {one: outcome.reason for one, outcome in endings.ended.items()} == {
        first: TerminationReason.CANCELLED,
        second: TerminationReason.FINISHED,
    }
    assert not late.ended  # the cancel's own end, second, finds it ended
    with rt.db.session() as session:
        rows = {s.id: s for s in session.scalars(select(Sandbox))}
        billed = session.scalars(select(CostEvent.sandbox_id)).all()
        ends = dict(
            session.execute(
                select(LifecycleEvent.entity_id, LifecycleEvent.detail).where(
                    LifecycleEvent.entity == "sandbox", LifecycleEvent.to_state == "terminated"
                )
            ).all()
        )
    assert (rows[first].termination_reason, rows[second].termination_reason) == (
        "cancelled",
        "finished",
    )
    assert rows[third].termination_reason == "cancelled"
    assert sorted(billed) == sorted([first, second, third])
    assert ends[first] == ends[third]
