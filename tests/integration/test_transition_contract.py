"""Every work-item and sandbox transition, through every writer the store has for it, on
SQLite and on PostgreSQL. The lifecycle's one table (``ITEM_TRANSITIONS``,
``SANDBOX_TRANSITIONS``) decides what each move leaves; this holds every writer to it.

A work item's move is written three ways: the ORM's ``transition`` (one row the caller
holds; a requeue through ``requeue``, as its callers make one), the set-based
``transition_items`` (a batch the caller has locked) and, where ``item_move_values`` allows
the move (its effects are its columns alone), a Core UPDATE of those columns with its audit
row from ``event_row``, as the claim and the handle statements write theirs. From identical
rows, each leaves the same item row, audit rows, pool slot count, requests to end the item's
sandboxes, bundle review, outcome counted (``note_final``) and outcome owed: the outbox row
of the Celery message that made the item, written in the transaction that ends it.

A sandbox's move that does not end it is written by ``sandbox_transition`` or by a Core
UPDATE of ``sandbox_move_values``; an end has one writer, ``record_sandbox_ends``
(``sandbox_transition`` refuses it), and every caller that ends a sandbox leaves the rows
that writer leaves. Rows are compared as in test_store_contract: ids as ``<item>``, a time
``before`` (written before the change) or its offset from the change's instant.
"""

from __future__ import annotations

import itertools
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from functools import partial
from typing import Any, cast

import pytest
from sqlalchemy import Table, bindparam, func, insert, select, update

from corral.providers.base import CodeRun, SandboxHandle, SandboxState
from corral.shared.runtime import Runtime
from corral.shared.settings import CoreSettings
from corral.shared.store.bundle_store import DATABASE
from corral.shared.store.db import Database, UTCDateTime, utcnow
from corral.shared.store.ledger import record_cost_quietly
from corral.shared.store.lifecycle import (
    EVENTS,
    ITEM_TRANSITIONS,
    ItemMove,
    SandboxEnd,
    event_row,
    item_move_values,
    item_stamps,
    record_sandbox_ends,
    requeue,
    sandbox_move_values,
    sandbox_transition,
    transition,
    transition_items,
)
from corral.shared.store.models import (
    SLOT_HOLDING_STATES,
    BundleReview,
    CostEvent,
    ItemState,
    LifecycleEvent,
    OutcomeOutbox,
    Pool,
    Sandbox,
    TerminationReason,
    WorkItem,
    WorkItemBundle,
)
from corral.shared.store.outcomes import DISPATCH_ERRORS, DISPATCH_TO_FINISHED, ITEMS_FINISHED
from corral.worker import provision
from corral.worker.code_run import ExecuteGate, Superseded, record_failure, record_run
from tests.integration.test_store_contract import _columns, _normalised, differences

Snapshot = dict[str, Any]
ACTOR, DETAIL = "worker:contract", "moved"
BACK_OFF = datetime(2001, 1, 1, tzinfo=UTC)  # a requeue's not_before, a time "before"
ERRORS = {
    ItemState.FAILED: ("work_failed", "work exited with code 3"),
    ItemState.CANCELLED: ("cancelled", "cancel requested"),
    ItemState.DISPATCH_ERROR: ("no_eligible_pool", "no pool qualifies"),
}
_ITEMS = cast(Table, WorkItem.__table__)
_SANDBOXES = cast(Table, Sandbox.__table__)

