"""Spend caps, administered: set, list (with the period's spend) and delete budgets
(corral.shared.store.budgets); the admin api and ``corral budgets`` call these."""

from __future__ import annotations

import uuid
from typing import Any

from pydantic import BaseModel, ConfigDict, Field
from sqlalchemy import delete, select

from corral.scheduler.admin.pools import AdminError, PoolNotFoundError, find_pool
from corral.shared.store import budgets
from corral.shared.store.db import Database
from corral.shared.store.models import Budget, Pool
from corral.shared.text import IDENTIFIER

# The id is not repeated: an error answer never holds what the client sent.
NO_SUCH_BUDGET = "no such budget; `corral budgets list` shows them"


class BudgetNotFoundError(AdminError, LookupError):
    """No such budget."""

    code = "budget_not_found"


class BudgetSet(BaseModel):
    """A budget to set: replaces the org's (or the pool's) budget of the same period."""

    model_config = ConfigDict(extra="forbid")

    org_id: str = Field(pattern=IDENTIFIER)
    pool: str | None = Field(
        default=None, pattern=IDENTIFIER, description="a pool's name (or id); none: the org's"
    )
    period: budgets.Period
    cap_micros: int = Field(ge=0, le=2**62, description="micro-units of the rate cards' currency")


def set_budget(db: Database, request: BudgetSet) -> dict[str, Any]:
    """Store ``request`` (one budget per org or pool and period); the budget with its spend.

    Raises:
        PoolNotFoundError: no such pool in the org.
    """
    pool_id = None
    if request.pool is not None:
        pool = find_pool(db, request.org_id, request.pool)
        if pool["org_id"] != request.org_id:  # an id of another org's pool
            raise PoolNotFoundError("pool: no such pool in the org")
        pool_id = str(pool["id"])
    with db.session() as session:
        existing = session.scalars(
            select(Budget).where(
                Budget.org_id == request.org_id,
                Budget.pool_id.is_(None) if pool_id is None else Budget.pool_id == pool_id,
                Budget.period == request.period.value,
            )
        ).first()
        budget = existing or Budget(
            id=f"budget-{uuid.uuid4().hex[:16]}",
            org_id=request.org_id,
            pool_id=pool_id,
            period=request.period.value,
        )
        budget.cap_micros = request.cap_micros
        session.add(budget)
        session.flush()
        document = _document(session, budgets.spend(session, budget))
    budgets.forget(request.org_id)
    return document


def list_budgets(db: Database, org_id: str | None = None) -> list[dict[str, Any]]:
    """Every budget (of ``org_id``), with the current period's spend against its cap."""
    with db.session() as session:
        query = select(Budget).order_by(Budget.org_id, Budget.pool_id, Budget.period)
        if org_id is not None:
            query = query.where(Budget.org_id == org_id)
        return [_document(session, budgets.spend(session, b)) for b in session.scalars(query)]


def delete_budget(db: Database, budget_id: str) -> None:
    """Raises: BudgetNotFoundError."""
    with db.session() as session:
        org_id = session.scalar(select(Budget.org_id).where(Budget.id == budget_id))
        deleted = session.execute(delete(Budget).where(Budget.id == budget_id))
        if not getattr(deleted, "rowcount", 0):
            raise BudgetNotFoundError(NO_SUCH_BUDGET)
    budgets.forget(str(org_id))


def _document(session: Any, state: budgets.BudgetState) -> dict[str, Any]:
    budget = state.budget
    pool = session.get(Pool, budget.pool_id) if budget.pool_id else None
    return {
        "id": budget.id,
        "org_id": budget.org_id,
        "pool_id": budget.pool_id,
        "pool": pool.name if pool is not None else None,
        "period": budget.period,
        "since": state.since.isoformat(),
        "cap_micros": budget.cap_micros,
        "spent_micros": state.spend.total,
        "billed_micros": state.spend.billed_micros,
        "running_micros": state.spend.running_micros,
        "exhausted": state.exhausted,
    }


__all__ = ["NO_SUCH_BUDGET", "BudgetNotFoundError", "BudgetSet", "PoolNotFoundError"]
