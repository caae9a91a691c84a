"""Reading the ledger and the sandboxes: ``GET /v1/costs``, ``GET /v1/sandboxes``,
``corral costs`` and ``corral sandboxes list``, on PostgreSQL."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import typer
from sqlalchemy import update
from typer.testing import CliRunner, Result

from corral.cli.app import app
from corral.providers.testing import InMemoryProvider
from corral.shared import runtime
from corral.shared.store.db import utcnow
from corral.shared.store.models import CostEvent, Pool, TerminationReason
from corral.worker.termination import end_sandbox
from tests.integration.reaping import ADMIN, Reaped, reaped_world

HEADERS = {"Authorization": f"Bearer {ADMIN}"}


@pytest.fixture
def ledger(fresh_pg_url: str, redis_url: str, tmp_path: Path) -> Iterator[Reaped]:
    """Three ended sandboxes: two in pool-in-memory (projects web, api), one in a fixed-fee
    pool; one more still running."""
    with reaped_world(fresh_pg_url, redis_url, tmp_path, InMemoryProvider()) as world:
        with world.db.session() as session:
            session.add(
                Pool(
                    id="pool-fixed",
                    org_id="acme",
                    name="fixed",
                    provider_id="in-memory",
                    priority=-1,
                    max_concurrent=5,
                    sandbox_config={},
                    billing_model="fixed",
                    rate_micros=1_500_000,
                )
            )
        ended = [world.dispatch(project="web"), world.dispatch(project="api")]
        with world.db.session() as session:  # the next item lands in the fixed-fee pool
            session.execute(update(Pool).where(Pool.id == "pool-in-memory").values(active=False))
        ended.append(world.dispatch(project="web"))
        with world.db.session() as session:
            session.execute(update(Pool).where(Pool.id == "pool-in-memory").values(active=True))
        world.dispatch(project="web")  # left running
        for item_id in ended:
            sandbox = world.sandbox(item_id)
            world.backdate(sandbox.id, started_at=100)
            end_sandbox(world.rt, sandbox.id, reason=TerminationReason.CANCELLED, actor="test")
        yield world


def test_costs_grouped_by_pool_with_the_total(ledger: Reaped) -> None:
    answer = ledger.api.get("/v1/costs", params={"by": "pool", "org": "acme"}, headers=HEADERS)

    assert answer.status_code == 200
    view = answer.json()
    rows = {row["pool"]: row for row in view["rows"]}
    assert set(rows) == {"pool-in-memory", "pool-fixed"}
    assert rows["pool-fixed"]["amount_micros"] == 1_500_000
    assert rows["pool-fixed"]["amount"] == "1.500000"
    assert rows["pool-in-memory"]["events"] == 2
    events = ledger.costs()
    assert view["total"]["amount_micros"] == sum(e.amount_micros for e in events)
    assert view["total"]["events"] == 3


def test_costs_by_project_and_since(ledger: Reaped) -> None:
    by_project = ledger.api.get("/v1/costs", params={"by": "project"}, headers=HEADERS).json()
    assert {row["project"]: row["events"] for row in by_project["rows"]} == {"api": 1, "web": 2}

    later = (utcnow()).isoformat()
    with ledger.db.session() as session:  # one event ended a day ago
        session.execute(
            update(CostEvent)
            .where(CostEvent.project_id == "api")
            .values(ended_at=utcnow().replace(year=2020))
        )
    recent = ledger.api.get(
        "/v1/costs", params={"by": "project", "since": "24h"}, headers=HEADERS
    ).json()
    assert {row["project"] for row in recent["rows"]} == {"web"}
    none = ledger.api.get("/v1/costs", params={"since": later}, headers=HEADERS).json()
    assert none["rows"] == [] and none["total"]["amount_micros"] == 0


def test_costs_refuse_bad_input_and_strangers(ledger: Reaped) -> None:
    assert ledger.api.get("/v1/costs").status_code == 401
    bad_since = ledger.api.get("/v1/costs", params={"since": "last week"}, headers=HEADERS)
    assert bad_since.status_code == 422
    assert "a duration like 24h" in bad_since.text
    assert ledger.api.get("/v1/costs", params={"by": "colour"}, headers=HEADERS).status_code == 422


def test_sandboxes_by_status(ledger: Reaped) -> None:
    answer = ledger.api.get("/v1/sandboxes", params={"status": "terminated"}, headers=HEADERS)
    assert answer.status_code == 200
    found = answer.json()["sandboxes"]
    assert len(found) == 3
    assert {s["termination_reason"] for s in found} == {"cancelled"}
    ready = ledger.api.get("/v1/sandboxes", params={"status": "ready"}, headers=HEADERS).json()
    assert [s["status"] for s in ready["sandboxes"]] == ["ready"]
    assert (
        ledger.api.get("/v1/sandboxes", params={"status": "bogus"}, headers=HEADERS).status_code
        == 422
    )


def test_the_cli_reads_the_same(
    ledger: Reaped, fresh_pg_url: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("CORRAL_DATABASE_URL", fresh_pg_url)
    monkeypatch.setenv("CORRAL_STATE_DIR", str(tmp_path))
    cli = CliRunner()

    class Runner:
        @staticmethod
        def invoke(app: typer.Typer, args: list[str]) -> Result:
            result = cli.invoke(app, args)
            installed = runtime.current()
            if installed is not ledger.rt:  # each command installs its own runtime
                installed.db.dispose()
                runtime.install(ledger.rt)
            return result

    runner = Runner()

    text = runner.invoke(app, ["costs", "--by", "pool", "--org", "acme"])
    assert text.exit_code == 0, text.output
    lines = text.output.splitlines()
    unit = ledger.rt.settings.cost_unit  # CORRAL_COST_UNIT names the amounts' unit
    assert lines[0].split() == [
        "pool",
        "events",
        "seconds",
        "amount",
        f"({unit})",
        "cpu",
        "estimated",
    ]
    assert any(line.split()[:2] == ["acme/fixed", "1"] and "1.500000" in line for line in lines)
    as_json = json.loads(runner.invoke(app, ["costs", "--by", "pool", "--format", "json"]).output)
    fixed = next(row for row in as_json["rows"] if row["pool"] == "pool-fixed")
    assert fixed["pool_name"] == "acme/fixed"  # the id stays, the name beside it
    assert lines[-1].split()[:2] == ["total", "3"]

    as_json = runner.invoke(app, ["costs", "--by", "provider", "--format", "json"])
    assert json.loads(as_json.output)["rows"][0]["provider"] == "in-memory"

    bad = runner.invoke(app, ["costs", "--by", "colour"])
    assert bad.exit_code == 2 and "--by must be one of pool, provider, project, org" in bad.output

    listed = runner.invoke(app, ["sandboxes", "list", "--status", "terminated", "--format", "json"])
    assert listed.exit_code == 0, listed.output
    assert len(json.loads(listed.output)) == 3
    table = runner.invoke(app, ["sandboxes", "list", "--status", "ready"])
    assert table.output.splitlines()[0].split()[:4] == ["sandbox", "work", "item", "provider"]
    assert len(table.output.splitlines()) == 2
    unknown = runner.invoke(app, ["sandboxes", "list", "--status", "asleep"])
    assert unknown.exit_code == 2 and "unknown status asleep" in unknown.output