NOT_FINAL = [state for state in ItemState if not state.is_final]
FINAL = [state for state in ItemState if state.is_final]
# The moves to a state that is not final, with who makes them ...
CALLERS = [
    (ItemState.RECEIVED, ItemState.ROUTED, "routing (the batch intake writes it routed)"),
    (ItemState.RECEIVED, ItemState.WAITING_CAPACITY, "routing, every qualifying pool full"),
    (ItemState.WAITING_CAPACITY, ItemState.ROUTED, "the re-drive routing a waiting item"),
    # No caller yet: the one move that gives a slot back and neither ends nor requeues.
    (ItemState.ROUTED, ItemState.WAITING_CAPACITY, "a routed item sent back to wait"),
    (ItemState.ROUTED, ItemState.PROVISIONING, "the claim"),
    (ItemState.PROVISIONING, ItemState.AWAITING_CLAIM, "the handle write, a reconciliation"),
    (ItemState.PROVISIONING, ItemState.RUNNING, "a code item's execute gate"),
    (ItemState.AWAITING_CLAIM, ItemState.RUNNING, "the runner's claim"),
    (ItemState.PROVISIONING, ItemState.RECEIVED, "a requeue: ended before the claim"),
    (ItemState.AWAITING_CLAIM, ItemState.RECEIVED, "a requeue: ended before the claim"),
    (ItemState.RUNNING, ItemState.RECEIVED, "a requeue: runner lost, or failed work retried"),
]
# ... and to every final state from every state that is not (a cancel reaches them all).
ITEM_MOVES = [
    *((before, after) for before, after, _ in CALLERS),
    *itertools.product(NOT_FINAL, FINAL),
]
STAMPS = ("updated_at", "routed_at", "provisioned_at", "claimed_at", "finished_at")
SANDBOX_MOVES = {
    (SandboxState.PROVISIONING, SandboxState.READY): "the handle write",
    (SandboxState.PROVISIONING, SandboxState.RUNNING): "a code item's execute gate",
    (SandboxState.READY, SandboxState.RUNNING): "the runner's claim",
}
LIVE = [SandboxState.PROVISIONING, SandboxState.READY, SandboxState.RUNNING]
SANDBOX_ENDS = list(itertools.product(LIVE, [SandboxState.TERMINATED, SandboxState.FAILED]))


def _move_id(state: ItemState | SandboxState) -> str:
    return state.value


@pytest.fixture(params=["sqlite", "postgresql"])
def db(request: pytest.FixtureRequest) -> Iterator[Database]:
    name = "sqlite_db" if request.param == "sqlite" else "pg_db"
    yield request.getfixturevalue(name)


@dataclass(frozen=True)
class World:
    """A pool, an item of it on its second attempt (the first attempt's sandbox ended, the
    second's live), and the bundle the item's work uploaded."""

    item_id: str
    pool_id: str
    sandbox_id: str  # the live one
    lease_until: datetime  # the live sandbox's


def _world(db: Database, state: ItemState, status: SandboxState = SandboxState.RUNNING) -> World:
    suffix = uuid.uuid4().hex[:10]
    then = utcnow() - timedelta(minutes=5)
    org, world = f"org{suffix}", World(f"wi-{suffix}", f"pool-{suffix}", f"sb-{suffix}-2", then)
    with db.session() as session:
        session.add(
            Pool(
                id=world.pool_id,
                org_id=org,
                name="p",
                provider_id="local",
                max_concurrent=5,
                slots_in_use=1 if state in SLOT_HOLDING_STATES else 0,
            )
        )
        session.flush()
        session.add(
            WorkItem(
                id=world.item_id,
                org_id=org,
                project_id="p",
                profile="default",
                payload={},
                state=state.value,
                pool_id=world.pool_id,
                attempts=2,
                created_at=then,
                updated_at=then,
                task_id=f"task-{suffix}",
                replies=[{"task_id": f"task-{suffix}", "link": [], "link_error": []}],
            )
        )
        session.flush()
        session.add_all([*_sandboxes(world, org, status), _bundle(world, org)])
    return world


def _sandboxes(world: World, org: str, status: SandboxState) -> list[Sandbox]:
    then = world.lease_until
    alike = {
        "work_item_id": world.item_id,
        "org_id": org,
        "pool_id": world.pool_id,
        "provider_id": "local",
    }
    ended = Sandbox(
        id=world.sandbox_id.removesuffix("-2") + "-1",
        attempt=1,
        status=SandboxState.TERMINATED.value,
        created_at=then,
        terminated_at=then,
        termination_reason=TerminationReason.NEVER_CLAIMED.value,
        **alike,
    )
    made = status is not SandboxState.PROVISIONING
    live = Sandbox(
        id=world.sandbox_id,
        attempt=2,
        status=status.value,
        created_at=then,
        started_at=then if made else None,
        lease_until=None if made else then,  # the claim's lease, held while it is made
        **alike,
    )
    return [ended, live]


def _bundle(world: World, org: str) -> WorkItemBundle:
    return WorkItemBundle(
        work_item_id=world.item_id,
        org_id=org,
        size_bytes=1,
        content_bytes=1,
        sha256="0" * 64,
        changes=1,
        refused=0,
        store=DATABASE,
        data=b"x",
        review=BundleReview.NOT_REQUIRED.value,
        created_at=world.lease_until,
    )


