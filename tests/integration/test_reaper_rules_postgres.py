"""The reaper rules' SQL, as PostgreSQL runs it, selects exactly what their re-check accepts:
the grids of tests/unit/test_reaper_rules.py (every status, live or ended, each column
before, at and after each cutoff, or missing; every item state, its expiry around the
cutoff) on a database of the test's own."""

from __future__ import annotations

from sqlalchemy.orm import Session

from corral.shared.settings import CoreSettings
from corral.shared.store.db import make_engine
from corral.shared.store.models import Pool, WorkItem
from tests.unit.test_reaper_rules import NOW, SPENT, expiry_agrees, rules_agree


def test_each_rules_postgresql_statement_selects_exactly_what_its_recheck_accepts(
    fresh_pg_url: str,
) -> None:
    engine = make_engine(fresh_pg_url)
    try:
        with Session(engine) as session:
            # What the grid's sandboxes belong to (the schema's foreign keys).
            session.add(
                Pool(id="pool", org_id="acme", name="p", provider_id="local", max_concurrent=1)
            )
            session.add(
                WorkItem(
                    id="wi",
                    org_id="acme",
                    project_id="web",
                    profile="default",
                    payload={},
                    state="running",
                    created_at=NOW,
                    updated_at=NOW,
                )
            )
            session.commit()
            assert rules_agree(session, CoreSettings()) == 5 + len(SPENT)
            assert len(expiry_agrees(session)) == 2 * 6
    finally:
        engine.dispose()
