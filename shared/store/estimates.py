"""When a waiting item may start: its place in its queue over its pools' recent throughput.

The rule is :func:`estimate_start`, the one every surface shows (the api's item view,
``corral show``, the console's item page, all through
:func:`corral.scheduler.admin.views.load_item_view`). An item waits for the hand-ons of the
items ahead of it and then for its own, each at the rate its pools handed slots on lately:
``(ahead + 1) / rate``, its own turn costing nothing when one of its pools has a free slot
now (the next re-drive gives it). A rate is read from the last :data:`RATE_WINDOW_S`, at
most :data:`RATE_SAMPLE` of its newest events, from an index that starts with the state and
the instant, so its cost follows the window, not the history. Nothing seen in the window:
the start is unknown (None), never a guessed number. A place counted up to its cap
(:data:`~corral.shared.store.places.MAX_AHEAD`) gives a lower bound (``at_least``).

A capacity-waiting item's rate is its pools' items that ended (each freed a slot, handed
on to the next waiting one); for the org's limit, the org's pools'. A routed item its
provider's pace holds waits for creates instead: its rate is its pool's sandboxes created,
and its start is not before its ``not_before``.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any, Literal

from sqlalchemy import ColumnElement, select
from sqlalchemy.orm import InstrumentedAttribute, Session

from corral.providers.base import SandboxState
from corral.shared.store import places
from corral.shared.store.db import utcnow
from corral.shared.store.models import ItemState, Pool, Sandbox, WorkItem
from corral.shared.store.pools import waiting_room

RATE_WINDOW_S = 600.0  # throughput is what happened in the last ten minutes
RATE_SAMPLE = 500  # ... read as at most this many of the newest events (per state)
MIN_SPAN_S = 60.0  # a busy pool's sample spans at least this long (a batch shares its instant)
# An item that ended here gave its slot back (a dispatch error never held one).
_ENDED = (ItemState.SUCCEEDED.value, ItemState.FAILED.value, ItemState.CANCELLED.value)
_MADE = tuple(state.value for state in SandboxState)  # a sandbox row is its create's

Bound = Literal["about", "at_least"]


@dataclass(frozen=True)
class Throughput:
    """How many hand-ons were seen over how many seconds."""

    count: int
    span_s: float


@dataclass(frozen=True)
class StartEstimate:
    """When a waiting item may start, and whether that is about then or at the earliest."""

    wait_s: float
    start_at: datetime
    bound: Bound


def estimate_start(
    ahead: int,
    throughput: Throughput,
    *,
    free_now: bool,
    now: datetime,
    not_before: datetime | None = None,
) -> StartEstimate | None:
    """The start of an item with ``ahead`` before it, at ``throughput``'s rate; None when
    nothing was handed on lately. ``free_now``: a slot is free for it now, so its own turn
    costs no wait. ``not_before``: it does not start before then."""
    if throughput.count == 0:
        return None
    turns = ahead if free_now else ahead + 1
    wait_s = turns * throughput.span_s / throughput.count
    if not_before is not None:
        wait_s = max(wait_s, (not_before - now).total_seconds())
    return StartEstimate(
        wait_s=wait_s,
        start_at=now + timedelta(seconds=wait_s),
        bound="at_least" if ahead >= places.MAX_AHEAD else "about",
    )


def waiting_estimate(
    session: Session, item: WorkItem, ahead: int, *, now: datetime | None = None
) -> StartEstimate | None:
    """The start of ``item``, waiting for capacity with ``ahead`` before it."""
    now = now or utcnow()
    pools = list(
        session.scalars(
            select(Pool).where(Pool.id.in_(item.wait_pools))
            if item.wait_pools
            else select(Pool).where(Pool.org_id == item.org_id, Pool.deleted_at.is_(None))
        )
    )
    free_now = item.wait_reason == "pool_full" and any(
        pool.active and waiting_room(pool) > 0 for pool in pools
    )
    ended = _recent(
        session,
        WorkItem.state,
        WorkItem.updated_at,  # stamped by the move that ended it (lifecycle.py)
        _ENDED,
        WorkItem.pool_id.in_([pool.id for pool in pools]),
        now=now,
    )
    return estimate_start(ahead, ended, free_now=free_now, now=now)


def paced_estimate(
    session: Session, item: WorkItem, ahead: int, *, now: datetime | None = None
) -> StartEstimate | None:
    """The create of ``item``, routed and held by its provider's pace with ``ahead`` of its
    pool's paced items before it."""
    now = now or utcnow()
    made = _recent(
        session, Sandbox.status, Sandbox.created_at, _MADE, Sandbox.pool_id == item.pool_id, now=now
    )
    return estimate_start(ahead, made, free_now=False, now=now, not_before=item.not_before)


def _recent(
    session: Session,
    state: InstrumentedAttribute[str],
    at: InstrumentedAttribute[datetime],
    states: Collection[str],
    where: ColumnElement[bool],
    *,
    now: datetime,
) -> Throughput:
    """The rows meeting ``where`` that entered one of ``states`` (``at``) in the window: a
    range of a ``(state, at)`` index per state, newest first, at most :data:`RATE_SAMPLE`."""
    since = now - timedelta(seconds=RATE_WINDOW_S)
    seen: list[datetime] = []
    for one in states:
        query = (
            select(at)
            .where(state == one, at >= since, where)
            .order_by(at.desc())
            .limit(RATE_SAMPLE)
        )
        seen += session.scalars(query)
    if len(seen) < RATE_SAMPLE:
        return Throughput(len(seen), RATE_WINDOW_S)
    oldest = sorted(seen, reverse=True)[RATE_SAMPLE - 1]
    return Throughput(RATE_SAMPLE, max((now - oldest).total_seconds(), MIN_SPAN_S))


def estimate_fields(estimate: StartEstimate | None) -> dict[str, Any]:
    """A waiting view's estimate: its start, its wait and its bound (all None: unknown)."""
    if estimate is None:
        return {"estimated_start_at": None, "estimated_wait_s": None, "estimate": None}
    return {
        "estimated_start_at": estimate.start_at.isoformat(),
        "estimated_wait_s": round(estimate.wait_s, 1),
        "estimate": estimate.bound,
    }


def said(waiting: Mapping[str, Any]) -> str:
    """A waiting view's estimate in words (``corral show``, the console's item page)."""
    if waiting.get("estimate") is None:
        return f"unknown: nothing handed on in the last {RATE_WINDOW_S / 60:g} min"
    bound = "at least" if waiting["estimate"] == "at_least" else "about"
    at = waiting["estimated_start_at"][:19].replace("T", " ")
    return f"in {bound} {_span(waiting['estimated_wait_s'])} ({at} UTC)"


def _span(seconds: float) -> str:
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 90 * 60:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"
