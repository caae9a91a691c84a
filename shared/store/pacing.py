"""The pace of a provider credential's creates, shared by every worker process.

One definition of the bucket: :func:`admit`, :func:`settle` and :func:`refused` take a
:class:`PaceState` and return the next one. The rate is a GCRA (the generic cell rate
algorithm, a token bucket kept as one instant): ``tat`` is when the next create conforms
to the rate, and a create may go ``burst - 1`` intervals before it. A create that may not
go yet is not refused but given the slot it may go in (:class:`Wait` with ``reserved``):
the caller waits until then and goes without asking for a slot again, so a backlog costs
one bucket update per create, not one per look. The cap on creates in flight counts the
holders between :func:`admit` and :func:`settle`, each under a lease, so a worker that dies
mid-create frees its place once its lease ends.

A rate-limit answer (:func:`refused`) halves the rate (at most once per
:data:`SLOW_GAP_S` or interval, so one burst of refusals counts once), down to
:data:`FLOOR_SHARE` of the configured rate, leaves no burst credit, and gives the refused
create the next slot; each create that succeeds afterwards gives back
:data:`RECOVERY_SHARE` of the configured rate until the rate is whole again (additive
increase, multiplicative decrease).

The state lives in the database (``provider_paces``, one row per key), which every
deployment has whatever its broker: :func:`apply` reads the row under its lock (``SELECT
... FOR UPDATE`` on PostgreSQL, the write lock SQLite's every transaction takes), computes
the next state here and writes it in the caller's transaction.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import TypeVar, cast

from sqlalchemy import Table, func, select
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.orm import Session

from corral.providers.pacing import PaceLimits
from corral.shared.store.db import utcnow
from corral.shared.store.models import ItemState, ProviderPaceRow, WorkItem

# What holds a routed item its pace keeps waiting (its ``wait_reason``): a slot of the rate
# reserved for it at its ``not_before``, or the cap on creates in flight.
PACED, IN_FLIGHT = "provider_pace", "provider_in_flight"
PACE_REASONS = (PACED, IN_FLIGHT)
HELD_STATES = (ItemState.ROUTED.value, ItemState.PROVISIONING.value)  # its slot held
MAX_AHEAD = 10_000  # a place further back is said as "at least this many ahead"
BACKOFF = 0.5  # a refusal multiplies the rate by this
FLOOR_SHARE = 0.05  # ... but not below this share of the configured rate
RECOVERY_SHARE = 0.05  # a create that succeeds adds this share of the configured rate back
SLOW_GAP_S = 1.0  # refusals closer than this (or an interval) to the last slowdown: one
NO_RATE_WAIT_S = 1.0  # a refusal without a configured rate: the create waits this long
IN_FLIGHT_RECHECK_S = 1.0  # a create waiting for room among those in flight looks again then

_ROUNDING_S = 1e-6  # a slot this close to now is now (sums of intervals do not add up exactly)
T = TypeVar("T")
_TABLE = cast(Table, ProviderPaceRow.__table__)


@dataclass(frozen=True)
class PaceState:
    """One key's pace: when its next create conforms (epoch seconds), its slowed rate and
    when it was slowed, and its creates in flight (holder: when its lease ends)."""

    tat: float = 0.0
    rate: float | None = None  # None: the configured rate
    slowed_at: float | None = None
    in_flight: Mapping[str, float] = field(default_factory=dict)

    def current_rate(self, limits: PaceLimits) -> float | None:
        """The rate creates go at now: the configured one, or less while slowed."""
        if limits.creates_per_s is None:
            return None
        return limits.creates_per_s if self.rate is None else min(self.rate, limits.creates_per_s)

    def live(self, now: float) -> dict[str, float]:
        """The creates in flight whose lease has not ended."""
        return {holder: until for holder, until in self.in_flight.items() if until > now}


@dataclass(frozen=True)
class Go:
    """The create may go now; its holder is in flight until :func:`settle`."""


GO = Go()


@dataclass(frozen=True)
class Wait:
    """The create may not go now: look again at ``until`` (epoch seconds). ``reserved``: a
    slot of the rate is the holder's at ``until``, so it then goes without taking another;
    else (``reason`` ``in_flight``) it waits for room among the creates in flight."""

    until: float
    reserved: bool
    reason: str  # "rate" or "in_flight"


def admit(
    state: PaceState,
    limits: PaceLimits,
    holder: str,
    *,
    reserved: bool,
    now: float,
    lease_s: float,
) -> tuple[PaceState, Go | Wait]:
    """Whether ``holder``'s create may go now; ``reserved``: its slot of the rate is already
    taken (an earlier :class:`Wait` gave it one), so only the cap in flight applies."""
    live = state.live(now)
    if limits.in_flight is not None and holder not in live and len(live) >= limits.in_flight:
        return replace(state, in_flight=live), Wait(
            now + IN_FLIGHT_RECHECK_S, reserved, "in_flight"
        )
    tat = state.tat
    rate = state.current_rate(limits)
    if rate is not None and not reserved:
        interval = 1.0 / rate
        start = max(tat, now)
        go_at = start - (limits.burst - 1) * interval
        tat = start + interval
        if go_at > now + _ROUNDING_S:
            return replace(state, tat=tat, in_flight=live), Wait(go_at, True, "rate")
    if limits.in_flight is not None:
        live[holder] = now + lease_s
    return replace(state, tat=tat, in_flight=live), GO


def settle(
    state: PaceState, limits: PaceLimits, holder: str, *, succeeded: bool, now: float
) -> PaceState:
    """``holder``'s create is over: it leaves those in flight, and a success brings a slowed
    rate back by :data:`RECOVERY_SHARE` of the configured one."""
    live = state.live(now)
    live.pop(holder, None)
    rate, configured = state.rate, limits.creates_per_s
    if succeeded and rate is not None and configured is not None:
        rate += configured * RECOVERY_SHARE
        if rate >= configured:
            rate = None
    return replace(state, in_flight=live, rate=rate)


def refused(
    state: PaceState,
    limits: PaceLimits,
    holder: str,
    *,
    now: float,
    retry_after_s: float | None = None,
) -> tuple[PaceState, float]:
    """The provider refused ``holder``'s create for its rate or quota: the rate slows
    (multiplicative decrease), no burst credit is left, and the create gets the next slot;
    the instant (epoch seconds) it may go again."""
    live = state.live(now)
    live.pop(holder, None)
    base = now + (retry_after_s or 0.0)
    rate = state.current_rate(limits)
    if rate is None or limits.creates_per_s is None:
        until = base if retry_after_s else now + NO_RATE_WAIT_S
        return replace(state, in_flight=live), until
    slowed_at = state.slowed_at
    if slowed_at is None or now - slowed_at >= max(SLOW_GAP_S, 1.0 / rate):
        rate = max(limits.creates_per_s * FLOOR_SHARE, rate * BACKOFF)
        slowed_at = now
    interval = 1.0 / rate
    tolerance = (limits.burst - 1) * interval
    tat = max(state.tat, base + tolerance)  # no burst credit left after a refusal
    until = max(tat - tolerance, now)
    after = replace(state, tat=max(tat, now) + interval, rate=rate, slowed_at=slowed_at)
    return replace(after, in_flight=live), until


# -- the database's row -----------------------------------------------------------------------


def apply(
    session: Session,
    key: str,
    provider_id: str,
    change: Callable[[PaceState], tuple[PaceState, T]],
) -> T:
    """Apply ``change`` to ``key``'s pace under its row's lock, in ``session``'s transaction
    (made on first use); what ``change`` answered beside the new state."""
    row = session.get(ProviderPaceRow, key, with_for_update=True)
    if row is None:
        _insert_missing(session, key, provider_id)
        row = session.get(ProviderPaceRow, key, with_for_update=True, populate_existing=True)
        assert row is not None
    before = PaceState(row.tat, row.rate, row.slowed_at, dict(row.in_flight or {}))
    after, answer = change(before)
    if after != before:
        row.tat, row.rate, row.slowed_at = after.tat, after.rate, after.slowed_at
        row.in_flight = dict(after.in_flight)
        row.updated_at = utcnow()
    return answer


def _insert_missing(session: Session, key: str, provider_id: str) -> None:
    """The key's row, made at rest unless another transaction made it first."""
    dialect = postgresql if session.get_bind().dialect.name == "postgresql" else sqlite
    values = {
        "key": key,
        "provider_id": provider_id,
        "tat": 0.0,
        "in_flight": {},
        "updated_at": utcnow(),
    }
    session.execute(dialect.insert(_TABLE).values(values).on_conflict_do_nothing())


def paced_ahead(session: Session, item: WorkItem) -> int:
    """How many of ``item``'s pool's items its provider's pace holds go before it (their
    ``not_before`` earlier; at most :data:`MAX_AHEAD`): its pool's held items, read by the
    ``(pool_id, state)`` index."""
    if item.not_before is None or item.pool_id is None:
        return 0
    before = (
        select(WorkItem.id)
        .where(
            WorkItem.pool_id == item.pool_id,
            WorkItem.state.in_(HELD_STATES),
            WorkItem.wait_reason.in_(PACE_REASONS),
            WorkItem.not_before < item.not_before,
        )
        .limit(MAX_AHEAD)
        .subquery()
    )
    return int(session.scalar(select(func.count()).select_from(before)) or 0)