def _counted() -> Counter[str]:
    """The outcome counters' samples (a count each), by name and labels."""
    counts: Counter[str] = Counter()
    for metric in (ITEMS_FINISHED, DISPATCH_ERRORS, DISPATCH_TO_FINISHED):
        for family in metric.collect():
            for sample in family.samples:
                if sample.name.endswith(("_total", "_count")):
                    labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()))
                    counts[f"{sample.name}{{{labels}}}"] += int(sample.value)
    return counts


def _changed_by(db: Database, world: World, change: Callable[[], object]) -> Snapshot:
    """The world's rows after ``change``, the audit rows it added and the outcomes it
    counted, normalised."""
    with db.session() as session:
        last_event = session.scalar(select(func.max(LifecycleEvent.id))) or 0
    counted, started = _counted(), utcnow()
    change()
    with db.session() as session:
        rows: Snapshot = {
            "item": _columns(session.get_one(WorkItem, world.item_id)),
            "sandboxes": [
                _columns(row)
                for row in session.scalars(
                    select(Sandbox)
                    .where(Sandbox.work_item_id == world.item_id)
                    .order_by(Sandbox.attempt)
                )
            ],
            "bundle": _columns(session.get_one(WorkItemBundle, world.item_id)),
            "events": [
                _columns(row)
                for row in session.scalars(
                    select(LifecycleEvent)
                    .where(
                        LifecycleEvent.work_item_id == world.item_id,
                        LifecycleEvent.id > last_event,
                    )
                    .order_by(LifecycleEvent.id)
                )
            ],
            "slots in use": session.get_one(Pool, world.pool_id).slots_in_use,
            "costs": session.scalars(
                select(CostEvent.termination_reason).where(CostEvent.work_item_id == world.item_id)
            ).all(),
            "outbox": [
                _columns(row)
                for row in session.scalars(
                    select(OutcomeOutbox)
                    .where(OutcomeOutbox.work_item_id == world.item_id)
                    .order_by(OutcomeOutbox.id)
                )
            ],
        }
    rows["outcomes counted"] = dict(_counted() - counted)
    return _normalised(rows, world.item_id, started)


# Every caller that ends a sandbox, and the end it records.


@dataclass(frozen=True)
class CallerEnd:
    """A caller's end of a sandbox: from what rows, through what call, and what end (a
    :class:`SandboxEnd`'s) it should record."""

    item_state: ItemState
    status: SandboxState
    end: Callable[[Database, World], None]
    to: SandboxState
    reason: TerminationReason
    detail: str


def _fail_provision(db: Database, world: World) -> None:
    attempt = provision._Attempt(world.item_id, world.sandbox_id, world.lease_until, "none")
    rt = Runtime(settings=CoreSettings(), db=db)
    provision._fail_attempt(rt, attempt, "create_failed", "the provider refused it", ACTOR)


def _fail_over(db: Database, world: World) -> None:
    """A failed provision whose item goes to the next qualifying pool."""
    attempt = provision._Attempt(world.item_id, world.sandbox_id, world.lease_until, "none")
    rt = Runtime(settings=CoreSettings(), db=db)
    after = provision.After(provision.Then.FAIL_OVER)
    message = "the provider refused it"
    provision._fail_attempt(rt, attempt, "create_failed", message, ACTOR, after=after)


def _brown_out(db: Database, world: World) -> None:
    """A provision failing transiently past its retries: its item waits."""
    attempt = provision._Attempt(world.item_id, world.sandbox_id, world.lease_until, "none")
    rt = Runtime(settings=CoreSettings(), db=db)
    after = provision.After(provision.Then.WAIT, BACK_OFF)
    message = "the API answered 503"
    provision._fail_attempt(rt, attempt, "provider_unavailable", message, ACTOR, after=after)


def _gate(db: Database, world: World) -> ExecuteGate:
    return ExecuteGate(db, world.item_id, world.sandbox_id, world.lease_until, 60, ACTOR)


def _run_code(db: Database, world: World) -> None:
    run = CodeRun(stdout="hello", stderr="", exit_code=0, duration_s=1.0)
    record_run(db, CoreSettings(), _gate(db, world), run, provider_id="local")


def _fail_code(db: Database, world: World) -> None:
    record_failure(db, _gate(db, world), "execution_outcome_unknown", "the connection dropped")


