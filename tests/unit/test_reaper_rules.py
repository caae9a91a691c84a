"""Each reaper rule is declared once (conditions on a sandbox's status and columns); its
SQL and its re-check on a fresh row are both read from that declaration. Held together here:
over sandboxes in every status, live or ended, with each column before, at and after each
rule's cutoff (or missing), the rows the SQL selects are exactly those the re-check accepts;
a spent budget that stops running work is a rule of the same kind, for its org or pool. The
expiry rule, on work items, is held the same way: items in every state, their expires_at
before, at and after its cutoff, or missing."""

from __future__ import annotations

import itertools
from datetime import UTC, datetime, timedelta

from sqlalchemy import create_engine, select
from sqlalchemy.orm import Session

from corral.providers.base import SandboxState
from corral.shared.settings import CoreSettings
from corral.shared.store.budgets import BudgetState, Spend
from corral.shared.store.models import Budget, ItemState, Sandbox, TerminationReason, WorkItem
from corral.worker.reaper_rules import expiry_rule, rules

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


def _items() -> list[WorkItem]:
    """Every state, with expires_at missing, now, and around the expiry rule's cutoff."""
    moments = [None, NOW - timedelta(days=400), NOW - timedelta(seconds=1), NOW]
    moments += [NOW + timedelta(seconds=1)]
    made = []
    for number, (state, moment) in enumerate(itertools.product(list(ItemState), moments)):
        made.append(
            WorkItem(
                id=f"wi-grid-{number}",
                org_id="acme",
                project_id="web",
                payload={},
                state=state.value,
                created_at=NOW,
                updated_at=NOW,
                expires_at=moment,
            )
        )
    return made


def expiry_agrees(session: Session) -> set[str]:
    """Write the items' grid, then hold the expiry rule's SQL to its re-check over it; the
    ids it selects."""
    session.add_all(_items())
    session.commit()
    rule = expiry_rule(NOW)
    selected = set(session.scalars(select(WorkItem.id).where(*rule.where())))
    fresh = session.scalars(select(WorkItem)).all()
    assert selected == {item.id for item in fresh if rule.applies(item)}
    return selected


def test_each_rules_sql_selects_exactly_what_its_recheck_accepts() -> None:
    # PostgreSQL's statements are held to the same grid in
    # tests/integration/test_reaper_rules_postgres.py.
    engine = create_engine("sqlite://")
    Sandbox.__table__.create(engine)  # type: ignore[attr-defined]
    WorkItem.__table__.create(engine)  # type: ignore[attr-defined]
    with Session(engine) as session:
        assert rules_agree(session, CoreSettings()) == 5 + len(SPENT)
        selected = expiry_agrees(session)
    # Items not final, expired before now: two moments of each of six pending states.
    assert len(selected) == 2 * 6


def test_the_expiry_rule_fails_pending_items_past_their_own_expiry_alone() -> None:
    rule = expiry_rule(NOW)
    assert rule.code == "expired"
    past, future = NOW - timedelta(seconds=1), NOW + timedelta(seconds=1)
    ended = {"succeeded", "failed", "cancelled", "dispatch_error"}
    for state in ItemState:
        final = state.value in ended
        assert rule.applies(WorkItem(state=state.value, expires_at=past)) is not final
        assert not rule.applies(WorkItem(state=state.value, expires_at=future))
        assert not rule.applies(WorkItem(state=state.value, expires_at=None))
        assert not rule.applies(WorkItem(state=state.value, expires_at=NOW))


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
