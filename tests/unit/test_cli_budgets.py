"""``corral budgets`` against the embedded database: set (with its owner, its policy at the
cap and its thresholds), list with the spend, delete, and the errors of a bad period or an
unknown pool."""

from __future__ import annotations

import json
from pathlib import Path

from sqlalchemy import delete
from typer.testing import Result

from corral.shared.store import budgets
from corral.shared.store.db import Database, make_engine
from corral.shared.store.migrate import upgrade
from corral.shared.store.models import Budget
from tests.unit.test_cli_operator import embedded, run, setup_pool

__all__ = ["embedded"]  # the autouse fixture: an embedded database of the test's own


def test_budgets_are_set_listed_with_their_spend_and_deleted() -> None:
    setup_pool()
    made = run("budgets", "set", "--org", "acme", "--period", "month", "--cap-micros", "5000000")
    assert "org acme, this month: spent 0.000000 of 5.000000" in made.stdout
    run(
        "budgets", "set", "--org", "acme", "--pool", "local", "--period", "day", "--cap-micros", "7"
    )
    table = run("budgets", "list").stdout
    assert "(org)" in table and "local" in table and "EXHAUSTED" not in table
    rows = json.loads(run("budgets", "list", "--format", "json").stdout)
    assert sorted((r["pool"] or "", r["period"], r["cap_micros"]) for r in rows) == [
        ("", "month", 5_000_000),
        ("local", "day", 7),
    ]
    budget_id = made.stdout.split(":")[0].removeprefix("budget ")
    assert "deleted" in run("budgets", "delete", budget_id).stdout
    assert run("budgets", "delete", budget_id, code=2).output.count("no such budget") == 1


def test_a_bad_period_or_an_unknown_pool_is_a_clear_error() -> None:
    setup_pool()
    bad = run("budgets", "set", "--org", "acme", "--period", "year", "--cap-micros", "1", code=2)
    assert "period" in bad.output and "day" in bad.output
    unknown = run(
        "budgets",
        "set",
        "--org",
        "acme",
        "--pool",
        "nosuch",
        "--period",
        "day",
        "--cap-micros",
        "1",
        code=2,
    )
    assert "no such pool" in unknown.output


def test_routing_reads_an_orgs_budgets_at_most_once_per_interval(tmp_path: Path) -> None:
    database = Database(make_engine(f"sqlite:///{tmp_path / 'budgets.db'}"))
    upgrade(database.engine)
    try:
        with database.session() as session:
            session.add(Budget(id="budget-1", org_id="acme", period="day", cap_micros=5))
        with database.session() as session:
            assert [s.budget.id for s in budgets.states(session, ["acme"], max_age_s=3600)] == [
                "budget-1"
            ]
        with database.session() as session:  # removed behind this process's back
            session.execute(delete(Budget))
        with database.session() as session:
            assert len(budgets.states(session, ["acme"], max_age_s=3600)) == 1  # as read
            assert budgets.states(session, ["acme"], max_age_s=0) == []  # read again
    finally:
        budgets.forget("acme")
        database.dispose()


def daily(cap: int, *options: str, code: int = 0) -> Result:
    """``corral budgets set`` for acme's day, with ``options``."""
    args = ["--org", "acme", "--period", "day", "--cap-micros", str(cap), *options]
    return run("budgets", "set", *args, code=code)


def test_a_budget_says_who_set_it_what_it_does_at_its_cap_and_its_thresholds() -> None:
    setup_pool()
    made = daily(9, "--on-cap", "stop", "--threshold", "90", "--threshold", "25")
    assert "(set by the deployment; at the cap: stop)" in made.stdout
    daily(4, "--set-by", "org")
    table = run("budgets", "list").stdout
    assert "set by" in table and "deployment" in table and " org " in table
    rows = json.loads(run("budgets", "list", "--format", "json").stdout)
    assert sorted((r["set_by"], r["on_cap"], r["thresholds"]) for r in rows) == [
        ("deployment", "stop", [25, 90]),
        ("org", "refuse", [50, 80, 100]),
    ]
    assert "on_cap" in daily(1, "--on-cap", "halt", code=2).output
