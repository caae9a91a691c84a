"""Spend caps, administered: set, list (with the period's spend) and delete budgets
(corral.shared.store.budgets); the admin api and ``corral budgets`` call these.

A budget has an owner (``set_by``). The deployment (the admin token, the CLI) sets and
deletes any budget; an org admin key sets and deletes only its org's own (``set_by: org``),
which applies beside the deployment's: the strictest wins. Setting replaces the budget of the
same org or pool, period and owner.
"""

from __future__ import annotations

import uuid
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field
from sqlalchemy import delete, select
from sqlalchemy.exc import IntegrityError

from corral.scheduler.admin.pools import AdminError, PoolNotFoundError, find_pool
from corral.shared.store import budgets
from corral.shared.store.db import Database
from corral.shared.store.models import Budget, BudgetOwner, OnCap, Pool
from corral.shared.text import IDENTIFIER

# The id is not repeated: an error answer never holds what the client sent.
NO_SUCH_BUDGET = "no such budget; `corral budgets list` shows them"
DEPLOYMENTS_BUDGET = (
    "this budget was set by the deployment: an org key may set and delete only its org's "
    "own budgets (set_by: org), which apply beside the deployment's (the strictest wins)"
)
MAX_THRESHOLDS = 10
Percent = Annotated[int, Field(ge=1, le=1000)]


class BudgetNotFoundError(AdminError, LookupError):
    """No such budget."""

    code = "budget_not_found"


class BudgetOwnedError(AdminError, PermissionError):
    """The budget is the deployment's: an org key may not change or delete it."""

    code = "budget_owned_by_deployment"


class BudgetSet(BaseModel):
    """A budget to set: replaces the one of the same org (or pool), period and owner."""

    model_config = ConfigDict(extra="forbid")

    org_id: str = Field(pattern=IDENTIFIER)
    pool: str | None = Field(
        default=None, pattern=IDENTIFIER, description="a pool's name (or id); none: the org's"
    )
    period: budgets.Period
    cap_micros: int = Field(ge=0, le=2**62, description="micro-units of the rate cards' currency")
    set_by: BudgetOwner | None = Field(
        default=None,
        description="whose budget: deployment or org; none: the caller's (an org key: org)",
    )
    on_cap: OnCap = Field(
        default=OnCap.REFUSE,
        description="at the cap: refuse new work, or also stop the running sandboxes",
    )
    thresholds: list[Percent] | None = Field(
        default=None,
        max_length=MAX_THRESHOLDS,
        description="percentages of the cap warned of once per period; none: 50, 80, 100",
    )


def set_budget(db: Database, request: BudgetSet, *, by_deployment: bool = True) -> dict[str, Any]:
    """Store ``request`` (one budget per org or pool, period and owner); the budget with its
    spend. An org key (``by_deployment`` false) sets its org's own budget.

    Raises:
        PoolNotFoundError: no such pool in the org.
        BudgetOwnedError: an org key named the deployment as the owner.
    """
    owner = request.set_by or (BudgetOwner.DEPLOYMENT if by_deployment else BudgetOwner.ORG)
    if owner is BudgetOwner.DEPLOYMENT and not by_deployment:
        raise BudgetOwnedError(DEPLOYMENTS_BUDGET)
    pool_id = None
    if request.pool is not None:
        pool = find_pool(db, request.org_id, request.pool)
        if pool["org_id"] != request.org_id:  # an id of another org's pool
            raise PoolNotFoundError("pool: no such pool in the org")
        pool_id = str(pool["id"])
    try:
        document = _store(db, request, pool_id, owner)
    except IntegrityError:  # a concurrent set made the row first: this one replaces it
        document = _store(db, request, pool_id, owner)
    budgets.forget(request.org_id)
    return document


def _store(
    db: Database, request: BudgetSet, pool_id: str | None, owner: BudgetOwner
) -> dict[str, Any]:
    thresholds = sorted(set(request.thresholds)) if request.thresholds is not None else None
    with db.session() as session:
        existing = session.scalars(
            select(Budget).where(
                Budget.org_id == request.org_id,
                Budget.pool_id.is_(None) if pool_id is None else Budget.pool_id == pool_id,
                Budget.period == request.period.value,
                Budget.set_by == owner.value,
            )
        ).first()
        budget = existing or Budget(
            id=f"budget-{uuid.uuid4().hex[:16]}",
            org_id=request.org_id,
            pool_id=pool_id,
            period=request.period.value,
            set_by=owner.value,
        )
        if (budget.cap_micros, budget.thresholds) != (request.cap_micros, thresholds):
            # A new cap or new thresholds: what was warned of no longer says anything.
            budget.warned_pct = budget.warned_period_start = None
        budget.cap_micros = request.cap_micros
        budget.thresholds = thresholds
        budget.on_cap = request.on_cap.value
        session.add(budget)
        session.flush()
        return _document(session, budgets.spend(session, budget))


def list_budgets(db: Database, org_id: str | None = None) -> list[dict[str, Any]]:
    """Every budget (of ``org_id``), with the current period's spend against its cap."""
    with db.session() as session:
        query = select(Budget).order_by(Budget.org_id, Budget.pool_id, Budget.period, Budget.set_by)
        if org_id is not None:
            query = query.where(Budget.org_id == org_id)
        return [_document(session, budgets.spend(session, b)) for b in session.scalars(query)]


def delete_budget(db: Database, budget_id: str, *, by_deployment: bool = True) -> None:
    """Remove a budget; an org key (``by_deployment`` false) only its org's own.

    Raises:
        BudgetNotFoundError: no such budget.
        BudgetOwnedError: an org key asked to delete the deployment's.
    """
    with db.session() as session:
        found = session.execute(
            select(Budget.org_id, Budget.set_by).where(Budget.id == budget_id)
        ).first()
        if found is None:
            raise BudgetNotFoundError(NO_SUCH_BUDGET)
        if found.set_by != BudgetOwner.ORG.value and not by_deployment:
            raise BudgetOwnedError(DEPLOYMENTS_BUDGET)
        deleted = session.execute(delete(Budget).where(Budget.id == budget_id))
        if not getattr(deleted, "rowcount", 0):
            raise BudgetNotFoundError(NO_SUCH_BUDGET)
    budgets.forget(str(found.org_id))


def _document(session: Any, state: budgets.BudgetState) -> dict[str, Any]:
    budget = state.budget
    pool = session.get(Pool, budget.pool_id) if budget.pool_id else None
    return {
        "id": budget.id,
        "org_id": budget.org_id,
        "pool_id": budget.pool_id,
        "pool": pool.name if pool is not None else None,
        "period": budget.period,
        "set_by": budget.set_by,
        "on_cap": budget.on_cap,
        "thresholds": budgets.thresholds_of(budget),
        "since": state.since.isoformat(),
        "cap_micros": budget.cap_micros,
        "spent_micros": state.spend.total,
        "billed_micros": state.spend.billed_micros,
        "running_micros": state.spend.running_micros,
        "exhausted": state.exhausted,
        "warned_pct": budget.warned_pct if budget.warned_period_start == state.since else None,
    }


__all__ = [
    "NO_SUCH_BUDGET",
    "BudgetNotFoundError",
    "BudgetOwnedError",
    "BudgetSet",
    "PoolNotFoundError",
]
