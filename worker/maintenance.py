"""Ending sandboxes and re-driving items: the maintenance side of a work item's life."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from datetime import datetime, timedelta

from sqlalchemy import select
from sqlalchemy.orm import Session

from providers.base import SandboxHandle
from providers.errors import PermanentProviderError
from scheduler.intake import RouteOutcome, route_item
from shared.db import utcnow
from shared.lifecycle import sandbox_transition, transition
from shared.models import ItemState, Sandbox, SandboxStatusValue, WorkItem
from shared.runtime import Runtime

log = logging.getLogger(__name__)

FINAL_SANDBOX = (SandboxStatusValue.TERMINATED.value, SandboxStatusValue.FAILED.value)
LOST = "sandbox_lost"  # the termination reason of a sandbox that died under its work
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
        if sandbox.external_id is None and sandbox.status == SandboxStatusValue.PROVISIONING:
            # The provider is still making it. The provisioning worker sees the item has
            # ended when it stores the handle, and terminates the sandbox then.
            return False
        provider_id, external_id = sandbox.provider_id, sandbox.external_id
        metadata = dict(sandbox.handle_metadata) or {"org_id": sandbox.org_id}
    if external_id is not None:
        handle = SandboxHandle(provider_id=provider_id, external_id=external_id, metadata=metadata)
        try:
            rt.provider(provider_id).terminate(handle)
        except PermanentProviderError as exc:
            # Retrying cannot help (e.g. the provider is no longer configured); record it so
            # that an operator sees it, rather than retrying for ever.
            reason = f"{reason}; the provider could not terminate it: {exc.message}"
    with rt.db.session() as session:
        sandbox = session.get(Sandbox, sandbox_id, with_for_update=True)
        assert sandbox is not None
        if sandbox.terminated_at is not None:
            return False
        if sandbox.status in FINAL_SANDBOX:
            to = SandboxStatusValue(sandbox.status)
        elif reason == LOST:
            to = SandboxStatusValue.FAILED
        else:
            to = SandboxStatusValue.TERMINATED
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
            .order_by(WorkItem.updated_at)
            .limit(settings.redrive_batch)
        ))  # fmt: skip
        resend = _lost_provisions(session, settings.redrive_batch, lost_provision)
    routed = []
    for item_id in waiting:
        try:
            routed.append(route_item(rt.db, item_id, actor=actor))
        except Exception:  # one bad item must not hold up the rest
            log.exception("re-drive could not route an item", extra={"work_item_id": item_id})
    return RedriveReport(routed=routed, resend=resend)


def _lost_provisions(session: Session, limit: int, before: datetime) -> list[tuple[str, str]]:
    """Items whose provision task was lost: routed long ago and never picked up, or stuck
    provisioning after their worker's lease ran out. Provision is idempotent, so sending it
    again is safe; the item is touched so that it is sent again once per lease, not per run.
    """
    now = utcnow()
    stale_lease = select(Sandbox.work_item_id).where(
        Sandbox.status == SandboxStatusValue.PROVISIONING.value, Sandbox.lease_until < now
    )
    rows = session.scalars(
        select(WorkItem)
        .where(
            ((WorkItem.state == ItemState.ROUTED.value) & (WorkItem.updated_at < before))
            | ((WorkItem.state == ItemState.PROVISIONING.value) & WorkItem.id.in_(stale_lease)
               & (WorkItem.updated_at < before))
        )
        .limit(limit)
        .with_for_update(skip_locked=True)
    ).all()  # fmt: skip
    for item in rows:
        item.updated_at = now
    return [(item.id, item.queue or "") for item in rows if item.queue]


def watch_sandboxes(rt: Runtime, *, actor: str) -> list[str]:
    """Fail the items whose sandbox ended before their runner reported (killed from outside,
    crashed, out of memory). Returns the ids of the items it failed.

    Reads only live sandboxes (index on status), so its cost grows with the sandboxes
    running, not with all ever made.
    """
    with rt.db.session() as session:
        live = list(session.execute(
            select(Sandbox.id, Sandbox.provider_id, Sandbox.external_id, Sandbox.handle_metadata,
                   Sandbox.org_id)
            .where(Sandbox.status.in_([SandboxStatusValue.READY.value,
                                       SandboxStatusValue.RUNNING.value]),
                   Sandbox.terminated_at.is_(None), Sandbox.external_id.is_not(None))
            .limit(rt.settings.redrive_batch)
        ))  # fmt: skip
    failed = []
    for sandbox_id, provider_id, external_id, metadata, org_id in live:
        handle = SandboxHandle(provider_id=provider_id, external_id=external_id,
                               metadata=dict(metadata) or {"org_id": org_id})  # fmt: skip
        try:
            status = rt.provider(provider_id).status(handle)
        except Exception:  # an unreachable provider is asked again next time
            log.warning("status check failed", extra={"sandbox_id": sandbox_id}, exc_info=True)
            continue
        if status.state.is_final and _fail_lost(rt, sandbox_id, status.reason, actor):
            failed.append(sandbox_id)
    return failed


def _fail_lost(rt: Runtime, sandbox_id: str, reason: str | None, actor: str) -> bool:
    with rt.db.session() as session:
        item_id = session.scalar(select(Sandbox.work_item_id).where(Sandbox.id == sandbox_id))
        # Item first, then sandbox: the lock order every path that takes both uses.
        item = session.get(WorkItem, item_id, with_for_update=True)
        sandbox = session.get(Sandbox, sandbox_id, with_for_update=True)
        assert item is not None and sandbox is not None
        if ItemState(item.state).is_final or sandbox.attempt != item.attempts:
            return False  # it reported (or was replaced) first; terminate cleans up
        message = f"the sandbox ended before the work reported: {reason or 'no reason given'}"
        item.error_code = LOST
        item.error_message = message
        transition(session, item, ItemState.FAILED, actor=actor, detail=LOST)
    # The sandbox row is ended by corral.terminate, which also removes what is left of it.
    return True
