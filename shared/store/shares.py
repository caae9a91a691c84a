"""Shared capacity: slots several orgs' pools draw on, divided among the orgs by weight.

A **capacity** (``capacities``) is what the deployment has to share: a host's sandboxes, a
provider account's quota. Each org draws on it through one pool of its own
(``pools.capacity_id``), which keeps everything else an org's pool has (its capabilities,
rate card, breaker, budget). The pool's **share** (``pools.share_limit``) is the most slots
it may hold now; routing's guarded update (:func:`corral.shared.store.slots.take_slots`, and
the batch write's) never takes a slot past it, and an item leaving a slot gives the share
back with it (:func:`~corral.shared.store.slots.free_slots`). So the shares of a capacity
never add up to more than its slots, and neither do the slots its pools hold.

The shares are set by :func:`allocate`, which the re-drive runs before it hands slots on
(:func:`corral.worker.maintenance.redrive`): each org's **target** is its weighted max-min
fair part of the capacity, given what it wants (the slots it holds and the items waiting for
its pool, counted up to the capacity's slots: :func:`divide`); the free slots go to the orgs
below their target, the furthest below first (by slots held over weight), and what no org
wants is left as headroom, divided by weight, so that the next arrivals start at once. An
org above its target keeps its slots until its items end; its share is then what it holds,
so each slot it gives back goes to an org below its target. Keyed by the org alone, never
by anything a tenant can multiply (projects, keys): an org that spreads its work over 50
projects is one org here.

An org's weight (``org_weights``, 1 without a row) is the deployment's: the admin api and
``corral orgs weight``.
"""

from __future__ import annotations

import heapq
import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from sqlalchemy import select, update
from sqlalchemy.exc import OperationalError
from sqlalchemy.orm import Session

from corral.shared.store import slots as pool_slots
from corral.shared.store.db import utcnow
from corral.shared.store.models import Capacity, ItemState, OrgWeight, Pool, WorkItem

log = logging.getLogger(__name__)

# PostgreSQL's lock_not_available: a row FOR UPDATE NOWAIT found locked.
LOCK_NOT_AVAILABLE = "55P03"
# How many of an org's waiting items a view counts for a pool (past that: "N+").
WAITING_COUNTED = 1_000
DEFAULT_WEIGHT = 1
MAX_WEIGHT = 1_000
MAX_SLOTS = 1_000_000


def divide(slots: int, wants: Mapping[str, int], weights: Mapping[str, int]) -> dict[str, int]:
    """Weighted max-min fair division of ``slots`` among the orgs of ``wants``: no org gets
    more than it wants, and a slot goes to the org with the least slots per weight so far
    (ties: the lower org id), so orgs that all want more end within one slot of their
    weights' proportion. Every org of ``wants`` is in the answer."""
    given = dict.fromkeys(wants, 0)
    heap = [(1 / _weight(weights, org), org) for org, want in wants.items() if want > 0]
    heapq.heapify(heap)
    left = slots
    while left > 0 and heap:
        _, org = heapq.heappop(heap)
        given[org] += 1
        left -= 1
        if given[org] < wants[org]:
            heapq.heappush(heap, ((given[org] + 1) / _weight(weights, org), org))
    return given


def _weight(weights: Mapping[str, int], org: str) -> int:
    return max(1, weights.get(org, DEFAULT_WEIGHT))


@dataclass(frozen=True)
class Member:
    """One org's pool on a capacity, as the division reads it."""

    pool_id: str
    org_id: str
    held: int  # slots it holds
    waiting: int  # its items waiting for it, counted up to the capacity's slots
    share: int | None  # its share now


def shares(slots: int, members: Iterable[Member], weights: Mapping[str, int]) -> dict[str, int]:
    """Each member pool's new share (by pool id): what it holds, plus the free slots handed
    to the orgs below their fair target (furthest below first), plus, of what no org wants,
    its part by weight (headroom for the next arrivals). They add up to at most ``slots``."""
    members = list(members)
    held = {m.org_id: m.held for m in members}
    free = slots - sum(held.values())
    target = divide(slots, {m.org_id: m.held + m.waiting for m in members}, weights)
    grant = dict.fromkeys(held, 0)
    # The free slots, one at a time, to the org with the fewest (held + granted) per weight
    # among those still below their target.
    heap = [
        ((held[org] + 1) / _weight(weights, org), org) for org in held if target[org] > held[org]
    ]
    heapq.heapify(heap)
    while free > 0 and heap:
        _, org = heapq.heappop(heap)
        grant[org] += 1
        free -= 1
        if held[org] + grant[org] < target[org]:
            heapq.heappush(heap, ((held[org] + grant[org] + 1) / _weight(weights, org), org))
    if free > 0:  # wanted by none: headroom, by weight
        room = divide(free, dict.fromkeys(held, free), weights)
        grant = {org: grant[org] + room[org] for org in grant}
    return {m.pool_id: m.held + grant[m.org_id] for m in members}


