"""State changes of work items and sandboxes, each with its append-only audit row.

Nothing else assigns ``WorkItem.state`` or ``Sandbox.status``: going through here is what
makes the lifecycle log complete. What entering each state implies — the columns it stamps
with the change's instant, the slot it gives back, the work it ends — is declared once, in
:data:`ITEM_TRANSITIONS` and :data:`SANDBOX_TRANSITIONS`, and every path reads it from there.
:func:`transition` and :func:`sandbox_transition` change one row the caller holds;
:func:`transition_items` and :func:`record_sandbox_ends` change a batch of rows the caller
has locked, in a few set-based statements whatever its size. A sandbox's end has one writer,
:func:`record_sandbox_ends`, for one sandbox as for many. The batched paths that write a
move inside statements of their own (the scheduler's intake, the provision path's claims and
handles) take its columns from :func:`item_move_values` or :func:`sandbox_move_values`, which
refuse a move with an effect no column carries, and build each change's audit row with
:func:`event_row`, inserted into :data:`EVENTS` in the same transaction. A budget's warnings
(the thresholds of its cap its spend reached) are written by :func:`warn_budget` alone.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from types import MappingProxyType
from typing import Any, cast

from sqlalchemy import Table, select, update
from sqlalchemy.orm import Session

from corral.providers.base import SandboxState
from corral.shared.store.budgets import crossing_record
from corral.shared.store.db import insert_rows, update_each, utcnow
from corral.shared.store.models import (
    FINAL_ITEM_STATES,
    SLOT_HOLDING_STATES,
    Budget,
    BundleReview,
    InteractiveSession,
    ItemState,
    LifecycleEvent,
    Sandbox,
    TerminationReason,
    WorkItem,
    WorkItemBundle,
)
from corral.shared.store.outbox import Crossed, write_crossed
from corral.shared.store.outcomes import Final, note_final
from corral.shared.store.slots import free_slots

EVENTS = cast(Table, LifecycleEvent.__table__)


@dataclass(frozen=True)
class Entering:
    """What entering a state implies beside the state itself and its audit row."""

    stamps: tuple[str, ...] = ()  # columns set to the change's instant
    holds_slot: bool = False  # a work item keeps its pool's slot here; leaving for none frees it
    ends: bool = False  # a work item: its sandboxes are asked to go, its outcome noted
    requeues: bool = False  # back to routing: its sandboxes asked to go, its bundles discarded


def _item_entering(state: ItemState) -> Entering:
    stamps = {
        ItemState.ROUTED: ("routed_at",),
        ItemState.AWAITING_CLAIM: ("provisioned_at",),
        ItemState.RUNNING: ("claimed_at",),
    }.get(state, ("finished_at",) if state in FINAL_ITEM_STATES else ())
    return Entering(
        stamps=("updated_at", *stamps),
        holds_slot=state in SLOT_HOLDING_STATES,
        ends=state in FINAL_ITEM_STATES,
        requeues=state is ItemState.RECEIVED,
    )


ITEM_TRANSITIONS: Mapping[ItemState, Entering] = MappingProxyType(
    {state: _item_entering(state) for state in ItemState}
)
# A move straight past a state stamps that state's columns too: a code item goes from
# provisioning to running at once (made and started, no runner to wait for), so it was
# provisioned then.
PASSED_OVER: Mapping[tuple[ItemState, ItemState], ItemState] = MappingProxyType(
    {(ItemState.PROVISIONING, ItemState.RUNNING): ItemState.AWAITING_CLAIM}
)
# An ended sandbox is billed from then on: the ledger owes its one cost event.
_SANDBOX_ENDED = Entering(stamps=("terminated_at", "cost_due_at"), ends=True)
SANDBOX_TRANSITIONS: Mapping[SandboxState, Entering] = MappingProxyType(
    {
        SandboxState.PROVISIONING: Entering(),
        SandboxState.READY: Entering(),
        SandboxState.RUNNING: Entering(),
        SandboxState.TERMINATED: _SANDBOX_ENDED,
        SandboxState.FAILED: _SANDBOX_ENDED,
    }
)


def transition(
    session: Session,
    item: WorkItem,
    to: ItemState,
    *,
    actor: str,
    detail: str | None = None,
    at: datetime | None = None,
) -> None:
    """Move ``item`` to state ``to`` and record who did it; an item leaving a slot-holding
    state gives its pool's slot back in the same transaction. ``at``: the instant of a
    change that writes other rows too (they all carry it), else now."""
    now = at or utcnow()
    if item.pool_id is not None and _frees_slot(item.state, to):
        free_slots(session, Counter([item.pool_id]))
    session.add(
        LifecycleEvent(
            **_audit(
                "work_item",
                item.id,
                item.id,
                from_state=item.state,
                to_state=to.value,
                actor=actor,
                detail=detail,
                now=now,
            )
        )
    )
    for column, value in _item_values(item.state, to, now).items():
        setattr(item, column, value)
    entering = ITEM_TRANSITIONS[to]
    if entering.ends or entering.requeues:
        _request_sandbox_ends(session, [item.id], now)
    if entering.requeues:
        discard_bundles(session, [item.id], actor=actor, at=now)
    if entering.ends:
        note_final(session, [item])


SESSION_LIVE = "live"
SESSION_ENDED = "ended"


def record_session_start(session: Session, row: InteractiveSession, *, actor: str) -> None:
    """The first event of an interactive session (entity ``session``): it is live."""
    detail = f"idle_ttl_s {row.idle_ttl_s}, ttl_s {row.ttl_s}"
    _session_event(session, row, None, SESSION_LIVE, actor=actor, detail=detail, now=utcnow())


def end_session(
    session: Session, row: InteractiveSession, reason: str, *, actor: str, detail: str
) -> None:
    """End an interactive session the caller holds locked: when, why, and its audit row.
    Its work item and sandbox are ended by the caller (they have their own transitions)."""
    now = utcnow()
    _session_event(
        session,
        row,
        SESSION_LIVE,
        SESSION_ENDED,
        actor=actor,
        detail=f"{reason}: {detail}",
        now=now,
    )
    row.ended_at = now
    row.end_reason = reason


def _session_event(
    session: Session,
    row: InteractiveSession,
    from_state: str | None,
    to_state: str,
    *,
    actor: str,
    detail: str,
    now: datetime,
) -> None:
    audit = _audit(
        "session",
        row.id,
        row.work_item_id,
        from_state=from_state,
        to_state=to_state,
        actor=actor,
        detail=detail,
        now=now,
    )
    session.add(LifecycleEvent(**audit))


def requeue(
    session: Session,
    item: WorkItem,
    *,
    not_before: datetime | None,
    actor: str,
    detail: str,
) -> None:
    """Send a running ``item`` back to routing for another attempt (its lease policy allows
    one): its slot is given back, and the sandbox of the attempt that ended is asked to go
    (the reaper's ``finished`` rule ends it if nothing else does)."""
    transition(session, item, ItemState.RECEIVED, actor=actor, detail=detail)
    item.not_before = not_before


def discard_bundles(
    session: Session, item_ids: Sequence[str], *, actor: str, at: datetime | None = None
) -> None:
    """The bundles the ended attempts of requeued items uploaded are not their results: each
    is ``discarded`` (never served nor reviewed; the next attempt's upload replaces it).
    ``at``: the requeue's instant."""
    rows = session.scalars(
        select(WorkItemBundle).where(
            WorkItemBundle.work_item_id.in_(item_ids),
            WorkItemBundle.review != BundleReview.DISCARDED.value,
        )
    ).all()
    for row in rows:
        bundle_transition(
            session,
            row,
            BundleReview.DISCARDED,
            actor=actor,
            detail="its attempt ended and the item was requeued",
            from_state=row.review,
            at=at,
        )


def bundle_transition(
    session: Session,
    bundle: WorkItemBundle,
    to: BundleReview,
    *,
    actor: str,
    detail: str | None = None,
    from_state: str | None = None,
    at: datetime | None = None,
) -> None:
    """Move a result bundle's review to ``to`` (an event of entity ``bundle``); the work
    item's own state is not touched. ``from_state`` is the review before, when the row is
    new in this transaction and ``bundle.review`` not yet set; ``at``: as for
    :func:`transition`."""
    now = at or utcnow()
    session.add(
        LifecycleEvent(
            **_audit(
                "bundle",
                bundle.work_item_id,
                bundle.work_item_id,
                from_state=from_state,
                to_state=to.value,
                actor=actor,
                detail=detail,
                now=now,
            )
        )
    )
    bundle.review = to.value
    if to in (BundleReview.ACCEPTED, BundleReview.REJECTED):
        bundle.reviewed_by, bundle.reviewed_at = actor, now


@dataclass(frozen=True)
class ItemMove:
    """One work item's move, for :func:`transition_items`: ``from_state`` as locked."""

    item_id: str
    pool_id: str | None
    from_state: str
    to: ItemState
    detail: str | None = None
    error_code: str | None = None  # with error_message: why the item failed
    error_message: str | None = None
    not_before: datetime | None = None  # a requeue's back-off: not routed again before


def transition_items(session: Session, moves: Sequence[ItemMove], *, actor: str) -> None:
    """:func:`transition` for a batch of items the caller has locked: one UPDATE for their
    rows, one INSERT for their audit rows, one UPDATE for the slots they give back."""
    if not moves:
        return
    now = utcnow()
    rows: dict[str, dict[str, Any]] = {}
    for move in moves:
        rows[move.item_id] = _item_values(move.from_state, move.to, now)
        if ITEM_TRANSITIONS[move.to].requeues:
            rows[move.item_id]["not_before"] = move.not_before
        if move.error_code is not None:
            rows[move.item_id] |= {
                "error_code": move.error_code,
                "error_message": move.error_message,
            }
    update_each(session, WorkItem.id, rows)
    insert_rows(
        session,
        LifecycleEvent,
        [
            _audit(
                "work_item",
                move.item_id,
                move.item_id,
                from_state=move.from_state,
                to_state=move.to.value,
                actor=actor,
                detail=move.detail,
                now=now,
            )
            for move in moves
        ],
    )
    free_slots(
        session,
        Counter(
            move.pool_id
            for move in moves
            if move.pool_id is not None and _frees_slot(move.from_state, move.to)
        ),
    )
    requeued = [move.item_id for move in moves if ITEM_TRANSITIONS[move.to].requeues]
    discard_bundles(session, requeued, actor=actor, at=now)
    ended = [move for move in moves if ITEM_TRANSITIONS[move.to].ends]
    _request_sandbox_ends(session, [move.item_id for move in ended] + requeued, now)
    note_final(
        session,
        [Final(m.item_id, m.to.value, m.error_code, m.pool_id) for m in ended],
    )


def _frees_slot(from_state: str, to: ItemState) -> bool:
    holding = ITEM_TRANSITIONS[ItemState(from_state)].holds_slot
    return holding and not ITEM_TRANSITIONS[to].holds_slot


def item_stamps(from_state: ItemState, to: ItemState) -> tuple[str, ...]:
    """The columns a work item's move from ``from_state`` to ``to`` sets to its instant."""
    passed = PASSED_OVER.get((from_state, to))
    also = ITEM_TRANSITIONS[passed].stamps if passed is not None else ()
    return tuple(dict.fromkeys((*ITEM_TRANSITIONS[to].stamps, *also)))


def _item_values(from_state: str, to: ItemState, now: Any) -> dict[str, Any]:
    return {"state": to.value} | dict.fromkeys(item_stamps(ItemState(from_state), to), now)


# Every stamp a new work item's row may carry (a batch inserts rows of one shape).
_CREATION_STAMPS = ("routed_at", "finished_at")


def item_creation_values(state: ItemState, now: Any) -> dict[str, Any]:
    """The state and stamps of a work item made in ``state`` at ``now`` (received, then at
    once routed, waiting or refused, as the intake's batch writes it), from the table:
    every stamp it may carry, the others None. The final state's effects are the caller's
    (the intake notes a refused item's outcome with its row)."""
    stamps = dict.fromkeys(_CREATION_STAMPS) | dict.fromkeys(ITEM_TRANSITIONS[state].stamps, now)
    return {"created_at": now, **stamps, "state": state.value}


def item_move_values(from_state: ItemState, to: ItemState, now: Any) -> dict[str, Any]:
    """The columns a set-based statement writes for a work item's move from ``from_state``
    to ``to``: its state and stamps, at ``now`` (a time, or a statement's bound parameter).

    Raises:
        ValueError: the move has an effect no column carries (a slot given back, the item
            ended or requeued): such a move goes through :func:`transition_items`.
    """
    entering = ITEM_TRANSITIONS[to]
    if _frees_slot(from_state.value, to) or entering.ends or entering.requeues:
        raise ValueError(f"{from_state} -> {to} has effects beyond its columns")
    return _item_values(from_state, to, now)


def sandbox_move_values(to: SandboxState, now: Any) -> dict[str, Any]:
    """The columns a set-based statement writes for a sandbox's move to ``to`` (as
    :func:`item_move_values` does for a work item's).

    Raises:
        ValueError: the move ends the sandbox: such a move goes through
            :func:`record_sandbox_ends`.
    """
    entering = SANDBOX_TRANSITIONS[to]
    if entering.ends:
        raise ValueError(f"a sandbox's move to {to} ends it")
    return {"status": to.value} | dict.fromkeys(entering.stamps, now)


def _audit(
    entity: str,
    entity_id: str,
    work_item_id: str | None,
    *,
    from_state: str | None,
    to_state: str,
    actor: str,
    detail: str | None,
    now: datetime,
) -> dict[str, Any]:
    """The columns of one :class:`LifecycleEvent`."""
    return {
        "entity": entity,
        "entity_id": entity_id,
        "work_item_id": work_item_id,
        "from_state": from_state,
        "to_state": to_state,
        "actor": actor,
        "detail": detail,
        "created_at": now,
    }


def event_row(
    work_item_id: str,
    from_state: str | None,
    to_state: str,
    *,
    actor: str,
    at: datetime,
    sandbox_id: str | None = None,
    detail: str | None = None,
) -> dict[str, Any]:
    """The audit row of one change, of the work item or (with ``sandbox_id``) of its
    sandbox, for a multi-row insert into :data:`EVENTS`."""
    entity, entity_id = ("sandbox", sandbox_id) if sandbox_id else ("work_item", work_item_id)
    return _audit(
        entity,
        entity_id,
        work_item_id,
        from_state=from_state,
        to_state=to_state,
        actor=actor,
        detail=detail,
        now=at,
    )


def _request_sandbox_ends(session: Session, item_ids: Collection[str], now: datetime) -> None:
    """The items ended: their sandboxes should go now. corral.terminate is the fast path;
    this mark, written in the same transaction, is what the reaper's `finished` rule finds
    if that is lost."""
    if not item_ids:
        return
    session.execute(
        update(Sandbox)
        .where(
            Sandbox.work_item_id.in_(item_ids),
            Sandbox.terminated_at.is_(None),
            Sandbox.end_requested_at.is_(None),
        )
        .values(end_requested_at=now)
        .execution_options(synchronize_session=False)
    )


def record_creation(session: Session, item: WorkItem, *, actor: str, detail: str) -> None:
    """The first lifecycle event of a new item: from nothing to its initial state."""
    session.add(
        LifecycleEvent(
            entity="work_item",
            entity_id=item.id,
            work_item_id=item.id,
            from_state=None,
            to_state=item.state,
            actor=actor,
            detail=detail,
            created_at=item.created_at,
        )
    )


def sandbox_transition(
    session: Session,
    sandbox: Sandbox,
    to: SandboxState,
    *,
    actor: str,
    detail: str | None = None,
    at: datetime | None = None,
) -> None:
    """Move ``sandbox`` to status ``to`` and record who did it (``at``: as for
    :func:`transition`).

    Raises:
        ValueError: the move ends the sandbox: its end is recorded by
            :func:`record_sandbox_ends` (with its reason), nothing is written.
    """
    now = at or utcnow()
    values = sandbox_move_values(to, now)
    session.add(
        LifecycleEvent(
            **_audit(
                "sandbox",
                sandbox.id,
                sandbox.work_item_id,
                from_state=sandbox.status,
                to_state=to.value,
                actor=actor,
                detail=detail,
                now=now,
            )
        )
    )
    for column, value in values.items():
        setattr(sandbox, column, value)


@dataclass(frozen=True)
class SandboxEnd:
    """One live sandbox's end, for :func:`record_sandbox_ends`: ``from_status`` as locked."""

    sandbox_id: str
    work_item_id: str
    from_status: str
    to: SandboxState  # terminated or failed
    reason: TerminationReason
    detail: str  # what happened; the audit row says "<reason>: <detail>"
    cpu_seconds: float | None = None
    # The last lines of its provider's own log, kept (corral.shared.end_logs), when it ended
    # before its runner reported.
    end_log: str | None = None


def record_sandbox_ends(
    session: Session, ends: Sequence[SandboxEnd], *, actor: str, at: datetime | None = None
) -> None:
    """Record the end of a batch of live sandboxes the caller has locked (or of one): one
    UPDATE for their rows, one INSERT for their audit rows ("<reason>: <detail>"). Each
    keeps its reason and its end log, its lease is cleared (a provision still in flight may no
    longer record its handle) and the ledger owes it its one cost event from now on. ``at``:
    as for :func:`transition`."""
    if not ends:
        return
    now = at or utcnow()
    rows = {
        end.sandbox_id: {
            "status": end.to.value,
            "termination_reason": end.reason.value,
            "cpu_seconds": end.cpu_seconds,
            "end_log": end.end_log,
            "lease_until": None,
        }
        | dict.fromkeys(SANDBOX_TRANSITIONS[end.to].stamps, now)
        for end in ends
    }
    update_each(session, Sandbox.id, rows)
    insert_rows(
        session,
        LifecycleEvent,
        [
            _audit(
                "sandbox",
                end.sandbox_id,
                end.work_item_id,
                from_state=end.from_status,
                to_state=end.to.value,
                actor=actor,
                detail=f"{end.reason.value}: {end.detail}",
                now=now,
            )
            for end in ends
        ],
    )


def warn_budget(
    session: Session,
    budget: Budget,
    *,
    since: datetime,
    reached: Sequence[int],
    spent_micros: int,
    actor: str,
    detail: str,
    at: datetime | None = None,
) -> bool:
    """Record that ``budget``'s spend (``spent_micros``) reached the thresholds ``reached``
    (percentages, ascending, each above what was warned of in the period that began at
    ``since``): one event each (entity ``budget``, "50%" to "80%"), the outcome each crossing
    owes (a ``budget.threshold`` webhook event: outbox.write_crossed), and the budget's
    warned threshold moved to the highest, by an UPDATE guarded on the warned state as
    ``budget`` was read. So each threshold is warned of once per period, however many
    processes try: a caller whose read is stale changes nothing and gets False (the next
    read sees the move).
    """
    if not reached:
        return False
    moved = session.execute(
        update(Budget)
        .where(
            Budget.id == budget.id,
            Budget.warned_pct.is_not_distinct_from(budget.warned_pct),
            Budget.warned_period_start.is_not_distinct_from(budget.warned_period_start),
        )
        .values(warned_pct=max(reached), warned_period_start=since)
        .execution_options(synchronize_session=False)
    )
    if getattr(moved, "rowcount", 0) != 1:
        return False
    now = at or utcnow()
    insert_rows(
        session,
        LifecycleEvent,
        _warnings(budget, since, reached, actor=actor, detail=detail, now=now),
    )
    write_crossed(
        session,
        [
            Crossed(
                budget.id,
                budget.org_id,
                pct,
                now,
                crossing_record(budget, since, pct, spent_micros),
            )
            for pct in reached
        ],
    )
    return True


def _warnings(
    budget: Budget,
    since: datetime,
    reached: Sequence[int],
    *,
    actor: str,
    detail: str,
    now: datetime,
) -> list[dict[str, Any]]:
    """The events of ``budget`` reaching ``reached``, each from the threshold warned of before
    it in the period that began at ``since``."""
    current = budget.warned_pct if budget.warned_period_start == since else None
    rows = []
    for pct in reached:
        before = None if current is None else f"{current}%"
        rows.append(
            _audit(
                "budget",
                budget.id,
                None,
                from_state=before,
                to_state=f"{pct}%",
                actor=actor,
                detail=detail,
                now=now,
            )
        )
        current = pct
    return rows
