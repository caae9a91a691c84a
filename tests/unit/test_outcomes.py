"""The items' outcome metrics: counted once, when the transaction that ended an item commits,
with its error code and its pool's provider; the dashboard names only exported metrics."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

import pytest
from prometheus_client import REGISTRY

from corral.scheduler.api import metrics as api_metrics
from corral.scheduler.batch import accept_batch
from corral.scheduler.intake import accept, route_item
from corral.shared import runtime
from corral.shared.settings import CoreSettings
from corral.shared.store import outcomes
from corral.shared.store.db import Database
from corral.shared.store.lifecycle import transition
from corral.shared.store.models import ItemState, WorkItem
from tests.seeding import SETTINGS
from tests.unit.test_intake import ACTOR, dispatch, make_pool, make_profile

DASHBOARD = Path(__file__).resolve().parents[2] / "deploy" / "grafana" / "corral-dashboard.json"


def finished(outcome: str, code: str, provider: str, org: str = "") -> float:
    labels = {"outcome": outcome, "code": code, "provider": provider, "org": org}
    return REGISTRY.get_sample_value("corral_items_finished_total", labels) or 0.0


def dispatch_errors(code: str, org: str = "") -> float:
    labels = {"code": code, "org": org}
    return REGISTRY.get_sample_value("corral_dispatch_errors_total", labels) or 0.0


@pytest.fixture
def org_labels() -> Iterator[None]:
    outcomes.configure(org_labels=True)
    yield
    outcomes.configure(org_labels=False)


def _routed(db: Database) -> str:
    make_profile(db)
    make_pool(db)
    item_id = accept(db, dispatch(), actor=ACTOR).item_id
    assert route_item(db, item_id, actor=ACTOR, settings=SETTINGS).state == ItemState.ROUTED
    return item_id


def _fail(db: Database, item_id: str, code: str, *, commit: bool = True) -> None:
    with db.session() as session:
        item = session.get(WorkItem, item_id)
        assert item is not None
        transition(session, item, ItemState.FAILED, actor=ACTOR)
        item.error_code = code  # set after the transition: read as committed
        if not commit:
            session.rollback()


def test_an_ended_item_is_counted_when_its_transaction_commits(sqlite_db: Database) -> None:
    item_id = _routed(sqlite_db)
    before = finished("failed", "work_failed", "local")
    elapsed = REGISTRY.get_sample_value(
        "corral_dispatch_to_finished_seconds_count", {"outcome": "failed", "provider": "local"}
    )

    _fail(sqlite_db, item_id, "work_failed", commit=False)
    assert finished("failed", "work_failed", "local") == before  # rolled back: not counted

    _fail(sqlite_db, item_id, "work_failed")
    assert finished("failed", "work_failed", "local") == before + 1
    after = REGISTRY.get_sample_value(
        "corral_dispatch_to_finished_seconds_count", {"outcome": "failed", "provider": "local"}
    )
    assert after == (elapsed or 0) + 1


def test_dispatch_errors_of_the_batched_intake_count_by_code_and_org(
    sqlite_db: Database, org_labels: None
) -> None:
    make_profile(sqlite_db)  # and no pool at all: no_eligible_pool
    before = dispatch_errors("no_eligible_pool", org="acme")
    finished_before = finished("dispatch_error", "no_eligible_pool", "", org="acme")

    taken = accept_batch(sqlite_db, [dispatch(), dispatch()], actor=ACTOR, settings=SETTINGS)

    assert [t.outcome.state for t in taken] == [ItemState.DISPATCH_ERROR] * 2
    assert dispatch_errors("no_eligible_pool", org="acme") == before + 2
    assert finished("dispatch_error", "no_eligible_pool", "", org="acme") == finished_before + 2


def exported_metric_names(db: Database) -> set[str]:
    """The name of every corral metric this process registers, and of the api's gauges."""
    names = {
        name
        for names in REGISTRY._collector_to_names.values()  # every metric of this process
        for name in names
        if name.startswith("corral_")
    }
    runtime.install(runtime.Runtime(settings=CoreSettings(), db=db))
    try:  # and the api's database gauges
        names |= {metric.name for metric in api_metrics.DatabaseCollector().collect()}
    finally:
        runtime.reset()
    return names


def test_the_dashboards_queries_name_only_metrics_corral_exports(sqlite_db: Database) -> None:
    # Every metric the processes serve is registered on import.
    import corral.scheduler.api.app
    import corral.worker.tasks  # noqa: F401

    dashboard = json.loads(DASHBOARD.read_text())
    expressions = [t["expr"] for panel in dashboard["panels"] for t in panel["targets"]]
    used = {name for expr in expressions for name in re.findall(r"\bcorral_[a-z0-9_]+", expr)}
    exported = exported_metric_names(sqlite_db)

    assert used - exported == set()
    assert len(dashboard["panels"]) >= 10
    new = {"corral_items_finished_total", "corral_dispatch_errors_total"}
    assert new <= used and any("corral_dispatch_to_finished_seconds" in e for e in expressions)
    assert "corral_no_such_metric" not in exported  # the check can fail
