"""Each reaper rule is declared once (conditions on a sandbox's status and columns); its
SQL and its re-check on a fresh row are both read from that declaration. Held together here:
over sandboxes in every status, live or ended, with each column before, at and after each
rule's cutoff (or missing), the rows the SQL selects are exactly those the re-check accepts;
a spent budget that stops running work is a rule of the same kind, for its org or pool."""

from __future__ import annotations

import itertools
from datetime import UTC, datetime, timedelta

from sqlalchemy import create_engine, select
from sqlalchemy.orm import Session

from corral.providers.base import SandboxState
from corral.shared.settings import CoreSettings
from corral.shared.store.budgets import BudgetState, Spend
from corral.shared.store.models import Budget, Sandbox, TerminationReason
from corral.worker.reaper import rules

NOW = datetime(2026, 1, 1, 12, 0, tzinfo=UTC)
COLUMNS = ("end_requested_at", "deadline_at", "last_heartbeat_at", "started_at", "created_at")


def _sandboxes(settings: CoreSettings) -> list[Sandbox]:
    """Every status, live or ended, and each rule's column around each cutoff."""
    cutoffs = {
        c.value for rule in rules(settings, NOW) for c in rule.conditions if c.test == "before"
    }
    moments = [None, NOW]
    for cutoff in cutoffs:
        moments += [cutoff - timedelta(seconds=1), cutoff, cutoff + timedelta(seconds=1)]
    made = []
    number = itertools.count()
    for status, ended, column, moment in itertools.product(
        [state.value for state in SandboxState], [None, NOW], COLUMNS, moments
    ):
        if column == "created_at" and moment is None:
            continue  # never missing
        index = next(number)
        sandbox = Sandbox(
            id=f"sb-{index}",
            work_item_id="wi",
            attempt=index,
            org_id="acme",
            pool_id="pool",
            provider_id="local",
            status=status,
            created_at=NOW + timedelta(days=1),  # out of every range unless it is the column
            terminated_at=ended,
        )
        setattr(sandbox, column, moment)
        made.append(sandbox)
    return made


def spent(pool_id: str | None) -> BudgetState:
    """A spent budget of acme (or of its pool ``pool_id``) that stops running work."""
    budget = Budget(id=f"budget-{pool_id}", org_id="acme", pool_id=pool_id, period="month")
    budget.cap_micros, budget.set_by, budget.on_cap = 1, "deployment", "stop"
    return BudgetState(budget, NOW, Spend(billed_micros=2, running_micros=0))


# Spent budgets whose rules the grid holds too: the org's, and one pool's.
SPENT = (spent(None), spent("pool"))


def rules_agree(session: Session, settings: CoreSettings) -> int:
    """Write the grid, then hold each rule's SQL to its re-check over it; the rules checked
    (the spent budgets' among them)."""
    rows = _sandboxes(settings)
    session.add_all(rows)
    session.commit()
    checked = 0
    for rule in rules(settings, NOW, SPENT):
        selected = set(session.scalars(select(Sandbox.id).where(*rule.where())))
        fresh = session.scalars(select(Sandbox)).all()
        accepted = {sandbox.id for sandbox in fresh if rule.applies(sandbox)}
        assert selected == accepted, rule.reason
        assert selected, f"{rule.reason}: the grid has rows the rule ends"
        checked += 1
    return checked


def test_each_rules_sql_selects_exactly_what_its_recheck_accepts() -> None:
    # PostgreSQL's statements are held to the same grid in
    # tests/integration/test_reaper_rules_postgres.py.
    engine = create_engine("sqlite://")
    Sandbox.__table__.create(engine)  # type: ignore[attr-defined]
    with Session(engine) as session:
        assert rules_agree(session, CoreSettings()) == 5 + len(SPENT)


def test_a_spent_budget_that_stops_is_a_rule_of_its_scope_last_and_only_then() -> None:
    settings = CoreSettings()
    assert [rule.reason for rule in rules(settings, NOW)] == [
        "finished",
        "deadline",
        "heartbeat_lost",
        "never_claimed",
        "provision_stuck",
    ]
    org_rule, pool_rule = rules(settings, NOW, SPENT)[-2:]
    assert org_rule.reason is pool_rule.reason is TerminationReason.BUDGET_EXHAUSTED
    live = Sandbox(org_id="acme", pool_id="other", terminated_at=None)
    assert org_rule.applies(live) and not pool_rule.applies(live)
    assert not org_rule.applies(Sandbox(org_id="else", pool_id="pool", terminated_at=None))
    assert not pool_rule.applies(Sandbox(org_id="acme", pool_id="pool", terminated_at=NOW))
    assert "set by the deployment" in org_rule.describe(None, None)
