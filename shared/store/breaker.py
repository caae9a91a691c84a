"""A circuit breaker per pool: a pool whose sandboxes never get to work stops receiving it.

``breaker_failures`` failures in a row (each within ``breaker_window_s`` of the last) open a
pool's breaker. A failure is a provision that failed (transient errors included, each try)
or a sandbox that ended before its runner claimed the work (``never_claimed``, or gone at
the provider first: :mod:`corral.worker.termination`). Routing then passes the pool by, as
if it were full: the item goes to the next qualifying pool or waits (``waiting_capacity``,
routed again by the re-drive). Once ``breaker_cooldown_s`` has passed, one item is let
through as a probe (the breaker is *half open*; :func:`take_probe` makes sure one router
alone gets it); its runner's claim closes the breaker (:func:`record_claim`; a code
interpreter's run, which has no runner, when it starts), its failure opens it again. A
probe lost on the way lets another through after ``breaker_probe_timeout_s``.

The state is in the pool's row (``breaker_*`` columns); its changes are lifecycle events of
the pool (entity ``pool``, recorded against the item that caused them) and log lines, and
the api's metrics carry ``corral_pool_breaker_open``.
"""

from __future__ import annotations

import logging
from collections.abc import Collection
from datetime import datetime, timedelta
from typing import Protocol

from sqlalchemy import and_, or_, select, update
from sqlalchemy.orm import Session

from corral.shared.settings import BreakerSettings
from corral.shared.store.db import utcnow
from corral.shared.store.models import LifecycleEvent, Pool

log = logging.getLogger(__name__)

CLOSED, OPEN, HALF_OPEN = "closed", "open", "half_open"
# What routing makes of a pool's breaker: route as usual, pass it by, or send one probe.
ROUTE, SKIP, PROBE = "route", "skip", "probe"


class BreakerRecord(Protocol):
    """What :func:`gate` reads of a pool (a :class:`Pool`, or a row of its columns)."""

    @property
    def breaker_state(self) -> str: ...
    @property
    def breaker_opened_at(self) -> datetime | None: ...
    @property
    def breaker_probe_at(self) -> datetime | None: ...


def gate(pool: BreakerRecord, settings: BreakerSettings, now: datetime | None = None) -> str:
    """Whether routing may send ``pool`` work now: :data:`ROUTE`, :data:`SKIP` or
    :data:`PROBE` (one item, claimed with :func:`take_probe`)."""
    if pool.breaker_state == CLOSED:
        return ROUTE
    now = now or utcnow()
    if pool.breaker_state == OPEN:
        opened = pool.breaker_opened_at
        cooled = opened is None or opened + timedelta(seconds=settings.breaker_cooldown_s) <= now
        return PROBE if cooled else SKIP
    probed = pool.breaker_probe_at
    lost = probed is None or probed + timedelta(seconds=settings.breaker_probe_timeout_s) <= now
    return PROBE if lost else SKIP


def take_probe(session: Session, pool_id: str, settings: BreakerSettings) -> bool:
    """Make the item being routed to ``pool_id`` its half-open probe; False: another router
    took the probe first (or the breaker moved), and the item must go elsewhere."""
    now = utcnow()
    cooled = now - timedelta(seconds=settings.breaker_cooldown_s)
    lost = now - timedelta(seconds=settings.breaker_probe_timeout_s)
    probe_due = or_(
        and_(Pool.breaker_state == OPEN, Pool.breaker_opened_at <= cooled),
        and_(
            Pool.breaker_state == HALF_OPEN,
            or_(Pool.breaker_probe_at.is_(None), Pool.breaker_probe_at <= lost),
        ),
    )
    taken = session.execute(
        update(Pool)
        .where(Pool.id == pool_id, probe_due)
        .values(breaker_state=HALF_OPEN, breaker_probe_at=now)
        .execution_options(synchronize_session=False)
    )
    return bool(taken.rowcount)  # type: ignore[attr-defined]  # a CursorResult


def record_failure(
    session: Session,
    pool_id: str,
    *,
    item_id: str,
    code: str,
    settings: BreakerSettings,
    count: int = 1,
) -> bool:
    """Count ``count`` failures of ``pool_id`` (provisions that failed, sandboxes that ended
    before their runner claimed; ``item_id``'s the last of them); whether it opened the
    breaker. One read and one write of the pool's row, however many."""
    pool = session.get(Pool, pool_id, with_for_update=True)
    if pool is None:
        return False
    now = utcnow()
    window = timedelta(seconds=settings.breaker_window_s)
    last = pool.breaker_failed_at
    counted = 0 if last is None or last + window < now else pool.breaker_failures
    pool.breaker_failures = counted + count
    pool.breaker_failed_at = now
    was = pool.breaker_state
    if was == HALF_OPEN or (was == CLOSED and pool.breaker_failures >= settings.breaker_failures):
        pool.breaker_state, pool.breaker_opened_at, pool.breaker_probe_at = OPEN, now, None
        detail = f"{pool.breaker_failures} failures in a row, the last {code}"
        _event(session, pool_id, item_id, (was, OPEN), detail)
        log.warning(
            "circuit breaker opened: routing passes the pool by",
            extra={"pool_id": pool_id, "org_id": pool.org_id, "detail": detail},
        )
        return True
    return False


def record_success(session: Session, pool_ids: Collection[str], *, item_id: str) -> None:
    """A sandbox of each pool in ``pool_ids`` got to work: their breakers close, their
    failure counts restart. Call it for pools whose breaker was not closed or had failures
    only (see :func:`dirty`): a healthy pool costs nothing here."""
    rows = session.scalars(
        select(Pool).where(Pool.id.in_(sorted(pool_ids))).with_for_update().order_by(Pool.id)
    )
    for pool in rows:
        was = pool.breaker_state
        pool.breaker_state, pool.breaker_failures = CLOSED, 0
        pool.breaker_failed_at = pool.breaker_opened_at = pool.breaker_probe_at = None
        if was != CLOSED:
            _event(session, pool.id, item_id, (was, CLOSED), "a provision succeeded")
            log.info("circuit breaker closed", extra={"pool_id": pool.id, "org_id": pool.org_id})


def record_claim(session: Session, pool_id: str, *, item_id: str) -> None:
    """A runner claimed its work in a sandbox of ``pool_id``: the pool works. Its breaker
    closes and its count restarts when they were not at rest; a pool at rest costs one read
    of its row. Made and never claimed is no success: a pool whose sandboxes boot but never
    reach the control plane keeps counting their ends."""
    counts = session.execute(
        select(Pool.breaker_state, Pool.breaker_failures).where(Pool.id == pool_id)
    ).one_or_none()
    if counts is not None and dirty(counts):
        record_success(session, [pool_id], item_id=item_id)


class BreakerCounts(Protocol):
    """What :func:`dirty` reads of a pool (a :class:`Pool`, or a claim's row of it)."""

    @property
    def breaker_state(self) -> str: ...
    @property
    def breaker_failures(self) -> int: ...


def dirty(pool: BreakerCounts) -> bool:
    """Whether a success must be recorded for ``pool`` (its breaker is not at rest)."""
    return pool.breaker_state != CLOSED or pool.breaker_failures > 0


def _event(
    session: Session, pool_id: str, item_id: str, change: tuple[str, str], detail: str
) -> None:
    was, now_state = change
    session.add(
        LifecycleEvent(
            entity="pool",
            entity_id=pool_id,
            work_item_id=item_id,
            from_state=f"breaker_{was}",
            to_state=f"breaker_{now_state}",
            actor="breaker",
            detail=detail,
            created_at=utcnow(),
        )
    )
