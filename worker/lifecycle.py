"""Ending sandboxes and re-driving items: the maintenance side of a work item's life."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from datetime import timedelta

from sqlalchemy import select

from providers.base import SandboxHandle
from scheduler.intake import RouteOutcome, route_item
from shared.db import utcnow
from shared.lifecycle import sandbox_transition
from shared.models import ItemState, Sandbox, SandboxStatusValue, WorkItem
from shared.runtime import Runtime

log = logging.getLogger(__name__)

FINAL_SANDBOX = (SandboxStatusValue.TERMINATED.value, SandboxStatusValue.FAILED.value)
# An item received but never routed (its route task was lost) is picked up after this.
STRANDED_AFTER_S = 5.0


def terminate_sandbox(rt: Runtime, sandbox_id: str, *, reason: str, actor: str) -> bool:
    """Stop ``sandbox_id`` at its provider and record why. Idempotent.

    Returns whether this call ended it (False: it had ended already or does not exist).

    Raises:
        TransientProviderError: the provider could not be reached; nothing was recorded.
    """
    with rt.db.session() as session:
        sandbox = session.get(Sandbox, sandbox_id)
        if sandbox is None or sandbox.terminated_at is not None:
            return False
        provider_id, external_id = sandbox.provider_id, sandbox.external_id
        metadata = dict(sandbox.handle_metadata) or {"org_id": sandbox.org_id}
    if external_id is not None:
        handle = SandboxHandle(provider_id=provider_id, external_id=external_id, metadata=metadata)
        rt.provider(provider_id).terminate(handle)
    with rt.db.session() as session:
        sandbox = session.get(Sandbox, sandbox_id, with_for_update=True)
        assert sandbox is not None
        if sandbox.terminated_at is not None:
            return False
        to = (
            SandboxStatusValue(sandbox.status)
            if sandbox.status in FINAL_SANDBOX
            else SandboxStatusValue.TERMINATED
        )
        sandbox.terminated_at = utcnow()
        sandbox.termination_reason = reason
        sandbox_transition(session, sandbox, to, actor=actor, detail=reason)
    return True


@dataclass(frozen=True)
class RedriveReport:
    routed: list[RouteOutcome]
    resend: list[tuple[str, str]]  # (item id, queue) whose provision task is sent again


def redrive(rt: Runtime, *, actor: str) -> RedriveReport:
    """Route items waiting for capacity and items whose route task was lost.

    Oldest first, at most ``redrive_batch`` per call; the query reads only items in those
    states (an index on ``(state, updated_at)``), not the whole table.
    """
    settings = rt.settings
    stranded = utcnow() - timedelta(seconds=STRANDED_AFTER_S)
    lost_provision = utcnow() - timedelta(seconds=settings.provision_lease_s)
    with rt.db.session() as session:
        waiting = list(session.scalars(
            select(WorkItem.id)
            .where(
                (WorkItem.state == ItemState.WAITING_CAPACITY.value)
                | ((WorkItem.state == ItemState.RECEIVED.value) & (WorkItem.updated_at < stranded))
            )
            .order_by(WorkItem.created_at)
            .limit(settings.redrive_batch)
        ))  # fmt: skip
        # Routed long ago and never picked up: the provision message was lost. Provision is
        # idempotent, so sending it again is safe.
        resend = list(session.execute(
            select(WorkItem.id, WorkItem.queue)
            .where(WorkItem.state == ItemState.ROUTED.value, WorkItem.updated_at < lost_provision)
            .limit(settings.redrive_batch)
        ))  # fmt: skip
    routed = [route_item(rt.db, item_id, actor=actor) for item_id in waiting]
    return RedriveReport(routed=routed, resend=[(str(i), str(q)) for i, q in resend])
