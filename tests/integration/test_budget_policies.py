"""Budgets that hold, on PostgreSQL (issue 34): who set a budget (an org key adds one of its
own beside the deployment's, never changes or deletes the deployment's, and the strictest
wins), what a spent budget does (``stop``: the reaper ends the running sandboxes of its org
with ``budget_exhausted`` and fails their items; ``refuse`` leaves them), and its thresholds,
each warned of once per period whichever reaper gets there, even several at once. The
console lists the budgets with who set each."""

from __future__ import annotations

import re
import threading
import uuid
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from alembic import command
from alembic.script import ScriptDirectory
from prometheus_client import REGISTRY
from sqlalchemy import select, text, update

from corral.providers.testing import InMemoryProvider
from corral.scheduler.admin.budgets import BudgetSet, set_budget
from corral.scheduler.intake import accept, route_item
from corral.shared.messages import DispatchRequest
from corral.shared.store.api_keys import create_key
from corral.shared.store.budgets import Period, every_state, period_start
from corral.shared.store.db import Database, make_engine, utcnow
from corral.shared.store.migrate import alembic_config, upgrade
from corral.shared.store.models import Budget, ItemState, LifecycleEvent, Pool
from corral.worker.budget_watch import warn, watch_budgets
from tests.integration.api_clients import ClientFactory
from tests.integration.reaping import RATE, Reaped, reaped_world
from tests.integration.test_budgets import _running_for, admin_headers
from tests.integration.test_console import logged_in


@pytest.fixture
def reaped(fresh_pg_url: str, redis_url: str, tmp_path: Path) -> Iterator[Reaped]:
    with reaped_world(fresh_pg_url, redis_url, tmp_path, InMemoryProvider()) as world:
        yield world


def org_admin(reaped: Reaped, org: str = "acme") -> dict[str, str]:
    with reaped.db.session() as session:
        _, key = create_key(session, org, "ops", ["admin"])
    return {"Authorization": f"Bearer {key}"}


def put(reaped: Reaped, headers: dict[str, str], **body: Any) -> Any:
    body = {"org_id": "acme", "period": "month"} | body
    return reaped.api.put("/v1/admin/budgets", json=body, headers=headers)


def routed(reaped: Reaped) -> ItemState:
    message = {"org": "acme", "project": "web", "profile": "default"}
    request = DispatchRequest.model_validate(
        message | {"work": {"kind": "shell", "command": "true"}}
    )
    item_id = accept(reaped.db, request, actor="test").item_id
    return route_item(reaped.db, item_id, actor="test", settings=reaped.rt.settings).state


def test_an_org_key_adds_a_budget_of_its_own_and_never_touches_the_deployments(
    reaped: Reaped,
) -> None:
    org_key = org_admin(reaped)
    deployment = put(reaped, admin_headers(), cap_micros=1_000_000).json()
    assert deployment["set_by"] == "deployment" and deployment["on_cap"] == "refuse"
    own = put(reaped, org_key, cap_micros=500, on_cap="stop", thresholds=[90, 25]).json()
    assert own["set_by"] == "org" and own["id"] != deployment["id"]
    assert own["thresholds"] == [25, 90] and own["on_cap"] == "stop"

    listed = reaped.api.get("/v1/admin/budgets?org=acme", headers=org_key).json()["budgets"]
    assert {(b["set_by"], b["cap_micros"]) for b in listed} == {
        ("deployment", 1_000_000),
        ("org", 500),
    }
    claimed = put(reaped, org_key, cap_micros=1, set_by="deployment")
    assert claimed.status_code == 403 and "set by the deployment" in claimed.json()["detail"]
    gone = reaped.api.delete(f"/v1/admin/budgets/{deployment['id']}", headers=org_key)
    assert gone.status_code == 403 and "set by the deployment" in gone.json()["detail"]
    with reaped.db.session() as session:
        kept = session.get(Budget, deployment["id"])
        assert kept is not None and kept.cap_micros == 1_000_000

    replaced = put(reaped, org_key, cap_micros=600).json()  # the org's own, replaced
    assert replaced["id"] == own["id"] and replaced["cap_micros"] == 600
    assert replaced["on_cap"] == "refuse" and replaced["thresholds"] == [50, 80, 100]
    changed = put(reaped, admin_headers(), cap_micros=700, set_by="org").json()
    assert changed["id"] == own["id"] and changed["cap_micros"] == 700  # the deployment may
    assert reaped.api.delete(f"/v1/admin/budgets/{own['id']}", headers=org_key).status_code == 200
    again = put(reaped, org_key, cap_micros=5).json()
    deleted = reaped.api.delete(f"/v1/admin/budgets/{again['id']}", headers=admin_headers())
    assert deleted.status_code == 200
    strangers = org_admin(reaped, "beta")
    for answer in (
        reaped.api.delete(f"/v1/admin/budgets/{deployment['id']}", headers=strangers),
        put(reaped, strangers, cap_micros=1),
    ):
        assert answer.status_code == 404  # another org's: as if there were none