def _execute(db: Database, world: World) -> None:
    """The code interpreter's execute call, through its gate."""
    handle = SandboxHandle(provider_id="local", external_id="x", metadata={"org_id": "o"})
    _gate(db, world)(handle)


def _execute_cancelled(db: Database, world: World) -> None:
    with pytest.raises(Superseded):
        _execute(db, world)
    record_cost_quietly(db, world.sandbox_id)  # as the provision path bills a superseded run


CALLER_ENDS = {
    "a failed provision": CallerEnd(
        ItemState.PROVISIONING,
        SandboxState.PROVISIONING,
        _fail_provision,
        SandboxState.FAILED,
        TerminationReason.PROVISION_FAILED,
        "the provider refused it",
    ),
    "a failed provision that fails over": CallerEnd(
        ItemState.PROVISIONING,
        SandboxState.PROVISIONING,
        _fail_over,
        SandboxState.FAILED,
        TerminationReason.PROVISION_FAILED,
        "the provider refused it",
    ),
    "a provision a brown-out sends back to waiting": CallerEnd(
        ItemState.PROVISIONING,
        SandboxState.PROVISIONING,
        _brown_out,
        SandboxState.FAILED,
        TerminationReason.PROVISION_UNAVAILABLE,
        "the API answered 503",
    ),
    "a code run that ended": CallerEnd(
        ItemState.RUNNING,
        SandboxState.RUNNING,
        _run_code,
        SandboxState.TERMINATED,
        TerminationReason.FINISHED,
        "the code ran to its end",
    ),
    "a code run that failed after its execute call": CallerEnd(
        ItemState.RUNNING,
        SandboxState.RUNNING,
        _fail_code,
        SandboxState.FAILED,
        TerminationReason.FINISHED,
        "the connection dropped",
    ),
    "a code item cancelled while its sandbox was made": CallerEnd(
        ItemState.CANCELLED,
        SandboxState.PROVISIONING,
        _execute_cancelled,
        SandboxState.TERMINATED,
        TerminationReason.CANCELLED,
        "its work item ended before the code was executed",
    ),
}


def _one_writer(db: Database, world: World, caller: CallerEnd) -> None:
    """The end ``caller`` should record, through the one writer, billed as callers bill."""
    with db.session() as session:
        status = session.get_one(Sandbox, world.sandbox_id).status
        end = SandboxEnd(
            world.sandbox_id, world.item_id, status, caller.to, caller.reason, caller.detail
        )
        record_sandbox_ends(session, [end], actor=ACTOR)
    record_cost_quietly(db, world.sandbox_id)


def _sandbox_part(snapshot: Snapshot) -> Snapshot:
    events = [event for event in snapshot["events"] if event["entity"] == "sandbox"]
    return {"sandboxes": snapshot["sandboxes"], "events": events, "costs": snapshot["costs"]}


@pytest.mark.parametrize("name", CALLER_ENDS)
def test_every_caller_ending_a_sandbox_leaves_what_the_one_writer_leaves(
    db: Database, name: str
) -> None:
    caller, left = CALLER_ENDS[name], {}
    writers = {name: caller.end, "record_sandbox_ends": partial(_one_writer, caller=caller)}
    for writer, end in writers.items():
        world = _world(db, caller.item_state, caller.status)
        left[writer] = _sandbox_part(_changed_by(db, world, partial(end, db, world)))
    expected = left.pop("record_sandbox_ends")
    found = differences(left, expected)
    assert not found, "\n".join(found)


# Work items: every move through every writer.


def _error(state: ItemState) -> tuple[str | None, str | None]:
    return ERRORS.get(state, (None, None))


def _by_transition(db: Database, world: World, before: ItemState, after: ItemState) -> None:
    with db.session() as session:
        item = session.get_one(WorkItem, world.item_id)
        if ITEM_TRANSITIONS[after].requeues:  # as its callers requeue an item
            requeue(session, item, not_before=BACK_OFF, actor=ACTOR, detail=DETAIL)
            return
        item.error_code, item.error_message = _error(after)
        transition(session, item, after, actor=ACTOR, detail=DETAIL)


def _by_transition_items(db: Database, world: World, before: ItemState, after: ItemState) -> None:
    code, message = _error(after)
    back_off = BACK_OFF if ITEM_TRANSITIONS[after].requeues else None
    move = ItemMove(
        world.item_id,
        world.pool_id,
        before.value,
        after,
        detail=DETAIL,
        error_code=code,
        error_message=message,
        not_before=back_off,
    )
    with db.session() as session:
        transition_items(session, [move], actor=ACTOR)


