"""The cost ledger: exactly one cost event per sandbox, and reports over them.

The transaction that writes a sandbox's cost event also writes what its end owes (the
outcome outbox's ``sandbox.ended`` webhook events: :func:`write_billed`), so each sandbox's
end is told once, with its reason, duration and cost (:func:`sandbox_end_record`).

Where sandboxes end and why: docs/architecture.md §6.

A sandbox that ends gets ``cost_due_at`` in the same transaction (see
:mod:`corral.shared.store.lifecycle`). :func:`record_costs` writes the events of a batch of
sandboxes and
clears their marks in one transaction, under their row locks; the unique key on
``cost_events.sandbox_id`` is the last word if two writers ever meet. What could not be
written stays due and is written by the next sweep (:func:`record_due_costs`), whose query
reads only the due rows (a partial index), so its cost grows with what is owed.

Amounts are integers in micro-units (millionths of the rate card's currency unit):

- ``wall-clock``: seconds x ``rate_micros`` (per second);
- ``fixed``: ``rate_micros`` per session that started;
- ``active-cpu``: CPU seconds x ``rate_micros`` where the provider reported them, else
  wall-clock seconds with ``cpu_estimated`` set.
"""

from __future__ import annotations

import enum
import logging
import re
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

from sqlalchemy import and_, func, literal, or_, select, update
from sqlalchemy.orm import Session

from corral.providers.registry import default_registry
from corral.shared import metrics
from corral.shared.store.db import Database, insert_rows, utcnow
from corral.shared.store.kinds import CostGrouping
from corral.shared.store.models import CostEvent, Pool, Sandbox, WarmSandbox, WorkItem
from corral.shared.store.outbox import Billed, write_billed

__all__ = ["CostGrouping"]  # re-exported (with what is defined here): defined without SQLAlchemy

log = logging.getLogger(__name__)

MICROS_PER_SECOND = 1_000_000


class BillingModel(enum.StrEnum):
    WALL_CLOCK = "wall-clock"
    FIXED = "fixed"
    ACTIVE_CPU = "active-cpu"


@dataclass(frozen=True)
class Price:
    amount_micros: int
    cpu_estimated: bool = False


def price(
    model: BillingModel, rate_micros: int, *, elapsed: timedelta, cpu_seconds: float | None
) -> Price:
    """What a session costs. Integer arithmetic on microseconds, rounded half up."""
    if model is BillingModel.FIXED:
        return Price(rate_micros)
    if model is BillingModel.ACTIVE_CPU and cpu_seconds is not None:
        cpu_us = round(cpu_seconds * MICROS_PER_SECOND)
        return Price(_per_second(cpu_us, rate_micros))
    elapsed_us = elapsed // timedelta(microseconds=1)
    return Price(
        _per_second(elapsed_us, rate_micros), cpu_estimated=model is BillingModel.ACTIVE_CPU
    )


