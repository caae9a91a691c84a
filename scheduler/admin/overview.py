"""What ``corral status`` reads from the database: pools with their slots and effective
substrate, work items by state, the queues items wait on that no worker consumes, and
recent failures by error code."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from sqlalchemy import func, select

from corral.shared.store import liveness
from corral.shared.store.db import Database, utcnow
from corral.shared.store.models import ItemState, Pool, WorkItem
from corral.shared.store.pools import pool_view

FAILED_STATES = (ItemState.FAILED.value, ItemState.DISPATCH_ERROR.value)


def pool_rows(db: Database, org_id: str | None = None) -> list[dict[str, Any]]:
    """Every pool (of ``org_id``) that is not deleted: its slots in use of its limit, and
    the runtime and requirement kinds it offers (its override, else its provider's)."""
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
                    "slot_limit": view.slot_limit,
                    "breaker": pool.breaker_state,
                    "runtime_kinds": sorted(view.substrate.runtime_kinds),
                    "requirement_kinds": sorted(view.substrate.requirement_kinds),
                }
            )
        return rows


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
