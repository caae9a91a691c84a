"""Admission: the order in which an org's waiting items get a slot, and what holds each.

An item whose qualifying pools are all full (or its org at its limit across pools) waits
(``waiting_capacity``). Its place is its **queue key**: the time it began waiting, less its
priority class's head start (:data:`HEAD_START`, in units of ``CORRAL_PRIORITY_AGING_S``):
a high item counts as having waited two aging periods more than it has, a normal one one
period. Ordered by that key, higher classes go first, and waiting raises an item's rank by
itself: an item that has waited an aging period longer than one a class above it goes
first, so no class starves. The key is fixed when the item first waits and kept through its
later routings, so a waiting item never loses its place to one that arrived after it.

What holds it (:func:`wait_of`): ``pool_full`` (every pool it qualifies for is full; they are
its ``wait_pools``), ``breaker_open`` (some of them are passed by for their circuit breaker),
or ``org_limit`` (its org's limit across pools; no pools). The re-drive
(:func:`corral.worker.maintenance.redrive`) reads, for each org with room, the first
waiting items in key order, and routes those that wait for a pool with a free slot: the
cost of a freed slot is one hand-on, whatever waits behind it.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import select, tuple_
from sqlalchemy.orm import Session

from corral.scheduler.routing import Waiting
from corral.shared.messages import Priority
from corral.shared.settings import BreakerSettings
from corral.shared.store import breaker
from corral.shared.store.breaker import PROBE, SKIP
from corral.shared.store.db import utcnow
from corral.shared.store.models import ItemState, Pool, WorkItem
from corral.shared.store.places import items_ahead
from corral.shared.store.pools import pool_view

HEAD_START: dict[Priority, int] = {"low": 0, "normal": 1, "high": 2}
POOL_FULL, BREAKER_OPEN, ORG_LIMIT = "pool_full", "breaker_open", "org_limit"
_SAID = {
    POOL_FULL: "every qualifying pool is full",
    BREAKER_OPEN: "every qualifying pool is full or passed by for its circuit breaker",
    ORG_LIMIT: "the org is at its limit across its pools",
}


def queue_key(priority: Priority, since: datetime, aging_s: float) -> datetime:
    """An item's place among its org's waiting items, waiting since ``since``."""
    return since - timedelta(seconds=HEAD_START[priority] * aging_s)


@dataclass(frozen=True)
class Wait:
    """What holds a waiting item: a reason and the pools it waits for."""

    reason: str
    pools: tuple[str, ...]

    @property
    def detail(self) -> str:
        """The reason in words (its lifecycle event's detail)."""
        return _SAID[self.reason]

    def columns(self, key: datetime) -> dict[str, Any]:
        """The item's admission columns (``work_items``) for this wait, at ``key``."""
        return {"queue_key": key, "wait_reason": self.reason, "wait_pools": list(self.pools)}


NOT_WAITING: dict[str, Any] = {"queue_key": None, "wait_reason": None, "wait_pools": None}


def wait_of(waiting: Waiting) -> Wait:
    """What a routing decision to wait says holds the item."""
    if not waiting.pools:
        return Wait(ORG_LIMIT, ())
    pools = tuple(sorted(pool.id for pool in waiting.pools))
    breaker = any(pool.breaker == SKIP for pool in waiting.pools)
    return Wait(BREAKER_OPEN if breaker else POOL_FULL, pools)


def rooms(session: Session, settings: BreakerSettings, now: datetime) -> dict[str, tuple[str, int]]:
    """Each active pool's org and free slots, where it has some and its breaker lets work
    through (a half-open pool counts for its one probe)."""
    free = {}
    for row in session.scalars(
        select(Pool).where(Pool.active.is_(True), Pool.deleted_at.is_(None))
    ):
        gate = breaker.gate(row, settings, now)
        if gate == SKIP:
            continue
        room = pool_view(row, breaker=gate).slot_limit - row.slots_in_use
        if room > 0:
            free[row.id] = (row.org_id, 1 if gate == PROBE else room)
    return free


def next_waiting(
    session: Session, settings: BreakerSettings, *, limit: int, now: datetime | None = None
) -> list[str]:
    """The waiting items to route now, in admission order: per org with a pool that has
    room, its first waiting items (by queue key) that wait for such a pool (or for the
    org's limit), as many as those pools have free slots. At most ``limit`` rows are read
    per org, so the cost follows the free slots and the pools, not the waiting backlog."""
    free: dict[str, int] = {}
    orgs: dict[str, int] = {}
    for pool_id, (org_id, room) in rooms(session, settings, now or utcnow()).items():
        free[pool_id] = room
        orgs[org_id] = orgs.get(org_id, 0) + room
    chosen: list[str] = []
    for org_id, room in sorted(orgs.items()):
        chosen += _org_next(session, org_id, room, free, limit)
    return chosen


def _org_next(
    session: Session, org_id: str, room: int, free: dict[str, int], limit: int
) -> list[str]:
    chosen: list[str] = []
    page, read, after = min(limit, max(8, 2 * room)), 0, None
    while room > 0 and read < limit:
        query = (
            select(WorkItem.id, WorkItem.wait_pools, WorkItem.queue_key)
            .where(WorkItem.org_id == org_id, WorkItem.state == ItemState.WAITING_CAPACITY.value)
            .order_by(WorkItem.queue_key, WorkItem.id)
            .limit(page)
        )
        if after is not None:
            query = query.where(tuple_(WorkItem.queue_key, WorkItem.id) > after)
        rows = session.execute(query).all()
        for item_id, pools, key in rows:
            read += 1
            after = (key, item_id)
            # No pools: it waits for its org's room (or waited before pools were recorded).
            open_pool = next((p for p in pools or () if free.get(p, 0) > 0), None)
            if pools and open_pool is None:
                continue  # every pool it waits for is full: it keeps its place
            if open_pool is not None:
                free[open_pool] -= 1
            chosen.append(item_id)
            room -= 1
            if room == 0:
                break
        if len(rows) < page:
            break
    return chosen


def ahead_of(session: Session, item: WorkItem) -> int:
    """How many of its org's waiting items come before ``item`` in admission order (at
    most :data:`~corral.shared.store.places.MAX_AHEAD`): an index range count."""
    if item.queue_key is None:
        return 0
    return items_ahead(
        session,
        WorkItem.org_id == item.org_id,
        WorkItem.state == ItemState.WAITING_CAPACITY.value,
        tuple_(WorkItem.queue_key, WorkItem.id) < (item.queue_key, item.id),
    )
