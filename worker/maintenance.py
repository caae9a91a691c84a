"""Re-driving items: routing those waiting for capacity, re-sending lost provisions."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from datetime import datetime, timedelta

from sqlalchemy import ColumnElement, or_, select
from sqlalchemy.orm import Session

from corral.providers.base import SandboxState
from corral.scheduler.hand_on import hand_on
from corral.scheduler.intake import RouteOutcome
from corral.shared.runtime import Runtime
from corral.shared.store import liveness
from corral.shared.store.db import utcnow
from corral.shared.store.lifecycle import transition
from corral.shared.store.models import ItemState, Pool, Sandbox, WorkItem

log = logging.getLogger(__name__)

NO_WORKER = "no_worker"
DEFAULT_TTL = "CORRAL_ROUTED_TTL_S"
# An item received but never routed (its route task was lost) is picked up after this.
STRANDED_AFTER_S = 5.0


@dataclass(frozen=True)
class RedriveReport:
    routed: list[RouteOutcome]
    resend: list[tuple[str, str]]  # (item id, queue) whose provision task is sent again
    unserved: list[str] = field(default_factory=list)  # items failed as no_worker


def redrive(rt: Runtime, *, actor: str, sweep: bool = True) -> RedriveReport:
    """Divide the shared capacities' free slots among their orgs by weight
    (:func:`corral.shared.store.shares.allocate`), then route the waiting items that can
    take a slot now, in admission order (:func:`corral.scheduler.admission.next_waiting`:
    per org with room, its first waiting items that wait for a pool with a free slot, as
    many as there are). With ``sweep`` (beat's, every ``CORRAL_REDRIVE_INTERVAL_S``; not a
    hand-on asked for by a freed slot), also fail the items no worker will take, route the
    items whose route task was lost and requeued items whose back-off is over (oldest
    first), and find the provision tasks to send again.

    At most ``redrive_batch`` of each; every query reads an index's range (the waiting
    items of an org with room, by queue key; the received items by ``(state,
    updated_at)``), so a freed slot costs one hand-on whatever waits behind it.
    """
    settings = rt.settings
    unserved = fail_unserved(rt, utcnow(), actor=actor) if sweep else []
    resend: list[tuple[str, str]] = []

    def swept(session: Session, now: datetime) -> list[str]:
        lost_provision = now - timedelta(seconds=settings.provision_lease_s)
        resend.extend(_lost_provisions(session, settings.redrive_batch, lost_provision))
        return _stranded(session, now, settings.redrive_batch)

    routed = hand_on(rt, actor=actor, also=swept if sweep else None)
    return RedriveReport(routed=routed, resend=resend, unserved=unserved)


def _stranded(session: Session, now: datetime, limit: int) -> list[str]:
    """Items received and never routed (their route task was lost) and requeued items
    whose back-off is over, oldest first."""
    stranded = now - timedelta(seconds=STRANDED_AFTER_S)
    return list(
        session.scalars(
            select(WorkItem.id)
            .where(
                WorkItem.state == ItemState.RECEIVED.value,
                WorkItem.updated_at < stranded,
                # a requeued item backing off is left until its time has come
                WorkItem.not_before.is_(None) | (WorkItem.not_before <= now),
            )
            .order_by(WorkItem.updated_at)
            .limit(limit)
        )
    )


def fail_unserved(rt: Runtime, now: datetime, *, actor: str) -> list[str]:
    """Fail the items routed to a queue no worker consumes (no consumer said so within
    :data:`corral.shared.store.liveness.FRESH`) longer ago than their pool's
    ``routed_ttl_s``, else ``CORRAL_ROUTED_TTL_S`` (0: they wait for ever): their provision
    task would be sent again every lease for ever, their slot held. Each fails as
    ``no_worker`` through the lifecycle (its slot given back), naming the queue and what to
    start. Oldest first, at most ``redrive_batch``; the ids failed."""
    default = rt.settings.routed_ttl_s
    failed = []
    with rt.db.session() as session:
        served = liveness.consumer_counts(session, now)
        pool_ttls = {
            pool_id: ttl
            for pool_id, ttl in session.execute(
                select(Pool.id, Pool.routed_ttl_s).where(Pool.routed_ttl_s.is_not(None))
            )
            if ttl is not None
        }
        past_ttl = _past_ttl(now, default, pool_ttls)
        if past_ttl is None:
            return []
        query = select(WorkItem).where(WorkItem.state == ItemState.ROUTED.value, past_ttl)
        if served:
            query = query.where(WorkItem.queue.not_in(sorted(served)))
        rows = session.scalars(
            query.order_by(WorkItem.routed_at)
            .limit(rt.settings.redrive_batch)
            .with_for_update(skip_locked=True)
        ).all()
        for item in rows:
            if item.queue is None:
                continue
            own = pool_ttls.get(item.pool_id or "")
            ttl, named = (own, "its pool's routed_ttl_s") if own else (default, DEFAULT_TTL)
            item.error_code = NO_WORKER
            item.error_message = (
                f"no worker consumed its queue {item.queue} for {ttl:.0f} s ({named}): start a "
                "provider worker for it (`corral worker --provider NAME`), or disable the pool"
            )
            transition(session, item, ItemState.FAILED, actor=actor, detail=NO_WORKER)
            failed.append(item.id)
    if failed:
        log.warning("items failed: no worker consumes their queue", extra={"items": len(failed)})
    return failed


def _past_ttl(
    now: datetime, default: float, pool_ttls: dict[str, int]
) -> ColumnElement[bool] | None:
    """Routed longer ago than the TTL of its pool: the pool's own (``pool_ttls``, by pool
    id), else ``default``; a TTL of 0 never passes. None: no pool's ever does."""
    by_ttl: dict[float, list[str]] = {}
    for pool_id, ttl in pool_ttls.items():
        by_ttl.setdefault(float(ttl), []).append(pool_id)
    clauses: list[ColumnElement[bool]] = [
        WorkItem.pool_id.in_(sorted(pool_ids)) & (WorkItem.routed_at < now - timedelta(seconds=ttl))
        for ttl, pool_ids in sorted(by_ttl.items())
        if ttl > 0
    ]
    if default > 0:
        routed_before = WorkItem.routed_at < now - timedelta(seconds=default)
        clauses.append(
            WorkItem.pool_id.not_in(sorted(pool_ttls)) & routed_before
            if pool_ttls
            else routed_before
        )
    return or_(*clauses) if clauses else None


def _lost_provisions(session: Session, limit: int, before: datetime) -> list[tuple[str, str]]:
    """Items whose provision task was lost: routed long ago and never picked up, or stuck
    provisioning after their worker's lease ran out. Provision is idempotent, so sending it
    again is safe; the item is touched so that it is sent again once per lease, not per run.
    """
    now = utcnow()
    stale_lease = select(Sandbox.work_item_id).where(
        Sandbox.status == SandboxState.PROVISIONING.value, Sandbox.lease_until < now
    )
    rows = session.scalars(
        select(WorkItem)
        .where(
            ((WorkItem.state == ItemState.ROUTED.value) & (WorkItem.updated_at < before))
            | (
                (WorkItem.state == ItemState.PROVISIONING.value)
                & WorkItem.id.in_(stale_lease)
                & (WorkItem.updated_at < before)
            )
        )
        .limit(limit)
        .with_for_update(skip_locked=True)
    ).all()
    for item in rows:
        item.updated_at = now
    return [(item.id, item.queue or "") for item in rows if item.queue]