def _by_statement(db: Database, world: World, before: ItemState, after: ItemState) -> None:
    """As the claim and the handle statements write a move: its columns from the table at a
    bound instant, its audit row beside it."""
    values = item_move_values(before, after, bindparam("now", type_=UTCDateTime()))
    now = utcnow()
    event = event_row(world.item_id, before.value, after.value, actor=ACTOR, at=now, detail=DETAIL)
    with db.session() as session:
        connection = session.connection()
        connection.execute(
            update(_ITEMS).where(_ITEMS.c.id == world.item_id).values(values), {"now": now}
        )
        connection.execute(insert(EVENTS), [event])


ItemWriter = Callable[[Database, World, ItemState, ItemState], None]


def _item_writers(before: ItemState, after: ItemState) -> dict[str, ItemWriter]:
    """The writers of a move: the statement only where the table allows it one."""
    writers: dict[str, ItemWriter] = {
        "transition": _by_transition,
        "transition_items": _by_transition_items,
    }
    try:
        item_move_values(before, after, utcnow())
    except ValueError:
        return writers
    return writers | {"statement": _by_statement}


def _item_as_the_table_says(snapshot: Snapshot, before: ItemState, after: ItemState) -> None:
    """What entering ``after`` from ``before`` leaves, read from the table, not a writer."""
    entering, holding = ITEM_TRANSITIONS[after], ITEM_TRANSITIONS[before].holds_slot
    item, [ended, live] = snapshot["item"], snapshot["sandboxes"]
    assert item["state"] == after.value
    stamped = {column for column in STAMPS if item[column] == "now+0s"}
    assert stamped == set(item_stamps(before, after))
    assert snapshot["slots in use"] == int(holding and entering.holds_slot)
    asked_to_end = entering.ends or entering.requeues
    assert (live["end_requested_at"], ended["end_requested_at"]) == (
        "now+0s" if asked_to_end else None,
        None,  # ended before: nothing to ask
    )
    discarded = BundleReview.DISCARDED.value if entering.requeues else "not_required"
    assert snapshot["bundle"]["review"] == discarded
    assert bool(snapshot["outcomes counted"]) == entering.ends
    owed = {
        "work_item_id": "wi-<item>",
        "org_id": "org<item>",
        "sink": "celery",
        "target": {"task_id": "task-<item>", "link": [], "link_error": []},
        "created_at": "now+0s",
        "due_at": "now+0s",
        "attempts": 0,
        "last_error": None,
        "failed_at": None,
    }
    assert snapshot["outbox"] == ([owed] if entering.ends else [])
    assert [(e["entity"], e["from_state"], e["to_state"]) for e in snapshot["events"]] == [
        ("work_item", before.value, after.value),
        *([("bundle", "not_required", "discarded")] if entering.requeues else []),
    ]


@pytest.mark.parametrize(("before", "after"), ITEM_MOVES, ids=_move_id)
def test_every_writer_of_an_item_move_leaves_the_same_rows(
    db: Database, before: ItemState, after: ItemState
) -> None:
    left = {}
    for name, write in _item_writers(before, after).items():
        world = _world(db, before)
        left[name] = _changed_by(db, world, partial(write, db, world, before, after))
    expected = left.pop("transition")
    _item_as_the_table_says(expected, before, after)
    found = differences(left, expected)
    assert not found, "\n".join(found)


def test_a_statement_writes_the_moves_whose_effects_are_their_columns() -> None:
    # Routing's, the claim's, the handle's, the code gate's and the runner's claim: the
    # others (a slot given back, an item ended or requeued) go through transition_items.
    written = [move for move in ITEM_MOVES if "statement" in _item_writers(*move)]
    assert written == [
        (ItemState.RECEIVED, ItemState.ROUTED),
        (ItemState.RECEIVED, ItemState.WAITING_CAPACITY),
        (ItemState.WAITING_CAPACITY, ItemState.ROUTED),
        (ItemState.ROUTED, ItemState.PROVISIONING),
        (ItemState.PROVISIONING, ItemState.AWAITING_CLAIM),
        (ItemState.PROVISIONING, ItemState.RUNNING),
        (ItemState.AWAITING_CLAIM, ItemState.RUNNING),
    ]


