"""What ``corral status`` and the console's overview read from the database: pools with
their slots and effective substrate, work items by state, the processes that consume each
queue, the queues items wait on that no worker consumes, and recent failures by error
code."""

from __future__ import annotations

from collections.abc import Mapping
from datetime import timedelta
from typing import Any

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from corral.shared.broker.queues import DISPATCH_QUEUE, MAINTENANCE_QUEUE, provider_queues
from corral.shared.store import liveness, shares
from corral.shared.store.db import Database, utcnow
from corral.shared.store.models import ItemState, Pool, QueueConsumer, WorkItem
from corral.shared.store.pools import pool_view, waiting_room

FAILED_STATES = (ItemState.FAILED.value, ItemState.DISPATCH_ERROR.value)


def pool_rows(db: Database, org_id: str | None = None) -> list[dict[str, Any]]:
    """Every pool (of ``org_id``) that is not deleted: its slots in use of its limit, the
    items waiting for it, and the runtime and requirement kinds it offers (its override,
    else its provider's). A pool whose stored override does not parse (written around the
    admin api, or by an older version) offers none, and its ``problem`` says why: routing
    refuses it the same way, and the other pools are still shown."""
    query = (
        select(Pool)
        .where(Pool.deleted_at.is_(None))
        .order_by(Pool.org_id, Pool.priority.desc(), Pool.name)
    )
    if org_id is not None:
        query = query.where(Pool.org_id == org_id)
    with db.session() as session:
        rows = []
        for pool in session.scalars(query):
            view = pool_view(pool)
            rows.append(
                {
                    "id": pool.id,
                    "org": pool.org_id,
                    "name": pool.name,
                    "provider": pool.provider_id,
                    "priority": pool.priority,
                    "active": pool.active,
                    "slots_in_use": pool.slots_in_use,
                    # Its room for waiting items: a share closing it to intake is not less.
                    "slot_limit": pool.slots_in_use + waiting_room(pool),
                    "waiting": _waiting(session, pool),
                    "breaker": pool.breaker_state,
                    "runtime_kinds": sorted(view.substrate.runtime_kinds),
                    "requirement_kinds": sorted(view.substrate.requirement_kinds),
                    "problem": view.problem,
                }
            )
        return rows


def _waiting(session: Session, pool: Pool) -> str:
    """How many items wait for ``pool``: ``N``, or ``N+`` when counted only up to
    :data:`~corral.shared.store.shares.WAITING_COUNTED` of its org's."""
    counted = shares.WAITING_COUNTED
    count, all_counted = shares.waiting_for(session, pool.org_id, pool.id, counted)
    return f"{count}" if all_counted else f"{count}+"


def items_by_state(db: Database, org_id: str | None = None) -> dict[str, int]:
    """How many work items (of ``org_id``) are in each state (states with none left out), in
    lifecycle order."""
    query = select(WorkItem.state, func.count()).group_by(WorkItem.state)
    if org_id is not None:
        query = query.where(WorkItem.org_id == org_id)
    with db.session() as session:
        counts = {state: count for state, count in session.execute(query)}
    return {state.value: counts[state.value] for state in ItemState if state.value in counts}


def unserved_queues(db: Database, org_id: str | None = None) -> list[dict[str, Any]]:
    """The queues items (of ``org_id``) are routed to and no worker consumes (none said so
    in the last minute): each with its items and when the oldest was routed. They fail as
    ``no_worker`` once their pool's routed TTL passes."""
    with db.session() as session:
        found = liveness.unserved(session, org_id)
    return [
        {
            "queue": one.queue,
            "items": one.items,
            "oldest_routed_at": one.oldest_routed_at.isoformat() if one.oldest_routed_at else None,
        }
        for one in found
    ]


def failures_by_code(db: Database, since: timedelta, org_id: str | None = None) -> dict[str, Any]:
    """Items (of ``org_id``) that failed (or could not be dispatched) since then, by error
    code, most first."""
    query = (
        select(WorkItem.error_code, func.count())
        .where(WorkItem.state.in_(FAILED_STATES), WorkItem.updated_at >= utcnow() - since)
        .group_by(WorkItem.error_code)
    )
    if org_id is not None:
        query = query.where(WorkItem.org_id == org_id)
    with db.session() as session:
        counts = [(code or "unknown", count) for code, count in session.execute(query)]
    counts.sort(key=lambda pair: (-pair[1], pair[0]))
    return {"codes": dict(counts)}


def queue_names(session: Session, org_id: str | None = None) -> list[str]:
    """corral's queues: dispatch, maintenance, each active pool's provider's, and any a
    consumer said it consumes; of ``org_id``: its active pools' providers' alone."""
    query = select(Pool.provider_id).where(Pool.active.is_(True), Pool.deleted_at.is_(None))
    if org_id is not None:
        query = query.where(Pool.org_id == org_id)
    names = set()
    for provider_id in session.scalars(query.distinct()):
        names.update(provider_queues(provider_id))
    if org_id is None:
        names |= {DISPATCH_QUEUE, MAINTENANCE_QUEUE} | liveness.known_queues(session)
    return sorted(names)


def processes(db: Database) -> list[dict[str, Any]]:
    """The processes that said within :data:`liveness.FRESH` that they consume queues: each
    with its queues and how many seconds ago it last said so, by name."""
    now = utcnow()
    with db.session() as session:
        rows = session.execute(
            select(QueueConsumer.consumer_id, QueueConsumer.queue, QueueConsumer.seen_at).where(
                QueueConsumer.seen_at >= now - liveness.FRESH
            )
        ).all()
    found: dict[str, dict[str, Any]] = {}
    for consumer_id, queue, seen_at in rows:
        one = found.setdefault(consumer_id, {"name": consumer_id, "queues": [], "seen_s": None})
        one["queues"].append(queue)
        ago = max((now - seen_at).total_seconds(), 0.0)
        one["seen_s"] = ago if one["seen_s"] is None else min(one["seen_s"], ago)
    for one in found.values():
        one["queues"].sort()
    return [found[name] for name in sorted(found)]


def queue_rows(
    db: Database, org_id: str | None = None, waiting: Mapping[str, int] | None = None
) -> list[dict[str, Any]]:
    """Each queue (of ``org_id``'s pools) with its live consumers, the messages ``waiting``
    on it (as the broker said; None: not asked, or no answer) and the items routed to it
    that no worker has taken yet; ``unserved``: it has work and no consumer."""
    with db.session() as session:
        consumers = liveness.consumer_counts(session)
        query = (
            select(WorkItem.queue, func.count())
            .where(WorkItem.state == ItemState.ROUTED.value, WorkItem.queue.is_not(None))
            .group_by(WorkItem.queue)
        )
        if org_id is not None:
            query = query.where(WorkItem.org_id == org_id)
        routed = {str(queue): int(count) for queue, count in session.execute(query)}
        # A queue items wait on shows even when no active pool names it any more.
        names = sorted({*queue_names(session, org_id), *routed})
    rows = []
    for name in names:
        messages = None if waiting is None else waiting.get(name)
        work = routed.get(name, 0) + (messages or 0)
        rows.append(
            {
                "queue": name,
                "consumers": consumers.get(name, 0),
                "waiting": messages,
                "routed": routed.get(name, 0),
                "unserved": work > 0 and not consumers.get(name),
            }
        )
    return rows
