"""State changes of work items and sandboxes, each with its append-only audit row.

Nothing else assigns ``WorkItem.state`` or ``Sandbox.status``: going through here is what
makes the lifecycle log complete. The batched paths (the scheduler's intake, the provision
path's claims and handles) write many rows with Core statements instead; they build each
change's audit row with :func:`event_row` and insert them in the same transaction.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any, cast

from sqlalchemy import Table, update
from sqlalchemy.orm import Session

from shared.db import utcnow
from shared.models import (
    SLOT_HOLDING_STATES,
    ItemState,
    LifecycleEvent,
    Sandbox,
    SandboxStatusValue,
    WorkItem,
)
from shared.slots import free_slot

_HOLDING = frozenset(state.value for state in SLOT_HOLDING_STATES)
EVENTS = cast(Table, LifecycleEvent.__table__)

_ITEM_TIMESTAMPS = {
    ItemState.ROUTED: "routed_at",
    ItemState.AWAITING_CLAIM: "provisioned_at",
    ItemState.RUNNING: "claimed_at",
}


def transition(
    session: Session, item: WorkItem, to: ItemState, *, actor: str, detail: str | None = None
) -> None:
    """Move ``item`` to state ``to`` and record who did it; an item leaving a slot-holding
    state gives its pool's slot back in the same transaction."""
    now = utcnow()
    if item.pool_id and item.state in _HOLDING and to.value not in _HOLDING:
        free_slot(session, item.pool_id)
    session.add(
        LifecycleEvent(
            entity="work_item", entity_id=item.id, work_item_id=item.id,
            from_state=item.state, to_state=to.value, actor=actor, detail=detail, created_at=now,
        )
    )  # fmt: skip
    item.state = to.value
    item.updated_at = now
    stamp = _ITEM_TIMESTAMPS.get(to)
    if stamp is not None:
        setattr(item, stamp, now)
    if to.is_final:
        item.finished_at = now
        # Its sandboxes should go now. corral.terminate is the fast path; this mark, written
        # in the same transaction, is what the reaper's `finished` rule finds if that is lost.
        session.execute(
            update(Sandbox)
            .where(Sandbox.work_item_id == item.id, Sandbox.terminated_at.is_(None),
                   Sandbox.end_requested_at.is_(None))
            .values(end_requested_at=now)
            .execution_options(synchronize_session=False)
        )  # fmt: skip


def record_creation(session: Session, item: WorkItem, *, actor: str, detail: str) -> None:
    """The first lifecycle event of a new item: from nothing to its initial state."""
    session.add(
        LifecycleEvent(
            entity="work_item", entity_id=item.id, work_item_id=item.id, from_state=None,
            to_state=item.state, actor=actor, detail=detail, created_at=item.created_at,
        )
    )  # fmt: skip


def sandbox_transition(
    session: Session,
    sandbox: Sandbox,
    to: SandboxStatusValue,
    *,
    actor: str,
    detail: str | None = None,
) -> None:
    """Move ``sandbox`` to status ``to`` and record who did it."""
    now = utcnow()
    session.add(
        LifecycleEvent(
            entity="sandbox", entity_id=sandbox.id, work_item_id=sandbox.work_item_id,
            from_state=sandbox.status, to_state=to.value, actor=actor, detail=detail,
            created_at=now,
        )
    )  # fmt: skip
    sandbox.status = to.value
    if to in (SandboxStatusValue.TERMINATED, SandboxStatusValue.FAILED) and (
        sandbox.terminated_at is None
    ):
        sandbox.terminated_at = now
        sandbox.termination_reason = sandbox.termination_reason or detail
        sandbox.cost_due_at = now  # the ledger owes its one cost event from now on


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
    return {
        "entity": "sandbox" if sandbox_id else "work_item",
        "entity_id": sandbox_id or work_item_id,
        "work_item_id": work_item_id,
        "from_state": from_state,
        "to_state": to_state,
        "actor": actor,
        "detail": detail,
        "created_at": at,
    }
