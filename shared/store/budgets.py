"""Spend caps: an org's, or one pool's, over a calendar period (UTC day, week or month).

A budget's spend in its period is what the ledger billed (cost events that ended in the
period) plus what the sandboxes not billed yet have run up so far (live ones, and ended
ones whose cost event is still owed), priced with their pool's rate card
(:func:`corral.shared.store.ledger.price`). Routing (corral.scheduler) refuses new work once the
spend reaches the cap: an org budget fails the item at once (``budget_exhausted``, with the
numbers); a pool budget passes that pool by, and the item fails the same way only when
every pool that could take it is over its budget. A budget with ``on_cap: stop`` also has
the reaper end the running sandboxes in its scope (corral.worker.budget_watch).

Who set a budget is part of it (``set_by``): the deployment's and the org's own budget of the
same scope and period are two rows, and each applies, so the strictest wins; an org key
never changes or deletes the deployment's (corral.scheduler.admin.budgets).

A process keeps what it read of an org's budgets for ``CORRAL_BUDGET_CHECK_INTERVAL_S``
(5 s): routing reads the spend (two indexed reads per budget) at most that often per org,
however many items it routes, and an org without budgets costs one lookup per interval. So
a cap is noticed within that interval, and a budget set in another process too.
"""

from __future__ import annotations

import enum
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

from sqlalchemy import Engine, func, or_, select
from sqlalchemy.orm import Session

from corral.shared.store.db import utcnow
from corral.shared.store.ledger import billing_model_of, format_micros, price, warm_idle_since
from corral.shared.store.models import Budget, CostEvent, Pool, Sandbox, WarmSandbox

# Percentages of the cap warned of when a budget names none.
DEFAULT_THRESHOLDS = (50, 80, 100)


class Period(enum.StrEnum):
    DAY = "day"
    WEEK = "week"
    MONTH = "month"


def period_start(period: Period, now: datetime) -> datetime:
    """The start (UTC) of the calendar ``period`` ``now`` is in; weeks start on Monday."""
    day = datetime(now.year, now.month, now.day, tzinfo=UTC)
    if period is Period.DAY:
        return day
    if period is Period.WEEK:
        return day - timedelta(days=day.weekday())
    return day.replace(day=1)


@dataclass(frozen=True)
class Spend:
    billed_micros: int
    running_micros: int  # live and unbilled sandboxes, priced up to now

    @property
    def total(self) -> int:
        return self.billed_micros + self.running_micros


@dataclass(frozen=True)
class BudgetState:
    budget: Budget
    since: datetime
    spend: Spend

    @property
    def exhausted(self) -> bool:
        return self.spend.total >= self.budget.cap_micros

    @property
    def ratio(self) -> float:
        """Spend / cap; a cap of 0 is spent from the start (1), and past it at any spend."""
        cap, total = self.budget.cap_micros, self.spend.total
        if cap > 0:
            return total / cap
        return 1.0 if total == 0 else float("inf")

    def crossed(self) -> list[int]:
        """The budget's thresholds (percentages of the cap) its spend has reached."""
        total, cap = self.spend.total, self.budget.cap_micros
        return [pct for pct in thresholds_of(self.budget) if total * 100 >= pct * cap]

    def unwarned(self) -> list[int]:
        """The thresholds reached in this period and not yet warned of, lowest first."""
        warned = self.budget.warned_pct if self.budget.warned_period_start == self.since else None
        return [pct for pct in self.crossed() if warned is None or pct > warned]

    def describe(self, pool_name: str | None = None) -> str:
        budget, spend = self.budget, self.spend
        whose = f"pool {pool_name or budget.pool_id}" if budget.pool_id else "org"
        return (
            f"the {whose} budget of org {budget.org_id} for this {budget.period} "
            f"(set by the {budget.set_by}, since {self.since:%Y-%m-%d}) is "
            f"{format_micros(budget.cap_micros)}; spent {format_micros(spend.total)} "
            f"({format_micros(spend.billed_micros)} billed, "
            f"{format_micros(spend.running_micros)} by sandboxes not billed yet)"
        )


def crossing_record(
    budget: Budget, since: datetime, threshold_pct: int, spent_micros: int
) -> dict[str, Any]:
    """A budget's crossed threshold as its ``budget.threshold`` webhook event tells it."""
    return {
        "budget_id": budget.id,
        "org": budget.org_id,
        "pool_id": budget.pool_id,
        "period": budget.period,
        "period_start": since.isoformat(),
        "set_by": budget.set_by,
        "on_cap": budget.on_cap,
        "threshold_pct": threshold_pct,
        "cap_micros": budget.cap_micros,
        "cap": format_micros(budget.cap_micros),
        "spent_micros": spent_micros,
        "spent": format_micros(spent_micros),
    }


