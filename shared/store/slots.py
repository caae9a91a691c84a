"""A pool's slots in use, as a counter on its row: O(1) to take, free and read.

Routing takes a slot with one guarded ``UPDATE`` (:func:`take_slots`), never a count over
the pool's work items, and holds the pool row's lock only until its transaction commits.
An item gives its slot back in the same transaction in which it leaves a slot-holding state
(:func:`corral.shared.store.lifecycle.transition` calls :func:`free_slots`). The reaper compares
every counter with the real count now and then (:func:`reconcile_slot_counts`) and corrects
any drift, so a counter can never stay wrong for long.

A pool's **share** (``share_limit``; null: none) is the most slots routing may take of it
now, below its own limit: on a capacity several orgs share, what the division gave it
(:mod:`corral.shared.store.shares`); on any other pool, set while items wait for it
(:func:`close`), so that a slot it frees goes to its waiting items in admission order, by
the re-drive (:func:`grant`, :func:`reopen`), and not to an item arriving meanwhile. Every
guarded update checks it as it is (:func:`within`); every slot given back lowers it with it.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Collection
from typing import Any

from sqlalchemy import ColumnElement, and_, case, func, null, or_, select, update
from sqlalchemy.orm import Session
from sqlalchemy.sql import Subquery

from corral.shared.store.db import Database
from corral.shared.store.models import SLOT_HOLDING_STATES, Pool, WorkItem

log = logging.getLogger(__name__)
_HOLDING = [state.value for state in SLOT_HOLDING_STATES]


def within(slots_in_use: Any, share_limit: Any, count: Any, limit: Any) -> ColumnElement[bool]:
    """A pool row's guard for taking ``count`` slots: within ``limit`` (its slot limit as
    routing read it) and within its share of a shared capacity as it is now
    (:mod:`corral.shared.store.shares`; null: none), whatever routing read of it."""
    return and_(
        slots_in_use + count <= limit,
        or_(share_limit.is_(None), slots_in_use + count <= share_limit),
    )


def take_slots(session: Session, pool_id: str, count: int, *, limit: int) -> bool:
    """Take ``count`` slots of ``pool_id`` if that keeps it within ``limit`` and its share
    (:func:`within`); whether it did."""
    taken = session.execute(
        update(Pool)
        .where(Pool.id == pool_id, within(Pool.slots_in_use, Pool.share_limit, count, limit))
        .values(slots_in_use=Pool.slots_in_use + count)
        .execution_options(synchronize_session=False)
    )
    return bool(taken.rowcount)  # type: ignore[attr-defined]  # a CursorResult


def free_slots(session: Session, freed: Counter[str]) -> None:
    """Give back ``freed[pool_id]`` slots of each pool (never below zero), and as much of
    its share of a shared capacity (the slot goes back to the capacity, for the re-drive to
    hand on in fair order): one UPDATE."""
    if not freed:
        return
    count = case(dict(freed), value=Pool.id) if len(freed) > 1 else next(iter(freed.values()))
    session.execute(
        update(Pool)
        .where(Pool.id.in_(sorted(freed)), Pool.slots_in_use > 0)
        .values(
            slots_in_use=case((Pool.slots_in_use > count, Pool.slots_in_use - count), else_=0),
            share_limit=case(
                (Pool.share_limit.is_(None), null()),
                (Pool.share_limit > count, Pool.share_limit - count),
                else_=0,
            ),
        )
        .execution_options(synchronize_session=False)
    )


def _real_counts() -> Subquery:
    return (
        select(WorkItem.pool_id, func.count().label("held"))
        .where(WorkItem.state.in_(_HOLDING), WorkItem.pool_id.is_not(None))
        .group_by(WorkItem.pool_id)
        .subquery()
    )


def reconcile_slot_counts(db: Database) -> dict[str, tuple[int, int]]:
    """Set every pool's counter that differs from its real count; ``{pool: (was, is)}``.

    One read finds the pools whose counter and count differ (both from one snapshot, so a
    difference is drift, not a routing in progress); each is then recounted and set under
    its row lock.
    """
    counts = _real_counts()
    held = func.coalesce(counts.c.held, 0)
    with db.session() as session:
        drifted = (
            session.execute(
                select(Pool.id)
                .outerjoin(counts, counts.c.pool_id == Pool.id)
                .where(Pool.slots_in_use != held)
            )
            .scalars()
            .all()
        )
    fixed = {}
    for pool_id in drifted:
        with db.session() as session:
            pool = session.get(Pool, pool_id, with_for_update={"key_share": True})
            if pool is None:
                continue
            real = (
                session.scalar(
                    select(func.count()).where(
                        WorkItem.pool_id == pool_id, WorkItem.state.in_(_HOLDING)
                    )
                )
                or 0
            )
            if pool.slots_in_use != real:
                fixed[pool_id] = (pool.slots_in_use, real)
                pool.slots_in_use = real
    if fixed:
        log.warning("pool slot counters corrected", extra={"pools": fixed})
    return fixed


def close(session: Session, pool_ids: Collection[str]) -> None:
    """Close ``pool_ids`` to fresh arrivals while items wait for them: the share of each
    pool not on a shared capacity becomes the slots it holds, so a slot it frees is not
    taken by an item routed at intake but handed on by the re-drive, to its waiting items
    in admission order (:func:`corral.scheduler.admission.next_waiting`, which opens them
    again once none waits). A pool on a shared capacity keeps the share its division gave
    (:mod:`corral.shared.store.shares`). One UPDATE."""
    open_or_above = or_(Pool.share_limit.is_(None), Pool.share_limit > Pool.slots_in_use)
    _set_own_share(session, pool_ids, open_or_above, Pool.slots_in_use)


def grant(session: Session, granted: Counter[str]) -> None:
    """Open ``granted[pool_id]`` more slots of each closed pool (not on a shared capacity),
    for the waiting items the re-drive routes now. One UPDATE."""
    if not granted:
        return
    count = case(dict(granted), value=Pool.id) if len(granted) > 1 else next(iter(granted.values()))
    _set_own_share(session, granted, Pool.share_limit.is_not(None), Pool.share_limit + count)


def reopen(session: Session, pool_ids: Collection[str]) -> None:
    """Open closed pools (not on a shared capacity) for which no item waits any more: no
    share, fresh arrivals take their free slots at intake again. One UPDATE."""
    _set_own_share(session, pool_ids, Pool.share_limit.is_not(None), null())


def _set_own_share(
    session: Session, pool_ids: Collection[str], where: ColumnElement[bool], share: Any
) -> None:
    """Set the share of those of ``pool_ids`` not on a shared capacity where ``where``."""
    if not pool_ids:
        return
    session.execute(
        update(Pool)
        .where(Pool.id.in_(sorted(pool_ids)), Pool.capacity_id.is_(None), where)
        .values(share_limit=share)
        .execution_options(synchronize_session=False)
    )
