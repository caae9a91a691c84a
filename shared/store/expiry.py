"""An item's own expiry, the message's ``expires_at``: an item not final by then fails as
``expired``, whatever state it is in (docs/dispatch.md#expiry).

Three places apply it. The intake refuses a message already past it (a dispatch error of
that code: corral.scheduler.errors.ExpiredError); routing fails an expired item instead of
routing it; and the reaper's expiry rule (corral.worker.reaper, read from the items that
carry an expiry) fails the rest. The last two fail items here, through the lifecycle's
one batched transition: their slots are given back and their sandboxes asked to go. A
sandbox the item had made is ended as at its deadline: its ``deadline_at`` is moved to the
item's expiry, so that the reaper's deadline rule, which ends every sandbox past its
deadline, ends it too (in the same sweep: the expiry rule runs before the sandbox rules).
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime

from sqlalchemy import or_, select, update
from sqlalchemy.orm import Session

from corral.providers.base import SandboxState
from corral.shared.store.lifecycle import ItemMove, transition_items
from corral.shared.store.models import ItemState, Sandbox, WorkItem

EXPIRED = "expired"  # the error code of an item failed by its expiry


def expired_message(expires_at: datetime | None, state: str) -> str:
    """What an expired item's error says: the field, the instant, where the item was."""
    when = expires_at.isoformat() if expires_at is not None else "its expiry"
    return f"expires_at: the item was not final by its expiry ({when}); it was {state}"


def expire_items(session: Session, items: Sequence[WorkItem], *, actor: str) -> list[str]:
    """Fail ``items`` (locked by the caller, each past its ``expires_at``) as ``expired``;
    their ids. The sandboxes they had made (ready or running) get the item's expiry as
    their deadline when it is sooner (or they had none)."""
    if not items:
        return []
    moves = [
        ItemMove(
            item.id,
            item.pool_id,
            item.state,
            ItemState.FAILED,
            detail=EXPIRED,
            error_code=EXPIRED,
            error_message=expired_message(item.expires_at, item.state),
        )
        for item in items
    ]
    transition_items(session, moves, actor=actor)
    ids = [item.id for item in items]
    expiry = (
        select(WorkItem.expires_at).where(WorkItem.id == Sandbox.work_item_id).scalar_subquery()
    )
    session.execute(
        update(Sandbox)
        .where(
            Sandbox.work_item_id.in_(ids),
            Sandbox.terminated_at.is_(None),
            Sandbox.status.in_([SandboxState.READY.value, SandboxState.RUNNING.value]),
            or_(Sandbox.deadline_at.is_(None), Sandbox.deadline_at > expiry),
        )
        .values(deadline_at=expiry)
        .execution_options(synchronize_session=False)
    )
    return ids