def thresholds_of(budget: Budget) -> list[int]:
    """``budget``'s thresholds, ascending: its own, else :data:`DEFAULT_THRESHOLDS`."""
    return sorted(set(budget.thresholds or DEFAULT_THRESHOLDS))


def spend(session: Session, budget: Budget, now: datetime | None = None) -> BudgetState:
    """``budget``'s spend in its current period."""
    now = now or utcnow()
    since = period_start(Period(budget.period), now)
    billed = select(func.coalesce(func.sum(CostEvent.amount_micros), 0)).where(
        CostEvent.org_id == budget.org_id, CostEvent.ended_at >= since
    )
    unbilled = (
        select(Sandbox, Pool)
        .join(Pool, Pool.id == Sandbox.pool_id)
        .where(
            Sandbox.org_id == budget.org_id,
            Sandbox.started_at.is_not(None),
            or_(Sandbox.terminated_at.is_(None), Sandbox.cost_due_at.is_not(None)),
        )
    )
    # Warm sandboxes' idle time: billed on their own rows when bound or ended.
    warm_billed = select(func.coalesce(func.sum(WarmSandbox.idle_amount_micros), 0)).where(
        WarmSandbox.org_id == budget.org_id, warm_idle_since(since)
    )
    if budget.pool_id is not None:
        billed = billed.where(CostEvent.pool_id == budget.pool_id)
        unbilled = unbilled.where(Sandbox.pool_id == budget.pool_id)
        warm_billed = warm_billed.where(WarmSandbox.pool_id == budget.pool_id)
    running = sum(
        _accrued(sandbox, pool, since, now) for sandbox, pool in session.execute(unbilled)
    )
    total = int(session.scalar(billed) or 0) + int(session.scalar(warm_billed) or 0)
    return BudgetState(budget, since, Spend(total, running))


def _accrued(sandbox: Sandbox, pool: Pool, since: datetime, now: datetime) -> int:
    started = max(sandbox.started_at or now, since)
    elapsed = (sandbox.terminated_at or now) - started
    model = billing_model_of(pool)
    return price(model, pool.rate_micros, elapsed=elapsed, cpu_seconds=None).amount_micros


def every_state(session: Session, now: datetime | None = None) -> list[BudgetState]:
    """Every budget with its spend at ``now``, in id order (the reaper and the metrics)."""
    now = now or utcnow()
    return [
        spend(session, budget, now)
        for budget in session.scalars(select(Budget).order_by(Budget.id))
    ]


# (database, org) -> (when read, its budgets)
_read: dict[tuple[str, str], tuple[float, list[BudgetState]]] = {}
_read_lock = threading.Lock()


def states(session: Session, org_ids: Iterable[str], *, max_age_s: float) -> list[BudgetState]:
    """The budgets of ``org_ids`` with their spend, as read at most ``max_age_s`` ago."""
    wanted = sorted(set(org_ids))
    clock, where = time.monotonic(), _database(session)
    with _read_lock:
        cached = {org: _read.get((where, org)) for org in wanted}
    fresh = {
        org: entry[1]
        for org, entry in cached.items()
        if entry is not None and clock - entry[0] < max_age_s
    }
    missing = [org for org in wanted if org not in fresh]
    if missing:
        now = utcnow()
        query = select(Budget).where(Budget.org_id.in_(missing)).order_by(Budget.id)
        read: dict[str, list[BudgetState]] = {org: [] for org in missing}
        for budget in session.scalars(query):
            read[budget.org_id].append(spend(session, budget, now))
        with _read_lock:
            _read.update({(where, org): (clock, found) for org, found in read.items()})
        fresh |= read
    return [state for org in wanted for state in fresh[org]]


def forget(org_id: str) -> None:
    """Read ``org_id``'s budgets again at the next routing (they were just changed here)."""
    with _read_lock:
        for key in [key for key in _read if key[1] == org_id]:
            del _read[key]


def _database(session: Session) -> str:
    bind = session.get_bind()
    engine = bind if isinstance(bind, Engine) else bind.engine
    return engine.url.render_as_string(hide_password=True)
