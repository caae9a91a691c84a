"""The reaper's look at the budgets: warn of the thresholds their spend reached, and name the
spent budgets whose policy stops the running sandboxes.

Each sweep reads every budget's spend once (:func:`corral.shared.store.budgets.every_state`).
A threshold (a percentage of the cap: 50, 80 and 100 unless the budget names its own) that
the spend reached in the budget's period and that was not yet warned of gets one lifecycle
event (entity ``budget``), a ``budget.threshold`` webhook event to each endpoint of its org
subscribed to it, a log line and a count in ``corral_budget_threshold_crossings_total``;
:func:`corral.shared.store.lifecycle.warn_budget` makes that once per threshold and period
whichever process gets there first. A spent budget
with ``on_cap: stop`` becomes a reaper rule (``budget_exhausted``: corral.worker.reaper)
that ends every live sandbox of its org, or of its pool.
"""

from __future__ import annotations

import logging
from datetime import datetime

from sqlalchemy import select

from corral.shared import metrics
from corral.shared.runtime import Runtime
from corral.shared.store.budgets import BudgetState, every_state
from corral.shared.store.lifecycle import warn_budget
from corral.shared.store.models import OnCap, Pool

log = logging.getLogger(__name__)


def watch_budgets(rt: Runtime, now: datetime, *, actor: str) -> list[BudgetState]:
    """Warn of every budget's newly reached thresholds; the spent budgets whose policy is
    ``stop``. One budget's failure to warn is logged and leaves the others to go on."""
    with rt.db.session() as session:
        states = every_state(session, now)
        pool_ids = {state.budget.pool_id for state in states if state.budget.pool_id}
        names: dict[str, str] = {}
        if pool_ids:  # a pool budget's warning names its pool
            rows = session.execute(select(Pool.id, Pool.name).where(Pool.id.in_(pool_ids)))
            names = {pool_id: name for pool_id, name in rows}
    for state in states:
        if state.unwarned():
            try:
                warn(rt, state, names.get(state.budget.pool_id or ""), actor=actor)
            except Exception:  # the next sweep tries again
                log.warning("budget warning not written", exc_info=True)
    return [s for s in states if s.exhausted and s.budget.on_cap == OnCap.STOP.value]


def warn(rt: Runtime, state: BudgetState, pool_name: str | None, *, actor: str) -> list[int]:
    """Write ``state``'s newly reached thresholds; those this call warned of (none when
    another process got there first)."""
    reached = state.unwarned()
    budget = state.budget
    detail = f"spent {state.ratio:.0%} of the cap: {state.describe(pool_name)}"
    with rt.db.session() as session:
        written = warn_budget(
            session,
            budget,
            since=state.since,
            reached=reached,
            spent_micros=state.spend.total,
            actor=actor,
            detail=detail,
        )
    if not written:
        return []
    org = budget.org_id if rt.settings.metrics_org_labels else ""
    for pct in reached:
        metrics.BUDGET_THRESHOLDS_CROSSED.labels(str(pct), budget.period, budget.set_by, org).inc()
        log.warning(
            "budget threshold reached: %d%% of the cap",
            pct,
            extra={"org_id": budget.org_id, "pool_id": budget.pool_id, "budget_id": budget.id},
        )
    return reached
