"""State changes of work items and sandboxes, each with its append-only audit row.

Nothing else assigns ``WorkItem.state`` or ``Sandbox.status``: going through here is what
makes the lifecycle log complete.
"""

from __future__ import annotations

from sqlalchemy.orm import Session

from shared.db import utcnow
from shared.models import ItemState, LifecycleEvent, Sandbox, SandboxStatusValue, WorkItem

_ITEM_TIMESTAMPS = {
    ItemState.ROUTED: "routed_at",
    ItemState.AWAITING_CLAIM: "provisioned_at",
    ItemState.RUNNING: "claimed_at",
}


def transition(
    session: Session, item: WorkItem, to: ItemState, *, actor: str, detail: str | None = None
) -> None:
    """Move ``item`` to state ``to`` and record who did it."""
    now = utcnow()
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
    if to in (SandboxStatusValue.TERMINATED, SandboxStatusValue.FAILED):
        sandbox.terminated_at = sandbox.terminated_at or now
        sandbox.termination_reason = sandbox.termination_reason or detail