def test_the_execute_gate_starts_a_code_item_as_the_table_moves_it(db: Database) -> None:
    world = _world(db, ItemState.PROVISIONING, SandboxState.PROVISIONING)
    started = _changed_by(db, world, partial(_execute, db, world))
    stamped = {column for column in STAMPS if started["item"][column] == "now+0s"}
    assert stamped == set(item_stamps(ItemState.PROVISIONING, ItemState.RUNNING))
    assert "provisioned_at" in stamped  # made and started at once
    assert [(e["entity"], e["from_state"], e["to_state"]) for e in started["events"]] == [
        ("sandbox", "provisioning", "running"),
        ("work_item", "provisioning", "running"),
    ]


# Sandboxes: a move through both writers, an end through its one.


def _sandbox_by_transition(
    db: Database, world: World, before: SandboxState, after: SandboxState
) -> None:
    with db.session() as session:
        sandbox = session.get_one(Sandbox, world.sandbox_id)
        sandbox_transition(session, sandbox, after, actor=ACTOR, detail=DETAIL)


def _sandbox_by_statement(
    db: Database, world: World, before: SandboxState, after: SandboxState
) -> None:
    now = utcnow()
    event = event_row(
        world.item_id,
        before.value,
        after.value,
        actor=ACTOR,
        at=now,
        sandbox_id=world.sandbox_id,
        detail=DETAIL,
    )
    with db.session() as session:
        connection = session.connection()
        connection.execute(
            update(_SANDBOXES)
            .where(_SANDBOXES.c.id == world.sandbox_id)
            .values(sandbox_move_values(after, now))
        )
        connection.execute(insert(EVENTS), [event])


@pytest.mark.parametrize(("before", "after"), SANDBOX_MOVES, ids=_move_id)
def test_every_writer_of_a_sandbox_move_leaves_the_same_rows(
    db: Database, before: SandboxState, after: SandboxState
) -> None:
    writers = {"sandbox_transition": _sandbox_by_transition, "statement": _sandbox_by_statement}
    left = {}
    for name, write in writers.items():
        world = _world(db, ItemState.PROVISIONING, before)
        left[name] = _changed_by(db, world, partial(write, db, world, before, after))
    expected = left.pop("sandbox_transition")
    assert expected["sandboxes"][1]["status"] == after.value
    assert [(e["entity"], e["from_state"], e["to_state"]) for e in expected["events"]] == [
        ("sandbox", before.value, after.value)
    ]
    found = differences(left, expected)
    assert not found, "\n".join(found)


def _refused(db: Database, world: World, after: SandboxState) -> None:
    with db.session() as session, pytest.raises(ValueError, match="ends it"):
        sandbox = session.get_one(Sandbox, world.sandbox_id)
        sandbox_transition(session, sandbox, after, actor=ACTOR, detail=DETAIL)


def _ended(db: Database, end: SandboxEnd) -> None:
    with db.session() as session:
        record_sandbox_ends(session, [end], actor=ACTOR)


@pytest.mark.parametrize(("before", "after"), SANDBOX_ENDS, ids=_move_id)
def test_a_sandbox_end_has_one_writer(
    db: Database, before: SandboxState, after: SandboxState
) -> None:
    world = _world(db, ItemState.RUNNING, before)
    unchanged = _changed_by(db, world, lambda: None)
    assert _changed_by(db, world, partial(_refused, db, world, after)) == unchanged
    reason = TerminationReason.HEARTBEAT_LOST
    end = SandboxEnd(world.sandbox_id, world.item_id, before.value, after, reason, "lost", 1.5)
    ended = _changed_by(db, world, partial(_ended, db, end))
    live = unchanged["sandboxes"][1] | {
        "status": after.value,
        "termination_reason": "heartbeat_lost",
        "terminated_at": "now+0s",
        "cost_due_at": "now+0s",
        "lease_until": None,
        "cpu_seconds": 1.5,
    }
    event = {
        "entity": "sandbox",
        "entity_id": "sb-<item>-2",
        "work_item_id": "wi-<item>",
        "from_state": before.value,
        "to_state": after.value,
        "actor": ACTOR,
        "detail": "heartbeat_lost: lost",
        "created_at": "now+0s",
    }
    expected = unchanged | {"sandboxes": [unchanged["sandboxes"][0], live], "events": [event]}
    found = differences({"record_sandbox_ends": ended}, expected)
    assert not found, "\n".join(found)
