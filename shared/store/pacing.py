"""The pace of a provider credential's creates, shared by every worker process.

One definition of the bucket: :func:`admit`, :func:`settle` and :func:`refused` take a
:class:`PaceState` and return the next one. The rate is a GCRA (the generic cell rate
algorithm, a token bucket kept as one instant): ``tat`` is when the next create conforms
to the rate, and a create may go ``burst - 1`` intervals before it. A create that may not
go yet is not refused but given the slot it may go in (:class:`Wait`), kept among the
pace's reservations: the caller waits until then and goes without taking another, so a
backlog costs one bucket update per create, not one per look. Callers back late together
(their process stalled, their timers late) go half an interval apart, not at once: they
catch up at twice the rate, which a vendor's bucket of a second's creates absorbs. Slots
are reserved at most :data:`RESERVE_AHEAD_S` ahead (:data:`SLOWED_RESERVE_AHEAD_S` while
the rate is slowed, so that the backlog is not tied to a slowed rate once it recovers); a
create further back is told when to ask again, spread over half that span. The cap on
creates in flight counts the holders between :func:`admit` and :func:`settle`, each under a
lease, so a worker that dies mid-create frees its place once its lease ends.

A rate-limit answer (:func:`refused`) halves the rate (at most once per
:data:`SLOW_GAP_S` or interval, so one burst of refusals counts once), down to
:data:`FLOOR_SHARE` of the configured rate, leaves no burst credit, and reserves the
refused create the next slot; each create that succeeds afterwards gives back
:data:`RECOVERY_SHARE` of the configured rate until the rate is whole again (additive
increase, multiplicative decrease).

The state lives in the database (``provider_paces``, one row per key), which every
deployment has whatever its broker: :func:`apply` reads the row under its lock (``SELECT
... FOR UPDATE`` on PostgreSQL, the write lock SQLite's every transaction takes), computes
the next state here and writes it in the caller's transaction.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import TypeVar, cast

from sqlalchemy import Table
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.orm import Session

from corral.providers.pacing import PaceLimits
from corral.shared.store.db import utcnow
from corral.shared.store.models import ItemState, ProviderPaceRow, WorkItem
from corral.shared.store.places import items_ahead

# What holds a routed item its pace keeps waiting (its ``wait_reason``; its ``not_before``
# when it asks again): the rate, or the cap on creates in flight.
PACED, IN_FLIGHT = "provider_pace", "provider_in_flight"
PACE_REASONS = (PACED, IN_FLIGHT)
HELD_STATES = (ItemState.ROUTED.value, ItemState.PROVISIONING.value)  # its slot held
BACKOFF = 0.5  # a refusal multiplies the rate by this
FLOOR_SHARE = 0.05  # ... but not below this share of the configured rate
RECOVERY_SHARE = 0.1  # a create that succeeds adds this share of the configured rate back
SLOW_GAP_S = 1.0  # refusals closer than this (or an interval) to the last slowdown: one
NO_RATE_WAIT_S = 1.0  # a refusal without a configured rate: the create waits this long
IN_FLIGHT_RECHECK_S = 1.0  # a create waiting for room among those in flight looks again then
RESERVE_AHEAD_S = 10.0  # slots are reserved at most this far ahead
SLOWED_RESERVE_AHEAD_S = 2.0  # ... while the rate is slowed
EARLY_S = 0.01  # a holder back this close before its slot goes
CATCH_UP_INTERVALS = 0.5  # holders back late go at least this many intervals apart
RESERVATION_GRACE_S = 60.0  # a reservation nobody came back for is dropped this long after

_ROUNDING_S = 1e-6  # a slot this close to now is now (sums of intervals do not add up exactly)
T = TypeVar("T")
_TABLE = cast(Table, ProviderPaceRow.__table__)


@dataclass(frozen=True)
class PaceState:
    """One key's pace: when its next create conforms (epoch seconds), its slowed rate and
    when it was slowed, when its last create went, its creates in flight (holder: when its
    lease ends) and its reserved slots (holder: when it may go)."""

    tat: float = 0.0
    rate: float | None = None  # None: the configured rate
    slowed_at: float | None = None
    last_go: float | None = None  # when the last create went
    in_flight: Mapping[str, float] = field(default_factory=dict)
    reserved: Mapping[str, float] = field(default_factory=dict)

    def current_rate(self, limits: PaceLimits) -> float | None:
        """The rate creates go at now: the configured one, or less while slowed."""
        if limits.creates_per_s is None:
            return None
        return limits.creates_per_s if self.rate is None else min(self.rate, limits.creates_per_s)

    def tidied(self, now: float) -> PaceState:
        """Without the creates in flight whose lease has ended and the reservations nobody
        came back for."""
        live = {holder: until for holder, until in self.in_flight.items() if until > now}
        kept = now - RESERVATION_GRACE_S
        reserved = {holder: slot for holder, slot in self.reserved.items() if slot > kept}
        return replace(self, in_flight=live, reserved=reserved)


@dataclass(frozen=True)
class Go:
    """The create may go now; its holder is in flight until :func:`settle`."""


GO = Go()


@dataclass(frozen=True)
class Wait:
    """The create may not go now: ask again at ``until`` (epoch seconds). ``reason``:
    ``rate`` (its slot, when reserved, or when to ask for one) or ``in_flight`` (the creates
    in flight are at their cap)."""

    until: float
    reason: str


def admit(
    state: PaceState, limits: PaceLimits, holder: str, *, now: float, lease_s: float
) -> tuple[PaceState, Go | Wait]:
    """Whether ``holder``'s create may go now: at its reserved slot, or at the rate's next
    one, and with room among the creates in flight."""
    state = state.tidied(now)
    live, reserved = dict(state.in_flight), dict(state.reserved)
    slot = reserved.get(holder)
    if slot is not None and slot > now + EARLY_S:
        return state, Wait(slot, "rate")  # back before its slot
    if limits.in_flight is not None and holder not in live and len(live) >= limits.in_flight:
        return state, Wait(now + IN_FLIGHT_RECHECK_S, "in_flight")  # a reservation is kept
    tat, rate = state.tat, state.current_rate(limits)
    if slot is not None:
        caught_up = _caught_up(state, rate)
        if caught_up > now + _ROUNDING_S:  # back late, beside another create back late
            reserved[holder] = caught_up
            return replace(state, reserved=reserved), Wait(caught_up, "rate")
        del reserved[holder]
    elif rate is not None:
        interval = 1.0 / rate
        start = max(tat, now)
        go_at = start - (limits.burst - 1) * interval
        if go_at > now + _ROUNDING_S:
            ahead = RESERVE_AHEAD_S if state.rate is None else SLOWED_RESERVE_AHEAD_S
            if go_at - now > ahead:  # too far back to reserve: ask again as it draws near
                return state, Wait(go_at - ahead + ahead / 2 * _spread(holder), "rate")
            reserved[holder] = go_at
            return replace(state, tat=start + interval, reserved=reserved), Wait(go_at, "rate")
        tat = start + interval
    if limits.in_flight is not None:
        live[holder] = now + lease_s
    return replace(state, tat=tat, last_go=now, in_flight=live, reserved=reserved), GO


def _caught_up(state: PaceState, rate: float | None) -> float:
    """The earliest a create with a reserved slot may go: :data:`CATCH_UP_INTERVALS` after
    the last create that went. Slots are an interval apart, so this holds back only creates
    back after their slot (their worker stalled): they catch up at twice the rate."""
    if rate is None or state.last_go is None:
        return 0.0
    return state.last_go + CATCH_UP_INTERVALS / rate


def _spread(holder: str) -> float:
    """A fraction in [0, 1) of its own for each holder: when those too far back to reserve
    ask again, spread instead of all at once."""
    digest = hashlib.sha256(holder.encode("utf-8", "surrogatepass")).digest()
    return int.from_bytes(digest[:4], "big") / 2**32


def settle(
    state: PaceState, limits: PaceLimits, holder: str, *, succeeded: bool, now: float
) -> PaceState:
    """``holder``'s create is over: it leaves those in flight, and a success brings a slowed
    rate back by :data:`RECOVERY_SHARE` of the configured one."""
    state = state.tidied(now)
    live = dict(state.in_flight)
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
    the instant (epoch seconds) it may go again, reserved for it."""
    state = state.tidied(now)
    live = dict(state.in_flight)
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
    return replace(after, in_flight=live, reserved={**state.reserved, holder: until}), until


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
    before = PaceState(
        row.tat,
        row.rate,
        row.slowed_at,
        row.last_go,
        dict(row.in_flight or {}),
        dict(row.reserved or {}),
    )
    after, answer = change(before)
    if after != before:
        row.tat, row.rate, row.slowed_at = after.tat, after.rate, after.slowed_at
        row.last_go = after.last_go
        row.in_flight, row.reserved = dict(after.in_flight), dict(after.reserved)
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
        "reserved": {},
        "updated_at": utcnow(),
    }
    session.execute(dialect.insert(_TABLE).values(values).on_conflict_do_nothing())


def paced_ahead(session: Session, item: WorkItem) -> int:
    """How many of ``item``'s pool's items its provider's pace holds go before it (their
    ``not_before`` earlier; at most :data:`MAX_AHEAD`): its pool's held items, read by the
    ``(pool_id, state)`` index."""
    if item.not_before is None or item.pool_id is None:
        return 0
    return items_ahead(
        session,
        WorkItem.pool_id == item.pool_id,
        WorkItem.state.in_(HELD_STATES),
        WorkItem.wait_reason.in_(PACE_REASONS),
        WorkItem.not_before < item.not_before,
    )
