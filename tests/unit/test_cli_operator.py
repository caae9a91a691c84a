"""The operator's commands against the embedded SQLite database: items, cancel, logs,
status, settings, pools update/disable/enable/delete, credentials, providers config and
check, and the errors of missing or unknown options."""

from __future__ import annotations

import json
import os
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from click.testing import Result
from typer.testing import CliRunner

from corral.cli.app import app
from corral.cli.follow import Follower, describe, stall_hint
from corral.shared import runtime
from corral.shared.store.db import Database, make_engine
from corral.shared.store.lifecycle import transition
from corral.shared.store.models import ItemState, WorkItem, WorkItemLog
from tests.seeding import received_item

runner = CliRunner()
MISSING_BWRAP = '{"isolation": "required", "bwrap_path": "/nonexistent/bwrap"}'


@pytest.fixture(autouse=True)
def embedded(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    monkeypatch.setenv("CORRAL_STATE_DIR", str(tmp_path))
    monkeypatch.delenv("CORRAL_DATABASE_URL", raising=False)
    monkeypatch.delenv("CORRAL_PROVIDER_CONFIG", raising=False)
    monkeypatch.setenv("CORRAL_BROKER_URL", "memory://")
    # No corral dev answers here: a port nothing listens on.
    monkeypatch.setenv("CORRAL_API_URL", "http://127.0.0.1:9")
    yield tmp_path
    runtime.reset()


def run(*args: str, code: int = 0, stdin: str | None = None) -> Result:
    result = runner.invoke(app, list(args), input=stdin)
    assert result.exit_code == code, result.output
    return result


def setup_pool(org: str = "acme") -> None:
    run("profiles", "create", "--name", "default", "--model", "m", "--auth-mode", "byok")
    run("pools", "create", "--org", org, "--name", "local", "--provider", "local")


def dispatched(org: str = "acme") -> str:
    """An item of ``org``, ``received``: written as the intake writes one (a dispatch from
    the command line needs an api or a broker something reads)."""
    database = db(Path(os.environ["CORRAL_STATE_DIR"]))
    try:
        return received_item(database, org)
    finally:
        database.dispose()


def db(state_dir: Path) -> Database:
    return Database(make_engine(f"sqlite:///{state_dir / 'corral.db'}"))


def route(state_dir: Path, item_id: str, pool_id: str) -> None:
    """Route the item to the pool (it then holds one of its slots), as routing would."""
    database = db(state_dir)
    with database.session() as session:
        item = session.get(WorkItem, item_id)
        assert item is not None
        item.pool_id = pool_id
        transition(session, item, ItemState.ROUTED, actor="test")
    database.dispose()


def test_missing_org_says_so_and_an_unknown_format_is_refused_by_the_parser() -> None:
    missing = run("dispatch", "--project", "web", "--", "echo", "hi", code=125)
    assert "error: --org is required" in missing.output
    assert "does not match" not in missing.output  # no regex error
    for command in (["show", "wi-x"], ["items", "list"], ["status"], ["settings"]):
        refused = " ".join(
            run(*command, "--format", "yaml", code=2).output.replace("│", " ").split()
        )
        assert "Invalid value for '--format'" in refused
        assert "'yaml' is not one of 'text', 'json'" in refused


def test_items_list_shows_pool_names_and_filters_by_state(embedded: Path) -> None:
    setup_pool()
    first, second = dispatched(), dispatched()
    [pool] = json.loads(run("pools", "list", "--format", "json").stdout)
    route(embedded, first, pool["id"])
    table = run("items", "list", "--org", "acme").stdout
    assert table.splitlines()[0].split() == [
        "id",
        "org",
        "project",
        "state",
        "pool",
        "queue",
        "exit",
        "error",
        "created",
    ]
    routed = next(line for line in table.splitlines() if line.startswith(first))
    assert routed.split()[3:5] == ["routed", "local"]  # the pool's name, not its id
    assert f"pool       local ({pool['id']})   queue" in run("show", first).stdout
    only = json.loads(run("items", "list", "--state", "received", "--format", "json").stdout)
    assert [row["id"] for row in only] == [second]
    assert run("items", "list", "--org", "nobody").stdout.strip() == "no work items"
    assert "--since" in run("items", "list", "--since", "yesterday", code=2).output


def test_cancel_ends_an_item_once(embedded: Path) -> None:
    setup_pool()
    item_id = dispatched()
    assert run("cancel", item_id).stdout.strip() == f"{item_id} cancelled"
    assert run("cancel", item_id).stdout.strip() == f"{item_id} had already ended: cancelled"
    assert "work item wi-none does not exist" in run("cancel", "wi-none", code=2).output


def test_logs_prints_the_lines_and_follow_stops_when_the_item_has_ended(embedded: Path) -> None:
    setup_pool()
    item_id = dispatched()
    database = db(embedded)
    with database.session() as session:
        for number in range(3):
            session.add(WorkItemLog(work_item_id=item_id, stream="stdout", line=f"line {number}"))
        session.add(WorkItemLog(work_item_id=item_id, stream="stderr", line="a warning"))
        item = session.get(WorkItem, item_id)
        assert item is not None
        transition(session, item, ItemState.CANCELLED, actor="test")
    database.dispose()
    followed = run("logs", item_id, "-f")
    assert followed.stdout.splitlines() == ["line 0", "line 1", "line 2"]
    assert "a warning" in followed.stderr
    assert "does not exist" in run("logs", "wi-none", code=2).output


def test_a_dispatch_with_no_api_to_reach_says_so_and_writes_nothing(
    embedded: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    setup_pool()
    wait = ["--wait", "--timeout", "1"]
    tokenless = run("dispatch", "--org", "acme", "--project", "web", "--", "true", code=125)
    assert "no token to call the api at http://127.0.0.1:9 (from CORRAL_API_URL)" in (
        tokenless.stderr
    )
    monkeypatch.setenv("CORRAL_ADMIN_TOKEN", "t" * 32)
    result = run("dispatch", "--org", "acme", "--project", "web", *wait, "--", "true", code=125)
    said = result.stderr
    assert "the api at http://127.0.0.1:9 (from CORRAL_API_URL) did not answer" in said
    assert "Nothing was dispatched; again with --idempotency-key" in said
    assert "Traceback" not in said
    assert run("items", "list", "--format", "json").stdout.strip() == "[]"


def test_without_any_api_an_in_process_broker_is_refused(
    embedded: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("CORRAL_API_URL")
    monkeypatch.setenv("CORRAL_API_PORT", "9")  # nothing answers there either
    setup_pool()
    result = run("dispatch", "--org", "acme", "--project", "web", "--", "true", code=125)
    assert "no api to dispatch through" in result.stderr
    assert "the broker is in-process (memory://), so nothing would run the item" in result.stderr
    assert run("items", "list", "--format", "json").stdout.strip() == "[]"


def test_progress_lines_and_hints_name_what_to_start() -> None:
    view = {
        "id": "wi-1",
        "state": "routed",
        "pool": "local",
        "pool_id": "pool-1",
        "queue": "provision.docker",
        "sandbox": None,
        "exit_code": None,
        "duration_s": None,
        "error": None,
    }
    assert describe(view) == "routed to pool local on queue provision.docker"
    hint = stall_hint(view, 12, in_process=False)
    assert hint is not None and "start `corral worker --provider docker`" in hint
    paced = {**view, "waiting": {"reason": "provider_pace", "until": "2026-11-23T08:01:00+00:00"}}
    hint = stall_hint(paced, 12, in_process=False)
    assert hint is not None and "pace (provider_pace) until 2026-11-23T08:01:00" in hint
    received = {**view, "state": "received"}
    hint = stall_hint(received, 12, in_process=False)
    assert hint is not None and "start `corral scheduler`" in hint
    backing_off = {
        **received,
        "attempts": 1,
        "timestamps": {"not_before": "2026-11-23T08:02:00+00:00"},
    }
    hint = stall_hint(backing_off, 12, in_process=False)
    assert hint is not None and "backs off until 2026-11-23T08:02:00+00:00" in hint
    failed = {
        **view,
        "state": "dispatch_error",
        "error": {"code": "no_eligible_pool", "message": "m"},
    }
    assert describe(failed) == "dispatch_error no_eligible_pool: m"
    follower = Follower(stall_s=0, in_process=True)
    received["timestamps"] = {"created_at": "2026-11-23T08:00:00+00:00"}
    follower.see(received, [])
    follower.see(received, [])
    assert follower.hinted == {"received"}


def test_status_shows_pools_items_and_failures(embedded: Path) -> None:
    setup_pool()
    dispatched()
    text = run("status").stdout
    assert "the broker is in-process (memory://)" in text
    assert "http://127.0.0.1:9 does not answer (from CORRAL_API_URL)" in text
    pool_line = next(line for line in text.splitlines() if line.strip().startswith("acme"))
    assert pool_line.split()[:5] == ["acme", "local", "local", "active", "0/10"]
    assert "received 1" in text
    document = json.loads(run("status", "--format", "json").stdout)
    assert document["items"] == {"received": 1}
    assert "native" in document["pools"][0]["runtime_kinds"]
    assert document["failures"]["codes"] == {}


def test_settings_lists_every_setting_with_secrets_masked(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from corral.shared.settings import CoreSettings

    secret = uuid.uuid4().hex
    monkeypatch.setenv("CORRAL_ADMIN_TOKEN", secret)
    monkeypatch.setenv("CORRAL_DATABASE_URL", f"postgresql://corral:{secret}@db/corral")
    text = run("settings").stdout
    assert secret not in text
    rows = json.loads(run("settings", "--format", "json").stdout)
    assert secret not in json.dumps(rows)
    assert sorted(row["name"] for row in rows) == sorted(CoreSettings.model_fields)
    components = [row["component"] for row in rows]
    assert components[0] == "common"  # one component's settings together, the common first
    assert components == sorted(components, key=components.index)
    by_name = {row["name"]: row for row in rows}
    assert by_name["admin_token"]["value"] == "**********"
    assert by_name["database_url"]["value"] == "postgresql://corral:**********@db/corral"
    assert by_name["redrive_interval_s"] == {
        "name": "redrive_interval_s",
        "component": "intake",
        "env": "CORRAL_REDRIVE_INTERVAL_S",
        "default": "5.0",
        "value": "5.0",
        "description": "beat: how often waiting and stranded items are routed.",
    }


def test_pools_are_updated_disabled_enabled_and_deleted_by_name(embedded: Path) -> None:
    setup_pool()
    updated = json.loads(run("pools", "update", "local", "--org", "acme", "--priority", "9").stdout)
    assert updated["priority"] == 9
    assert (
        "capabilities"
        in run(
            "pools", "update", "local", "--org", "acme", "--capabilities", '{"gpus": 1}', code=2
        ).output
    )
    assert run("pools", "disable", "local", "--org", "acme").stdout.strip() == (
        "pool local of acme disabled"
    )
    assert "disabled" in run("pools", "list").stdout
    run("pools", "enable", "local", "--org", "acme")
    assert "a pool name needs --org" in run("pools", "delete", "local", code=2).output
    item_id = dispatched()
    route(embedded, item_id, updated["id"])
    refused = run("pools", "delete", "local", "--org", "acme", code=2)
    assert "1 work item(s) in flight: disable it" in refused.output
    run("cancel", item_id)
    assert run("pools", "delete", "local", "--org", "acme").stdout.strip() == "pool local deleted"
    assert run("pools", "list").stdout.strip() == "no pools"


def test_a_pools_lease_is_set_replaced_cleared_and_checked_by_name() -> None:
    run("profiles", "create", "--name", "default", "--model", "m", "--auth-mode", "byok")
    lease = '{"max_attempts": 4, "on_heartbeat_lost": "requeue"}'
    created = run(
        "pools", "create", "--org", "acme", "--name", "ci", "--provider", "local", "--lease", lease
    )
    assert json.loads(created.stdout)["lease"] == {
        "max_attempts": 4,
        "on_heartbeat_lost": "requeue",
    }
    replaced = run("pools", "update", "ci", "--org", "acme", "--lease", '{"backoff_s": 5}')
    assert json.loads(replaced.stdout)["lease"] == {"backoff_s": 5}
    refused = run(
        "pools", "update", "ci", "--org", "acme", "--lease", '{"max_attempts": 0}', code=2
    )
    assert "lease.max_attempts" in refused.output
    assert (
        "--lease is not valid JSON"
        in run("pools", "update", "ci", "--org", "acme", "--lease", "{nope", code=2).output
    )
    cleared = run("pools", "update", "ci", "--org", "acme", "--lease", "{}")
    assert json.loads(cleared.stdout)["lease"] is None


def test_credentials_are_listed_and_deleted_and_never_printed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    secret = "e2b_" + uuid.uuid4().hex
    outputs = [run("credentials", "set", "--org", "acme", "--provider", "e2b", stdin=secret)]
    outputs.append(run("credentials", "list", "--org", "acme"))
    assert outputs[-1].stdout.split()[:3] == ["provider", "stored", "e2b"]
    outputs.append(run("credentials", "list", "--org", "acme", "--format", "json"))
    outputs.append(run("credentials", "delete", "--org", "acme", "--provider", "e2b"))
    assert all(secret not in result.output for result in outputs)
    assert (
        "has no stored e2b credential"
        in run("credentials", "delete", "--org", "acme", "--provider", "e2b", code=2).output
    )
    assert "Missing option '--org'" in run("credentials", "list", code=2).output
    assert (
        "unknown provider"
        in run(
            "credentials", "set", "--org", "acme", "--provider", "nope", stdin="x", code=2
        ).output
    )


def test_providers_check_uses_the_deployments_stored_config() -> None:
    assert run("providers", "check", "local").stdout.startswith("local: healthy")
    refused = run("providers", "config", "set", "local", '{"isolaton": "off"}', code=2)
    assert "unknown key(s) 'isolaton'" in refused.output
    stored = json.loads(run("providers", "config", "set", "local", stdin=MISSING_BWRAP).stdout)
    assert (stored["source"], stored["config"]["isolation"]) == ("stored", "required")
    check = run("providers", "check", "local", code=1)
    assert check.stdout.strip() == (
        "local: UNHEALTHY: isolation is required but bubblewrap (/nonexistent/bwrap) is not "
        "installed: apt-get install bubblewrap (isolation: off runs trusted work only)"
    )
    assert json.loads(run("providers", "config", "show", "local").stdout)["source"] == "stored"
    assert json.loads(run("providers", "config", "unset", "local").stdout)["source"] == "default"
    assert run("providers", "check", "local").stdout.startswith("local: healthy")


def test_providers_check_reports_a_config_the_worker_would_refuse(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("CORRAL_PROVIDER_CONFIG", '{"local": {"bogus": 1}}')
    check = run("providers", "check", "local", code=1)
    assert "local: UNHEALTHY: the CORRAL_PROVIDER_CONFIG's configuration is refused" in (
        check.stdout
    )
    assert "unknown key(s) 'bogus'" in check.stdout