def _per_second(microseconds: int, rate_micros: int) -> int:
    return (max(microseconds, 0) * rate_micros + MICROS_PER_SECOND // 2) // MICROS_PER_SECOND


def billing_model_of(pool: Pool) -> BillingModel:
    """The pool's billing model: its own, else its capability override, else its provider's."""
    return _billing_model(pool.billing_model, pool.capabilities, pool.provider_id)


def _billing_model(
    own: str | None, capabilities: Mapping[str, Any] | None, provider_id: str
) -> BillingModel:
    chosen = own or (capabilities or {}).get("billing_model")
    return BillingModel(chosen or default_registry.capabilities_of(provider_id).billing_model)


def record_cost(db: Database, sandbox_id: str) -> CostEvent | None:
    """:func:`record_costs` for one sandbox: the event written, or None when nothing was
    owed."""
    written = record_costs(db, [sandbox_id])
    return written[0] if written else None


def record_costs(db: Database, sandbox_ids: Collection[str]) -> list[CostEvent]:
    """Write the cost events owed for ``sandbox_ids`` in one transaction of its own
    (:func:`write_costs`). Idempotent.

    Returns the events written (not those of sandboxes not ended, or billed already).
    """
    if not sandbox_ids:
        return []
    with db.session() as session:
        rows = write_costs(session, sandbox_ids)
    return observe_costs(rows)


# What a cost event is made of: columns, not ORM objects (the ends that write events have
# loaded some of these rows' columns already, and a batch's objects cost more than its rows).
_DUE = (
    select(
        Sandbox.id,
        Sandbox.work_item_id,
        Sandbox.org_id,
        Sandbox.provider_id,
        Sandbox.attempt,
        Sandbox.started_at,
        Sandbox.terminated_at,
        Sandbox.cpu_seconds,
        Sandbox.termination_reason,
        Pool.id.label("pool_id"),
        Pool.provider_id.label("pool_provider_id"),
        Pool.billing_model,
        Pool.capabilities,
        Pool.rate_micros,
        WorkItem.project_id,
    )
    .join(Pool, Pool.id == Sandbox.pool_id)
    .join(WorkItem, WorkItem.id == Sandbox.work_item_id)
    .where(Sandbox.cost_due_at.is_not(None), Sandbox.terminated_at.is_not(None))
    .order_by(Sandbox.id)
    .with_for_update(of=Sandbox)
)


def write_costs(session: Session, sandbox_ids: Collection[str]) -> list[dict[str, Any]]:
    """Write the cost events owed for ``sandbox_ids`` in the caller's transaction, in a few
    statements: lock those still due (in id order), skip any already billed, insert the
    others' events in one INSERT and clear every mark. The rows written: the caller hands
    them to :func:`observe_costs` once its transaction has committed."""
    if not sandbox_ids:
        return []
    connection = session.connection()  # Core reads: the ORM's row machinery costs more
    due = connection.execute(_DUE.where(Sandbox.id.in_(sandbox_ids))).all()
    if not due:
        return []
    owed = [row.id for row in due]
    # Billed, yet still marked: another writer got there first (the row lock makes this
    # rare, the unique key makes it harmless). Only the mark is left to clear.
    billed = set(
        connection.scalars(select(CostEvent.sandbox_id).where(CostEvent.sandbox_id.in_(owed)))
    )
    rows = [_event_for(row) for row in due if row.id not in billed]
    insert_rows(session, CostEvent, rows)
    attempts = {row.id: row.attempt for row in due}
    write_billed(session, [_billed(row, attempts[row["sandbox_id"]]) for row in rows])
    session.execute(
        update(Sandbox)
        .where(Sandbox.id.in_(owed))
        .values(cost_due_at=None)
        .execution_options(synchronize_session=False)
    )
    return rows


def write_costs_quietly(session: Session, sandbox_ids: Collection[str]) -> list[dict[str, Any]]:
    """:func:`write_costs` in a savepoint of the caller's transaction, for termination
    paths: a failure is logged and undone, never raised, and those sandboxes stay due (the
    next sweep writes their events); the rest of the transaction stands."""
    try:
        with session.begin_nested():
            return write_costs(session, sandbox_ids)
    except Exception:
        _log_unwritten(sandbox_ids)
        return []


def observe_costs(rows: Collection[Mapping[str, Any]]) -> list[CostEvent]:
    """The events of ``rows`` (written and committed), counted in the metrics."""
    events = [CostEvent(**row) for row in rows]
    for event in events:
        metrics.record_cost_event(event)
    return events


def _event_for(due: Any) -> dict[str, Any]:
    """The columns of a due sandbox's cost event, from its :data:`_DUE` row."""
    assert due.terminated_at is not None
    ended = due.terminated_at
    started = due.started_at or ended  # never started: zero seconds, nothing billed
    model = _billing_model(due.billing_model, due.capabilities, due.pool_provider_id)
    if due.started_at is None:
        cost = Price(0)
    else:
        cost = price(model, due.rate_micros, elapsed=ended - started, cpu_seconds=due.cpu_seconds)
    return {
        "sandbox_id": due.id,
        "work_item_id": due.work_item_id,
        "org_id": due.org_id,
        "project_id": due.project_id,
        "pool_id": due.pool_id,
        "provider_id": due.provider_id,
        "started_at": started,
        "ended_at": ended,
        "seconds": (ended - started).total_seconds(),
        "billing_model": model.value,
        "rate_micros": due.rate_micros,
        "cpu_seconds": due.cpu_seconds,
        "cpu_estimated": cost.cpu_estimated,
        "termination_reason": due.termination_reason,
        "amount_micros": cost.amount_micros,
        "created_at": utcnow(),
    }


def _billed(event: dict[str, Any], attempt: int) -> Billed:
    return Billed(
        sandbox_id=event["sandbox_id"],
        item_id=event["work_item_id"],
        org_id=event["org_id"],
        at=event["ended_at"],
        data=sandbox_end_record(event, attempt),
    )


def sandbox_end_record(event: Mapping[str, Any], attempt: int) -> dict[str, Any]:
    """A sandbox's end as its ``sandbox.ended`` webhook event tells it, from the columns of
    its cost event: why it ended, how long it ran, what it cost."""
    amount = int(event["amount_micros"])
    return {
        "sandbox_id": event["sandbox_id"],
        "work_item_id": event["work_item_id"],
        "attempt": attempt,
        "org": event["org_id"],
        "project": event["project_id"],
        "pool_id": event["pool_id"],
        "provider": event["provider_id"],
        "reason": event["termination_reason"],
        "started_at": event["started_at"].isoformat(),
        "ended_at": event["ended_at"].isoformat(),
        "duration_s": round(float(event["seconds"]), 3),
        "cost": {
            "amount_micros": amount,
            "amount": format_micros(amount),
            "billing_model": event["billing_model"],
            "rate_micros": event["rate_micros"],
            "cpu_seconds": event["cpu_seconds"],
            "cpu_estimated": event["cpu_estimated"],
        },
    }


def record_cost_quietly(db: Database, sandbox_id: str) -> CostEvent | None:
    """:func:`record_cost`, for termination paths: a failure is logged, never raised.

    The sandbox stays due, so the next sweep writes its event.
    """
    written, _ = _record_logged(db, [sandbox_id])
    return written[0] if written else None


def record_costs_quietly(db: Database, sandbox_ids: Collection[str]) -> list[CostEvent]:
    """:func:`record_costs`, for termination paths: a failure is logged, never raised.

    Those sandboxes stay due, so the next sweep writes their events.
    """
    return _record_logged(db, sandbox_ids)[0]


def _record_logged(db: Database, sandbox_ids: Collection[str]) -> tuple[list[CostEvent], bool]:
    """The events written, and whether writing them failed (then it is logged)."""
    try:
        return record_costs(db, sandbox_ids), False
    except Exception:
        _log_unwritten(sandbox_ids)
        return [], True


def _log_unwritten(sandbox_ids: Collection[str]) -> None:
    log.warning(
        "cost event not written; the next sweep retries it",
        extra={"sandbox_ids": sorted(sandbox_ids)[:10], "sandboxes": len(sandbox_ids)},
        exc_info=True,
    )


@dataclass(frozen=True)
class DueCosts:
    written: list[CostEvent]
    failed: int


def record_due_costs(db: Database, *, limit: int) -> DueCosts:
    """Write the events still owed, oldest first, at most ``limit``; count what failed."""
    with db.session() as session:
        due = list(
            session.scalars(
                select(Sandbox.id)
                .where(Sandbox.cost_due_at.is_not(None))
                .order_by(Sandbox.cost_due_at)
                .limit(limit)
            )
        )
    written, failed = _record_logged(db, due)
    if not failed or len(due) == 1:
        return DueCosts(written, int(failed))
    # One at a time, so that a sandbox whose event cannot be written holds up no other.
    each = [_record_logged(db, [sandbox_id]) for sandbox_id in due]
    return DueCosts(
        [event for events, _ in each for event in events], sum(failure for _, failure in each)
    )


_GROUP_COLUMNS = {
    CostGrouping.POOL: CostEvent.pool_id,
    CostGrouping.PROVIDER: CostEvent.provider_id,
    CostGrouping.PROJECT: CostEvent.project_id,
    CostGrouping.ORG: CostEvent.org_id,
}


@dataclass(frozen=True)
class CostRow:
    key: str
    events: int
    seconds: float
    amount_micros: int
    cpu_estimated_events: int


def cost_report(
    db: Database,
    *,
    by: CostGrouping = CostGrouping.PROVIDER,
    org_id: str | None = None,
    since: datetime | None = None,
) -> list[CostRow]:
    """Cost totals grouped ``by`` one attribution, for one org and/or since a time."""
    column = _GROUP_COLUMNS[by]
    query = (
        select(
            column,
            func.count(),
            func.coalesce(func.sum(CostEvent.seconds), 0.0),
            func.coalesce(func.sum(CostEvent.amount_micros), 0),
            func.count().filter(CostEvent.cpu_estimated.is_(True)),
        )
        .group_by(column)
        .order_by(column)
    )
    if org_id is not None:
        query = query.where(CostEvent.org_id == org_id)
    if since is not None:
        query = query.where(CostEvent.ended_at >= since)
    with db.session() as session:
        rows: list[tuple[Any, ...]] = [tuple(row) for row in session.execute(query)]
        rows += [(*row, 0) for row in session.execute(warm_idle(by, org_id, since))]
    totals: dict[str, CostRow] = {}
    for key, events, seconds, amount, estimated in rows:
        was = totals.get(key, CostRow(key, 0, 0.0, 0, 0))
        totals[key] = CostRow(
            key=key,
            events=was.events + events,
            seconds=was.seconds + float(seconds),
            amount_micros=was.amount_micros + int(amount),
            cpu_estimated_events=was.cpu_estimated_events + estimated,
        )
    return [totals[key] for key in sorted(totals)]


WARM_PROJECT = "(warm)"  # the project a warm sandbox's idle time is reported under


def warm_idle_since(since: datetime) -> Any:
    """Warm sandboxes whose billed idle time ended at ``since`` or later: bound since, or
    ended unbound since. Written as two ranges (not ``coalesce(bound_at, ended_at)``) so
    that each reads its own index (migration 0020): the rows of the period, not every warm
    sandbox the org ever had."""
    return or_(
        WarmSandbox.bound_at >= since,
        and_(WarmSandbox.bound_at.is_(None), WarmSandbox.ended_at >= since),
    )


# When a warm sandbox's idle time is billed: when it was bound, else when it ended unbound.
WARM_BILLED_AT = func.coalesce(WarmSandbox.bound_at, WarmSandbox.ended_at)


def warm_idle(
    by: CostGrouping, org_id: str | None, since: datetime | None, *, per: Any = None
) -> Any:
    """The idle time of warm sandboxes, billed when each was bound or ended (one amount per
    warm sandbox, kept on its row: it has no sandbox row of its own until it is bound): the
    key ``by``, then (with ``per``, an expression of :data:`WARM_BILLED_AT`, a time bucket
    say) its value, then the count, seconds and amount, one row per key (and value)."""
    columns = {
        CostGrouping.POOL: WarmSandbox.pool_id,
        CostGrouping.PROVIDER: WarmSandbox.provider_id,
        CostGrouping.ORG: WarmSandbox.org_id,
    }
    column = columns.get(by)  # by project: all of it under one name
    per_value = [] if per is None else [per]
    query = (
        select(
            literal(WARM_PROJECT) if column is None else column,
            *per_value,
            func.count(),
            func.coalesce(func.sum(WarmSandbox.idle_seconds), 0.0),
            func.coalesce(func.sum(WarmSandbox.idle_amount_micros), 0),
        )
        .where(WarmSandbox.idle_amount_micros.is_not(None))
        .group_by(*([] if column is None else [column]), *per_value)
        .having(func.count() > 0)  # no group: one row of nothing
    )
    if org_id is not None:
        query = query.where(WarmSandbox.org_id == org_id)
    if since is not None:
        query = query.where(warm_idle_since(since))
    return query


_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}
_DURATION = re.compile(r"([0-9]{1,12})([smhd])")
MAX_SINCE_DAYS = 36_500
_EARLIEST = datetime(1970, 1, 1, tzinfo=UTC)
SINCE_FORMS = (
    f"since must be a duration like 24h, 7d, 30m (at most {MAX_SINCE_DAYS}d) or an ISO 8601 "
    "time from 1970 on, like 2026-11-01T00:00:00Z"
)


