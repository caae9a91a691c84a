"""Each reaper rule is declared once (conditions on a sandbox's status and columns); its
SQL and its re-check on a fresh row are both read from that declaration. Held together here:
over sandboxes in every status, live or ended, with each column before, at and after each
rule's cutoff (or missing), the rows the SQL selects are exactly those the re-check accepts."""

from __future__ import annotations

import itertools
from datetime import UTC, datetime, timedelta

from sqlalchemy import create_engine, select
from sqlalchemy.orm import Session

from corral.providers.base import SandboxState
from corral.shared.settings import CoreSettings
from corral.shared.store.models import Sandbox
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


def rules_agree(session: Session, settings: CoreSettings) -> int:
    """Write the grid, then hold each rule's SQL to its re-check over it; the rules checked."""
    rows = _sandboxes(settings)
    session.add_all(rows)
    session.commit()
    checked = 0
    for rule in rules(settings, NOW):
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
        assert rules_agree(session, CoreSettings()) == 5
