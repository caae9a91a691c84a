"""Cancelling a work item, for the api (``POST /v1/work-items/{id}/cancel``) and
``corral cancel``."""

from __future__ import annotations

import logging

from sqlalchemy import select

from corral.shared.broker.celery_app import app as celery_app
from corral.shared.store.db import Database
from corral.shared.store.lifecycle import transition
from corral.shared.store.models import ItemState, Sandbox, TerminationReason, WorkItem

log = logging.getLogger(__name__)


def cancel_item(db: Database, item_id: str, *, actor: str) -> tuple[ItemState, bool]:
    """Cancel an item that has not finished and ask for its sandbox's end; its runner stops
    at its next heartbeat. The state it is in afterwards (cancelled, or the final state it
    had already reached) and whether this call cancelled it.

    Raises:
        LookupError: no such item.
    """
    with db.session() as session:
        item = session.get(WorkItem, item_id, with_for_update=True)
        if item is None:
            raise LookupError(f"work item {item_id} does not exist")
        if ItemState(item.state).is_final:
            return ItemState(item.state), False
        transition(session, item, ItemState.CANCELLED, actor=actor, detail="cancel requested")
        sandbox_id = session.scalar(
            select(Sandbox.id).where(
                Sandbox.work_item_id == item.id, Sandbox.attempt == item.attempts
            )
        )
    if sandbox_id is not None:
        # Should the broker be away, the reaper ends the sandbox anyway (rule finished).
        try:
            celery_app.send_task("corral.terminate", args=[sandbox_id, TerminationReason.CANCELLED])
        except Exception:  # any broker failure: the reaper's backstop remains
            log.warning("terminate task not sent", extra={"sandbox_id": sandbox_id})
    return ItemState.CANCELLED, True