def parse_since(value: str, *, now: datetime | None = None) -> datetime:
    """``"24h"``, ``"7d"``, ``"30m"`` before now, or an ISO 8601 time (UTC if no zone).

    Raises:
        ValueError: neither form, or out of range, with a message that shows both forms and
            never the value.
    """
    text = value.strip()
    duration = _DURATION.fullmatch(text)
    if duration:
        seconds = int(duration[1]) * _UNITS[duration[2]]
        if seconds > MAX_SINCE_DAYS * _UNITS["d"]:
            raise ValueError(SINCE_FORMS)
        return (now or utcnow()) - timedelta(seconds=seconds)
    try:
        parsed = datetime.fromisoformat(text)
        parsed = (parsed if parsed.tzinfo else parsed.replace(tzinfo=UTC)).astimezone(UTC)
    except (ValueError, OverflowError):
        raise ValueError(SINCE_FORMS) from None
    if parsed < _EARLIEST:
        raise ValueError(SINCE_FORMS)
    return parsed


def format_micros(amount_micros: int) -> str:
    """``1234567`` → ``"1.234567"``: micro-units as a decimal of the currency unit."""
    sign = "-" if amount_micros < 0 else ""
    whole, fraction = divmod(abs(amount_micros), 1_000_000)
    return f"{sign}{whole}.{fraction:06d}"
