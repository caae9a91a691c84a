"""Admission: the order in which an org's waiting items get a slot, and what holds each.

An item whose qualifying pools are all full (or its org at its limit across pools) waits
(``waiting_capacity``). Its place is its **queue key**: the time it began waiting, less its
priority class's head start (:data:`HEAD_START`, in units of ``CORRAL_PRIORITY_AGING_S``):
a high item counts as having waited two aging periods more than it has, a normal one one
period. The key is fixed when the item first waits and kept through its later routings, so
a waiting item never loses its place to one that arrived after it in its project.

The order (:class:`_Turns`): first by **class**, the number of whole aging periods an
item's key lies behind now (a high item starts two periods ahead of a normal one sent with
it, and waiting raises an item's class by itself, so no class starves); within a class, the
**project** of the org holding the fewest slots goes first (an org's projects take turns:
one project's flood does not hold the org's pools past its turn); then by queue key.

Between orgs, capacity an org does not share is its own; a capacity several orgs share is
divided among them by weight before anything is handed on
(:mod:`corral.shared.store.shares`): an org's room on it is its share.

What holds an item (:func:`wait_of`): ``pool_full`` (every pool it qualifies for is full;
they are its ``wait_pools``), ``breaker_open`` (some of them are passed by for their
circuit breaker), or ``org_limit`` (its org's limit across pools; no pools). The re-drive
(:func:`corral.worker.maintenance.redrive`) takes, for each org with room, its next waiting
items in that order that wait for a pool with a free slot: the cost of a freed slot is a
read of each of the org's projects' first item and one hand-on, whatever waits behind them.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import JSON, String, func, select, text, tuple_
from sqlalchemy.orm import Session

from corral.scheduler.routing import Waiting
from corral.shared.messages import Priority
from corral.shared.settings import BreakerSettings, IntakeSettings
from corral.shared.store import breaker, org_limits, slots
from corral.shared.store.breaker import PROBE, SKIP
from corral.shared.store.db import UTCDateTime, utcnow
from corral.shared.store.models import SLOT_HOLDING_STATES, ItemState, Pool, WorkItem
from corral.shared.store.places import items_ahead
from corral.shared.store.pools import waiting_room

_HOLDING = sorted(state.value for state in SLOT_HOLDING_STATES)
HEAD_START: dict[Priority, int] = {"low": 0, "normal": 1, "high": 2}
POOL_FULL, BREAKER_OPEN, ORG_LIMIT = "pool_full", "breaker_open", org_limits.WAIT_REASON
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


@dataclass(frozen=True)
class Room:
    """A pool's free slots for its waiting items now, and whether it is closed to fresh
    arrivals (:func:`corral.shared.store.slots.close`: a slot handed on must be granted)."""

    org_id: str
    free: int
    closed: bool


def rooms(session: Session, settings: BreakerSettings, now: datetime) -> dict[str, Room]:
    """Each active pool's free slots for its waiting items, where it has some and its
    breaker lets work through (a half-open pool counts for its one probe): on a shared
    capacity within its share (its division's), elsewhere within its own limit (a share
    there only closes it to fresh arrivals)."""
    free = {}
    for row in session.scalars(
        select(Pool).where(Pool.active.is_(True), Pool.deleted_at.is_(None))
    ):
        gate = breaker.gate(row, settings, now)
        if gate == SKIP:
            continue
        closed = row.capacity_id is None and row.share_limit is not None
        room = waiting_room(row, breaker=gate)
        if room > 0:
            free[row.id] = Room(row.org_id, 1 if gate == PROBE else room, closed)
    return free


def next_waiting(
    session: Session, settings: IntakeSettings, *, limit: int, now: datetime | None = None
) -> list[str]:
    """The waiting items to route now, in admission order: per org with a pool that has
    room, as many of its waiting items as those pools have free slots (and its limit, if it
    has one, leaves room for), that wait for such a pool (or for the org's limit), its
    projects taking turns (:class:`_Turns`). At most
    ``limit`` rows are read per org, so the cost follows the free slots and the org's
    projects, not the waiting backlog.

    The slots of closed pools the items are chosen for are granted to them (in the
    caller's transaction, committed before they are routed), and an org's closed pools
    that keep room once every waiting item of the org was considered are opened again."""
    now = now or utcnow()
    pools = rooms(session, settings, now)
    free = {pool_id: room.free for pool_id, room in pools.items()}
    orgs: Counter[str] = Counter()
    for pool in pools.values():
        orgs[pool.org_id] += pool.free
    # An org with a limit takes no more than the room its limit leaves, whatever its pools'
    # free slots: routing more of its items would find them refused and waiting again.
    for org_id, left in org_limits.OrgRoom.read(session, list(orgs), lock=False).left.items():
        orgs[org_id] = min(orgs[org_id], max(left, 0))
    chosen: list[str] = []
    granted: Counter[str] = Counter()
    emptied: list[str] = []
    for org_id, org_room in sorted(orgs.items()):
        if org_room <= 0:
            continue  # at its limit: its waiting items keep their places, none is read
        turns = _Turns(session, org_id, now, settings.priority_aging_s)
        for item_id, pool_id in turns.next(org_room, free, limit):
            chosen.append(item_id)
            if pool_id is not None and pools[pool_id].closed:
                granted[pool_id] += 1
        if not turns.heads:  # every waiting item of the org considered
            emptied += [p for p, pool in pools.items() if pool.org_id == org_id and pool.closed]
    slots.grant(session, granted)
    slots.reopen(session, [pool_id for pool_id in emptied if free[pool_id] > 0])
    return chosen


# The most projects of one org whose heads one hand-on considers (in project id order):
# what a tenant's number of projects can cost a re-drive.
MAX_PROJECTS = 256
_HEADS = text(
    """
    WITH RECURSIVE projects(project_id, n) AS (
        SELECT min(project_id), 1 FROM work_items
         WHERE org_id = :org AND state = 'waiting_capacity'
        UNION ALL
        SELECT (SELECT min(w.project_id) FROM work_items w
                 WHERE w.org_id = :org AND w.state = 'waiting_capacity'
                   AND w.project_id > p.project_id), p.n + 1
          FROM projects p
         WHERE p.project_id IS NOT NULL AND p.n < :cap
    )
    SELECT w.id, w.project_id, w.queue_key, w.wait_pools
      FROM projects p
      JOIN work_items w ON w.id = (
          SELECT h.id FROM work_items h
           WHERE h.org_id = :org AND h.state = 'waiting_capacity'
             AND h.project_id = p.project_id
           ORDER BY h.queue_key, h.id
           LIMIT 1)
     WHERE p.project_id IS NOT NULL
    """
).columns(id=String(), project_id=String(), queue_key=UTCDateTime(), wait_pools=JSON())


@dataclass
class _Head:
    id: str
    project_id: str
    key: datetime
    pools: list[str] | None


class _Turns:
    """An org's waiting items in admission order: by priority class with aging (a class is
    the number of aging periods an item's queue key lies behind now), then, within a class,
    the project holding the fewest slots first (projects take turns: one that floods the
    org's pools holds them no longer than its turn), then by queue key. Each project's
    items are read in queue-key order, its first one for all projects at once (an index
    probe per project, :data:`_HEADS`), the next ones only for the projects chosen."""

    def __init__(self, session: Session, org_id: str, now: datetime, aging_s: float) -> None:
        self.session, self.org_id, self.now, self.aging_s = session, org_id, now, aging_s
        self.read = 0
        self.heads: dict[str, _Head] = {}
        for row in session.execute(_HEADS, {"org": org_id, "cap": MAX_PROJECTS}):
            self.heads[row.project_id] = _Head(
                row.id, row.project_id, row.queue_key, row.wait_pools
            )
            self.read += 1
        self.held = self._held() if len(self.heads) > 1 else {}

    def _held(self) -> dict[str, int]:
        """The slots each of the org's projects holds now (a count of its items in a
        slot-holding state: at most the org's slots)."""
        pools = select(Pool.id).where(Pool.org_id == self.org_id)
        rows = self.session.execute(
            select(WorkItem.project_id, func.count())
            .where(WorkItem.pool_id.in_(pools), WorkItem.state.in_(_HOLDING))
            .group_by(WorkItem.project_id)
        )
        return {project: int(count) for project, count in rows}

    def _rank(self, head: _Head) -> tuple[int, int, datetime, str]:
        waited = (self.now - head.key).total_seconds()
        return (-int(waited // self.aging_s), self.held.get(head.project_id, 0), head.key, head.id)

    def next(self, room: int, free: dict[str, int], limit: int) -> list[tuple[str, str | None]]:
        """Up to ``room`` items to route, each with the pool with a free slot in ``free``
        it waits for (taken from it), or None: it waits for its org's limit."""
        chosen: list[tuple[str, str | None]] = []
        while room > 0 and self.heads and self.read < limit:
            head = min(self.heads.values(), key=self._rank)
            # No pools: it waits for its org's room (or waited before pools were recorded).
            open_pool = next((p for p in head.pools or () if free.get(p, 0) > 0), None)
            if head.pools and open_pool is None:
                self._advance(head)  # every pool it waits for is full: it keeps its place
                continue
            if open_pool is not None:
                free[open_pool] -= 1
            chosen.append((head.id, open_pool))
            self.held[head.project_id] = self.held.get(head.project_id, 0) + 1
            room -= 1
            if room > 0:  # else no read of the next: nothing more is handed on
                self._advance(head)
        return chosen

    def _advance(self, head: _Head) -> None:
        """The project's next waiting item after ``head`` becomes its head (none: the
        project leaves the turns)."""
        row = self.session.execute(
            select(WorkItem.id, WorkItem.queue_key, WorkItem.wait_pools)
            .where(
                WorkItem.org_id == self.org_id,
                WorkItem.project_id == head.project_id,
                WorkItem.state == ItemState.WAITING_CAPACITY.value,
                tuple_(WorkItem.queue_key, WorkItem.id) > (head.key, head.id),
            )
            .order_by(WorkItem.queue_key, WorkItem.id)
            .limit(1)
        ).first()
        self.read += 1
        if row is None:
            del self.heads[head.project_id]
        else:
            self.heads[head.project_id] = _Head(
                row.id, head.project_id, row.queue_key, row.wait_pools
            )


def ahead_of(session: Session, item: WorkItem) -> int:
    """How many of its org's waiting items come before ``item`` by queue key (at most
    :data:`~corral.shared.store.places.MAX_AHEAD`): an index range count. Its place in
    admission order, but for the turns of its org's projects within a class, which may move
    it up or down."""
    if item.queue_key is None:
        return 0
    return items_ahead(
        session,
        WorkItem.org_id == item.org_id,
        WorkItem.state == ItemState.WAITING_CAPACITY.value,
        tuple_(WorkItem.queue_key, WorkItem.id) < (item.queue_key, item.id),
    )