def test_the_strictest_budget_wins_whoever_set_it(reaped: Reaped) -> None:
    org_key = org_admin(reaped)
    _running_for(reaped, 10)  # 25,000 run up
    put(reaped, admin_headers(), cap_micros=1_000_000)
    own = put(reaped, org_key, cap_micros=20_000).json()
    assert own["exhausted"] is True
    assert routed(reaped) is ItemState.DISPATCH_ERROR  # the org's stricter cap holds
    reaped.api.delete(f"/v1/admin/budgets/{own['id']}", headers=org_key)
    assert routed(reaped) is ItemState.ROUTED

    put(reaped, org_key, cap_micros=10_000_000)  # looser than the deployment's, now spent
    put(reaped, admin_headers(), cap_micros=20_000)
    assert routed(reaped) is ItemState.DISPATCH_ERROR  # the deployment's still applies
    refused = reaped.item(_last_item(reaped))
    assert refused.error_code == "budget_exhausted"
    assert "set by the deployment" in str(refused.error_message)


def _last_item(reaped: Reaped) -> str:
    with reaped.db.session() as session:
        found = session.execute(text("SELECT id FROM work_items ORDER BY created_at DESC LIMIT 1"))
        return str(found.scalar_one())


def test_a_spent_budget_that_stops_ends_its_orgs_running_sandboxes(reaped: Reaped) -> None:
    with reaped.db.session() as session:  # another org on the same provider: left alone
        session.add(
            Pool(
                id="pool-beta",
                org_id="beta",
                name="main",
                provider_id=reaped.provider.id,
                max_concurrent=5,
                sandbox_config={},
                billing_model="wall-clock",
                rate_micros=RATE,
            )
        )
    waiting, claimed = _running_for(reaped, 10), _running_for(reaped, 10)
    reaped.claim(claimed)
    beta = reaped.dispatch(org="beta")
    put(reaped, admin_headers(), cap_micros=20_000)  # spent, but it only refuses new work
    assert reaped.sweep().ended == {}

    put(reaped, admin_headers(), cap_micros=20_000, on_cap="stop")
    report = reaped.sweep()

    assert report.ended == {"budget_exhausted": 2}
    ended = [reaped.sandbox(item).id for item in (waiting, claimed)]
    for item_id, sandbox_id in zip((waiting, claimed), ended, strict=True):
        item, sandbox = reaped.item(item_id), reaped.sandbox(item_id)
        assert item.state == ItemState.FAILED and item.error_code == "budget_exhausted"
        assert "set by the deployment" in str(item.error_message)  # not requeued: it would
        assert sandbox.termination_reason == "budget_exhausted" and sandbox.id == sandbox_id
    assert reaped.sandbox(beta).terminated_at is None
    reaped.assert_ended_and_billed_once(ended)
    assert reaped.sweep().ended == {}


def _warnings(reaped: Reaped) -> list[tuple[str | None, str, str]]:
    with reaped.db.session() as session:
        rows = session.execute(
            select(LifecycleEvent.from_state, LifecycleEvent.to_state, LifecycleEvent.actor)
            .where(LifecycleEvent.entity == "budget")
            .order_by(LifecycleEvent.id)
        )
        return [tuple(row) for row in rows]  # type: ignore[misc]


def _crossings(threshold: str) -> float:
    labels = {"threshold": threshold, "period": "month", "set_by": "deployment", "org": ""}
    return REGISTRY.get_sample_value("corral_budget_threshold_crossings_total", labels) or 0.0