def allocate(session: Session) -> dict[str, dict[str, int]]:
    """Set the shares of every capacity's pools (:func:`shares`); the capacities whose
    shares changed, with each pool's new share.

    Each capacity's row is locked (two re-drives take turns), then its pools' rows in id
    order, so that no router takes a slot between the read of a pool's slots and the write
    of its share. The pools' locks are taken without waiting (``NOWAIT``): a router or an
    ending item that holds one, and may be waiting for another pool's row, is never waited
    for, so a division cannot be part of a deadlock. A capacity whose pools are busy is
    left as it is until the next re-drive (each freed slot asks for one)."""
    changed: dict[str, dict[str, int]] = {}
    capacities = session.execute(
        select(Capacity.id, Capacity.slots).order_by(Capacity.id).with_for_update()
    ).all()
    for capacity_id, slots in capacities:
        try:
            with session.begin_nested():
                moved = _divide_capacity(session, capacity_id, slots)
        except OperationalError as exc:
            if getattr(exc.orig, "sqlstate", None) != LOCK_NOT_AVAILABLE:
                raise
            log.debug("a shared capacity's pools are busy; divided at the next re-drive")
            continue
        if moved:
            changed[capacity_id] = moved
    return changed


def _divide_capacity(session: Session, capacity_id: str, slots: int) -> dict[str, int]:
    """Set the shares of one capacity's pools; those that moved."""
    linked = session.execute(
        select(
            Pool.id,
            Pool.org_id,
            Pool.slots_in_use,
            Pool.share_limit,
            (Pool.active & Pool.deleted_at.is_(None)).label("drawing"),
        )
        .where(Pool.capacity_id == capacity_id)
        .order_by(Pool.id)
        .with_for_update(nowait=True)
    ).all()
    pools = [row for row in linked if row.drawing]
    # A disabled pool's items keep their slots until they end: the others share the rest.
    held_elsewhere = sum(row.slots_in_use for row in linked if not row.drawing)
    if not pools:
        return {}
    weights = weights_of(session, [row.org_id for row in pools])
    members = [
        Member(
            row.id,
            row.org_id,
            row.slots_in_use,
            waiting_for(session, row.org_id, row.id, slots)[0],
            row.share_limit,
        )
        for row in pools
    ]
    new = shares(max(0, slots - held_elsewhere), members, weights)
    moved = {m.pool_id: new[m.pool_id] for m in members if new[m.pool_id] != m.share}
    for pool_id, share in moved.items():
        session.execute(
            update(Pool)
            .where(Pool.id == pool_id)
            .values(share_limit=share)
            .execution_options(synchronize_session=False)
        )
    return moved


def waiting_for(session: Session, org_id: str, pool_id: str, cap: int) -> tuple[int, bool]:
    """How many of ``org_id``'s first ``cap`` waiting items (in admission order: an index
    range) wait for ``pool_id``, whatever waits behind them, and whether those were all of
    the org's waiting items (else the count is a lower bound)."""
    rows = session.scalars(
        select(WorkItem.wait_pools)
        .where(WorkItem.org_id == org_id, WorkItem.state == ItemState.WAITING_CAPACITY.value)
        .order_by(WorkItem.queue_key, WorkItem.id)
        .limit(cap)
    ).all()
    return sum(1 for pools in rows if pools and pool_id in pools), len(rows) < cap


def weights_of(session: Session, orgs: Iterable[str]) -> dict[str, int]:
    """The weights of ``orgs`` that have one set (the others weigh :data:`DEFAULT_WEIGHT`)."""
    wanted = sorted(set(orgs))
    if not wanted:
        return {}
    return dict(
        session.execute(
            select(OrgWeight.org_id, OrgWeight.weight).where(OrgWeight.org_id.in_(wanted))
        ).all()
    )


def set_weight(session: Session, org_id: str, weight: int | None) -> None:
    """Set ``org_id``'s weight (None: back to :data:`DEFAULT_WEIGHT`).

    Raises:
        ValueError: a weight outside 1..MAX_WEIGHT.
    """
    row = session.get(OrgWeight, org_id)
    if weight is None:
        if row is not None:
            session.delete(row)
        return
    if not 1 <= weight <= MAX_WEIGHT:
        raise ValueError(f"weight must be between 1 and {MAX_WEIGHT}")
    if row is None:
        session.add(OrgWeight(org_id=org_id, weight=weight, updated_at=utcnow()))
    else:
        row.weight = weight
        row.updated_at = utcnow()


# -- where a pool draws its slots from: the one place its link to a capacity is written --


def put_on(pool: Pool, capacity: Capacity) -> None:
    """Link ``pool`` to ``capacity``: it takes no slot of it (a share of 0) until the
    re-drive divides the capacity again (:func:`allocate`)."""
    pool.capacity_id, pool.share_limit = capacity.id, 0


def take_off(session: Session, pool: Pool) -> None:
    """Unlink ``pool`` from its capacity. It stays closed to fresh arrivals
    (:func:`corral.shared.store.slots.close`: a share of the slots it holds) until the
    re-drive, which its caller asks for, has handed its free slots to the items waiting for
    it, in order, or found none waiting and opened it: an item arriving meanwhile does not
    overtake them."""
    pool.capacity_id, pool.share_limit = None, None
    session.flush()  # unlinked: close sets the share of pools on no capacity alone
    pool_slots.close(session, [pool.id])
    session.expire(pool, ["share_limit"])  # as close wrote it


def take_all_off(session: Session, capacity_id: str) -> None:
    """Unlink every pool left on ``capacity_id`` (deleted pools: a live one is taken off
    with :func:`take_off`) before the capacity goes. One UPDATE."""
    session.execute(
        update(Pool)
        .where(Pool.capacity_id == capacity_id)
        .values(capacity_id=None, share_limit=None)
        .execution_options(synchronize_session=False)
    )