def test_each_threshold_is_warned_of_once_per_period_by_racing_reapers(reaped: Reaped) -> None:
    item_id = _running_for(reaped, 25)  # 62,500 of 100,000: past 50 %
    put(reaped, admin_headers(), cap_micros=100_000)
    before = _crossings("50")
    with reaped.db.session() as session:
        (stale,) = every_state(session)  # read by every racer before any writes
    start = threading.Barrier(8)
    results: list[list[int]] = []

    def racer(number: int) -> None:
        start.wait()
        results.append(warn(reaped.rt, stale, None, actor=f"reaper-{number}"))

    threads = [threading.Thread(target=racer, args=(n,)) for n in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sorted(results) == [[]] * 7 + [[50]]
    assert [w[:2] for w in _warnings(reaped)] == [(None, "50%")]
    assert _crossings("50") == before + 1

    _sweeps_at_once(reaped, 4)  # nothing new: nothing written
    reaped.backdate(reaped.sandbox(item_id).id, started_at=45)  # 112,500: past 80 and 100
    _sweeps_at_once(reaped, 4)
    assert [w[:2] for w in _warnings(reaped)] == [(None, "50%"), ("50%", "80%"), ("80%", "100%")]

    last_month = period_start(Period.MONTH, utcnow()) - timedelta(days=1)
    with reaped.db.session() as session:  # the warnings were of the last period
        session.execute(update(Budget).values(warned_period_start=last_month))
    _sweeps_at_once(reaped, 2)
    assert [w[:2] for w in _warnings(reaped)][3:] == [
        (None, "50%"),
        ("50%", "80%"),
        ("80%", "100%"),
    ]


def _sweeps_at_once(reaped: Reaped, count: int) -> None:
    """``count`` budget phases at once, as reapers without a common lock would run them."""
    start = threading.Barrier(count)

    def one(number: int) -> None:
        start.wait()
        watch_budgets(reaped.rt, utcnow(), actor=f"reaper-{number}")

    threads = [threading.Thread(target=one, args=(n,)) for n in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()


def test_the_migration_makes_existing_budgets_the_deployments_keeping_the_strictest_twin(
    fresh_pg_url: str,
) -> None:
    script = ScriptDirectory.from_config(alembic_config())
    (mine,) = [r for r in script.walk_revisions() if r.path.endswith("_budget_owners.py")]
    engine = make_engine(fresh_pg_url)
    try:
        config = alembic_config()
        with engine.begin() as connection:
            config.attributes["connection"] = connection
            command.downgrade(config, str(mine.down_revision))
        with engine.begin() as connection:
            for budget_id, cap in (("budget-a", 9), ("budget-b", 5), ("budget-c", 5)):
                connection.execute(
                    text(
                        "INSERT INTO budgets (id, org_id, period, cap_micros, created_at) "
                        "VALUES (:id, 'acme', 'day', :cap, now())"
                    ),
                    {"id": budget_id, "cap": cap},
                )
        upgrade(engine)
        with engine.connect() as connection:
            rows = connection.execute(
                text("SELECT id, set_by, on_cap, thresholds FROM budgets ORDER BY id")
            ).all()
        assert [tuple(row) for row in rows] == [("budget-b", "deployment", "refuse", None)]
    finally:
        engine.dispose()


def test_the_console_lists_the_budgets_with_who_set_each(
    make_client: ClientFactory, pg_db: Database
) -> None:
    mine, theirs = f"org-{uuid.uuid4().hex[:8]}", f"org-{uuid.uuid4().hex[:8]}"
    ids: dict[str, tuple[str, bool]] = {}  # budget id: (org, set by the deployment)
    for org, cap, by_deployment in ((mine, 5, True), (mine, 3, False), (theirs, 7, True)):
        request = BudgetSet(org_id=org, period="day", cap_micros=cap)
        ids[set_budget(pg_db, request, by_deployment=by_deployment)["id"]] = (org, by_deployment)
    with pg_db.session() as session:
        _, key = create_key(session, mine, "ops", ["read"])

    admin = make_client()
    logged_in(admin)
    page = admin.get(f"/console/costs?org={mine}").text
    rows = {i: row for i in ids if (row := re.search(rf'id="budget-{i}">(.*?)</tr>', page))}
    assert set(rows) == {i for i, (org, _) in ids.items() if org == mine}
    for budget_id, row in rows.items():
        owner = "deployment" if ids[budget_id][1] else "org"
        assert f'class="set-by">{owner}<' in row.group(1)

    own = make_client()
    logged_in(own, key)
    shown = own.get("/console/costs").text
    assert all(f"budget-{i}" in shown for i, (org, _) in ids.items() if org == mine)
    assert not any(f"budget-{i}" in shown for i, (org, _) in ids.items() if org == theirs)
