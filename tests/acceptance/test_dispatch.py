"""Whole flows through real processes: api, scheduler, local worker, maintenance, beat,
on Redis and PostgreSQL, with the real runner in real local sandboxes."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import time
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from celery import Celery
from pydantic import SecretStr
from sqlalchemy import func, select

from corral.providers.base import SandboxHandle, SandboxSpec
from corral.providers.local.provider import LocalProvider
from corral.scheduler.intake import accept, route_item
from corral.shared.messages import DispatchRequest
from corral.shared.settings import CoreSettings
from corral.shared.store.db import Database, make_engine, utcnow
from corral.shared.store.models import CostEvent, LifecycleEvent, Sandbox, WorkItem
from corral.worker.sweep_lock import sweep_lock
from tests.acceptance.conftest import RedisMonitor, shell
from tests.acceptance.private_redis import PrivateRedis
from tests.acceptance.stack import OUTSIDE_ADDRESS, Stack, running_stack
from tests.egress_probe import recording_server
from tests.seeding import SETTINGS

CODE = "def main(n, label):\n    return {'label': label, 'square': n * n}\n"
SCANNER = (Path(__file__).resolve().parents[1] / "token_scan.py").read_text()


@pytest.fixture(scope="module")
def stack(postgres_database_url: str, module_redis: PrivateRedis) -> Iterator[Stack]:
    """The conftest's stack on a Redis of the module's own, whose every command a test reads
    (MONITOR)."""
    with running_stack(postgres_database_url, module_redis.url) as running:
        yield running


def _processes_under(root: Path) -> list[int]:
    """Pids of live processes whose command line or working directory is under ``root``."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
            cwd = os.readlink(entry / "cwd")
        except OSError:
            continue
        if str(root) in cmdline or cwd.startswith(str(root)):
            found.append(int(entry.name))
    return found


def _await_terminated(db: Database, item_ids: list[str], timeout_s: float = 30) -> list[Sandbox]:
    deadline = time.monotonic() + timeout_s
    while True:
        with db.session() as session:
            rows = list(session.scalars(select(Sandbox).where(Sandbox.work_item_id.in_(item_ids))))
        if all(row.terminated_at is not None for row in rows) or time.monotonic() > deadline:
            return rows
        time.sleep(0.2)


def test_fifty_items_over_celery_and_http_all_succeed_with_one_sandbox_each(
    stack: Stack, setup_org: str, sender: Celery, db: Database
) -> None:
    ids = []
    for number in range(25):
        status, body = stack.request(
            "POST", "/v1/dispatch", shell(setup_org, f"echo http-{number}")
        )
        assert status == 202, body
        ids.append(body["id"])
    celery_ids = []
    for number in range(25):
        if number % 5 == 0:
            message = shell(setup_org, "unused", idempotency_key=f"celery-{number}")
            message["work"] = {
                "kind": "code",
                "code": CODE,
                "arguments": {"n": number, "label": f"c{number}"},
            }
        else:
            message = shell(setup_org, f"echo celery-{number}", idempotency_key=f"celery-{number}")
        sender.send_task("corral.dispatch", args=[message])
    # Celery intake has no answer to read the id from; find the items by their keys.
    deadline = time.monotonic() + 30
    while len(celery_ids) < 25 and time.monotonic() < deadline:
        with db.session() as session:
            celery_ids = list(
                session.scalars(
                    select(WorkItem.id).where(WorkItem.idempotency_key.like("celery-%"))
                )
            )
        time.sleep(0.2)
    assert len(celery_ids) == 25

    views = stack.wait_final(ids + celery_ids)
    assert [v["state"] for v in views] == ["succeeded"] * 50, [v["error"] for v in views]
    results = {v["result"]["label"]: v["result"]["square"] for v in views if v["result"]}
    assert results == {f"c{n}": n * n for n in range(0, 25, 5)}

    sandboxes = _await_terminated(db, ids + celery_ids)
    assert sorted(s.work_item_id for s in sandboxes) == sorted(ids + celery_ids)  # one each
    assert all(s.terminated_at is not None for s in sandboxes)
    assert all(s.termination_reason == "finished" for s in sandboxes)
    assert _processes_under(stack.sandbox_root) == []
    assert list(stack.sandbox_root.glob("sb-*")) == []

    status, logs = stack.request("GET", f"/v1/work-items/{ids[7]}/logs")
    assert status == 200
    assert [line["line"] for line in logs["lines"] if line["stream"] == "stdout"] == ["http-7"]


def test_malformed_celery_messages_become_dispatch_errors_and_the_next_is_served(
    stack: Stack, setup_org: str, sender: Celery, db: Database
) -> None:
    since = utcnow()  # other modules of the session record invalid messages of their own
    sender.send_task(
        "corral.dispatch",
        args=[{"org": "acme", "project": "web", "env": {"TOKEN": "s3cr3t-value"}}],
    )
    sender.send_task("corral.dispatch", args=["not a message"])
    sender.send_task("corral.dispatch", args=[{"a": 1}, {"b": 2}])
    sender.send_task(
        "corral.dispatch", args=[shell(setup_org, "echo after", idempotency_key="after-bad")]
    )

    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        with db.session() as session:
            errors = list(
                session.scalars(
                    select(WorkItem).where(
                        WorkItem.error_code == "invalid_message", WorkItem.created_at >= since
                    )
                )
            )
            good = session.scalar(select(WorkItem).where(WorkItem.idempotency_key == "after-bad"))
        if len(errors) >= 3 and good is not None and good.state == "succeeded":
            break
        time.sleep(0.2)
    assert len(errors) == 3
    assert all(e.state == "dispatch_error" for e in errors)
    messages = sorted(e.error_message or "" for e in errors)
    # (profile is optional: it defaults to the profile named default)
    assert any("work: Field required" in m for m in messages)
    assert any("exactly one argument" in m for m in messages)
    assert not any("s3cr3t-value" in str(e.payload) + (e.error_message or "") for e in errors)
    assert good is not None and good.state == "succeeded"
    assert stack.processes["scheduler"].poll() is None


def test_a_provision_task_delivered_twice_provisions_once(
    stack: Stack, setup_org: str, sender: Celery, db: Database
) -> None:
    request = DispatchRequest.model_validate(shell(setup_org, "sleep 0.5; echo twice"))
    item_id = accept(db, request, actor="test").item_id
    outcome = route_item(db, item_id, actor="test", settings=SETTINGS)
    assert outcome.queue == "provision.local"
    for _ in range(2):
        sender.send_task("corral.provision", args=[item_id], queue=outcome.queue)

    [view] = stack.wait_final([item_id])
    assert view["state"] == "succeeded"

    def nothing_to_do() -> list[dict[str, Any]]:
        lines = stack.log_path("worker-local").read_text().splitlines()
        records = [json.loads(line) for line in lines if line.startswith("{")]
        return [r for r in records if r.get("work_item_id") == item_id and "outcome" in r]

    # Both deliveries have finished: one provisioned (the item ran), the other found it done
    # or in flight and said so.
    outcomes = stack.until(nothing_to_do, "the second provision delivery to finish")
    with db.session() as session:
        sandboxes = session.scalar(
            select(func.count()).select_from(Sandbox).where(Sandbox.work_item_id == item_id)
        )
        provisioned = session.scalar(
            select(func.count())
            .select_from(LifecycleEvent)
            .where(
                LifecycleEvent.work_item_id == item_id,
                LifecycleEvent.entity == "sandbox",
                LifecycleEvent.to_state == "ready",
            )
        )
    assert sandboxes == 1
    assert provisioned == 1
    assert [r["outcome"] for r in outcomes] in (["already_provisioned"], ["in_flight"])


def test_no_token_in_broker_traffic_logs_or_answers(
    stack: Stack, setup_org: str, sender: Celery, redis_monitor: RedisMonitor
) -> None:
    ids = []
    for number in range(5):
        status, body = stack.request(
            "POST", "/v1/dispatch", shell(setup_org, f"env; echo {number}")
        )
        assert status == 202
        ids.append(body["id"])
    sender.send_task("corral.dispatch", args=[shell(setup_org, "env", idempotency_key="grep-1")])
    views = stack.wait_final(ids)
    assert {v["state"] for v in views} == {"succeeded"}
    time.sleep(1)
    traffic = redis_monitor.stop()
    assert b"corral.provision" in traffic  # the monitor did see the task messages
    answers = str(views) + str([stack.request("GET", f"/v1/work-items/{i}/logs") for i in ids])
    for prefix in ("crt_", "crs_"):
        assert prefix.encode() not in traffic
        assert prefix not in answers
        for name in stack.processes:
            assert prefix not in stack.log_path(name).read_text(errors="replace"), name
    # The sandbox did receive its token; the runner removed it before running the work.
    assert "CORRAL_CONTROL_URL" in answers
    assert "CORRAL_REGISTRATION_TOKEN" not in answers


def test_a_redelivered_dispatch_message_without_a_key_makes_one_item(
    stack: Stack, setup_org: str, sender: Celery, db: Database
) -> None:
    task_id = f"redelivery-{uuid.uuid4().hex}"
    for _ in range(2):  # the same message, delivered twice (as after a worker crash)
        sender.send_task("corral.dispatch", args=[shell(setup_org, "echo once")], task_id=task_id)
    deadline = time.monotonic() + 20
    items: list[WorkItem] = []
    while time.monotonic() < deadline:
        with db.session() as session:
            items = list(
                session.scalars(
                    select(WorkItem).where(WorkItem.idempotency_key == f"celery:{task_id}")
                )
            )
        if items and items[0].state == "succeeded":
            break
        time.sleep(0.2)
    assert [item.state for item in items] == ["succeeded"]


def _provision_a_stray(stack: Stack, org: str) -> tuple[LocalProvider, SandboxHandle]:
    """A sandbox made behind corral's back, in the stack's own local sandbox root. It is made
    while the test holds the reaper's lock: a sweep that found it half made would end it as
    the orphan it is, under the provision's feet (corral's own are safe: their rows come
    first)."""
    stray_provider = LocalProvider({"root_dir": str(stack.sandbox_root), "isolation": "auto"})
    database = Database(make_engine(stack.database_url))
    lock = sweep_lock(database, CoreSettings(reaper_lock_ttl_s=60))
    deadline = time.monotonic() + 60
    while not lock.acquire():  # a sweep runs now: it is short
        assert time.monotonic() < deadline, "the reaper's lock was never free"
        time.sleep(0.05)
    try:
        stray = _make_stray(stray_provider, org)
    finally:
        lock.release()
        database.dispose()
    return stray_provider, stray


def _make_stray(stray_provider: LocalProvider, org: str) -> SandboxHandle:
    return stray_provider.provision(
        SandboxSpec(
            work_item_id="wi-by-hand",
            sandbox_id="sb-by-hand",
            org_id=org,
            project_id="web",
            registration_token=SecretStr("crt_not-a-real-token"),
            control_url="http://127.0.0.1:9",
            provider_options={"command": ["sleep", "300"]},
            egress={"allow_network": True},
        )
    )


def _assert_the_sweep_ended_the_orphan(
    stack: Stack, stray_provider: LocalProvider, stray: SandboxHandle
) -> None:
    # The sweep kills the orphan's processes, then removes its directory: wait for both
    # (the status turns final as soon as the processes are gone, before the removal).
    stack.until(
        lambda: (
            stray_provider.status(stray).state.value != "running"
            and not (stack.sandbox_root / "sb-by-hand").exists()
        ),
        "no sweep terminated the orphan and removed its directory",
    )

    def orphans_logged() -> list[dict[str, str]]:
        # Process logs are JSON lines carrying the ids a record is about.
        lines = stack.log_path("maintenance").read_text().splitlines()
        records = [json.loads(line) for line in lines if line.startswith("{")]
        return [r for r in records if r["message"].startswith("terminated an orphan sandbox")]

    # Logged once terminate() has returned, which is after the directory's removal.
    [orphan] = stack.until(orphans_logged, "the sweep logged no orphan")
    assert (orphan["sandbox_id"], orphan["provider_id"], orphan["level"]) == (
        "sb-by-hand",
        "local",
        "WARNING",
    )


def _await_the_ledger(db: Database, org: str) -> tuple[set[str], int | None, list[str]]:
    """The org's ended sandboxes, its live ones' count and the sandboxes its cost events
    bill, once nothing is live and every ended one is billed (or after 30 s)."""
    deadline = time.monotonic() + 30
    while True:
        with db.session() as session:
            ended = set(
                session.scalars(
                    select(Sandbox.id).where(
                        Sandbox.org_id == org, Sandbox.terminated_at.is_not(None)
                    )
                )
            )
            live = session.scalar(
                select(func.count())
                .select_from(Sandbox)
                .where(Sandbox.org_id == org, Sandbox.terminated_at.is_(None))
            )
            billed = list(
                session.scalars(select(CostEvent.sandbox_id).where(CostEvent.org_id == org))
            )
        if (live == 0 and set(billed) == ended) or time.monotonic() > deadline:
            return ended, live, billed
        time.sleep(0.2)


def test_the_beat_scheduled_sweep_terminates_an_orphan_and_each_sandbox_is_billed_once(
    stack: Stack, setup_org: str, db: Database
) -> None:
    stray_provider, stray = _provision_a_stray(stack, setup_org)
    status, body = stack.request("POST", "/v1/dispatch", shell(setup_org, "echo billed"))
    assert status == 202
    [view] = stack.wait_final([body["id"]])
    assert view["state"] == "succeeded"

    _assert_the_sweep_ended_the_orphan(stack, stray_provider, stray)

    # Every sandbox of the org that ended has its one cost event (whether its runner
    # reported or a rule ended it): no end escapes the ledger.
    ended, live, billed = _await_the_ledger(db, setup_org)
    assert live == 0
    # (how many depends on which tests of the module ran first: at least this one's item)
    assert ended and sorted(billed) == sorted(ended)
    status, costs = stack.request("GET", f"/v1/costs?org={setup_org}&by=pool")
    assert status == 200 and costs["total"]["events"] == len(ended)

    # The maintenance worker's metrics count what its sweeps and terminations did.
    with urllib.request.urlopen(f"http://127.0.0.1:{stack.metrics_port}/metrics") as answer:
        metrics = {
            line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
            for line in answer.read().decode().splitlines()
            if line and not line.startswith("#")
        }
    assert metrics['corral_sandboxes_reaped_total{reason="orphan"}'] >= 1
    assert metrics['corral_cost_events_total{billing_model="fixed",provider="local"}'] >= 1


def test_metrics_after_a_dispatch_run_have_the_latency_histograms_and_the_gauges(
    stack: Stack, setup_org: str
) -> None:
    ids = []
    for number in range(3):
        status, body = stack.request("POST", "/v1/dispatch", shell(setup_org, f"echo m{number}"))
        assert status == 202
        ids.append(body["id"])
    assert {v["state"] for v in stack.wait_final(ids)} == {"succeeded"}

    api = stack.scrape(stack.api_metrics_port)
    # ... on the api's own listener only: not on the port (or socket) sandboxes reach.
    assert stack.request("GET", "/metrics")[0] == 404
    for histogram in (
        "corral_dispatch_to_provisioned_seconds",
        "corral_provisioned_to_claimed_seconds",
    ):
        assert api[f'{histogram}_count{{provider="local"}}'] >= 3
        assert api[f'{histogram}_bucket{{le="+Inf",provider="local"}}'] >= 3
        assert api[f'{histogram}_sum{{provider="local"}}'] > 0
    assert 'corral_work_items{state="running"}' in api
    # acme's local pool (64 slots); other tests' pools share the database
    local_pools = [
        k
        for k in api
        if k.startswith("corral_pool_max_concurrent{") and 'provider="local"' in k and api[k] == 64
    ]
    assert local_pools
    assert any(k.startswith("corral_pool_utilisation{") for k in api)
    assert api['corral_sandboxes_ended{reason="finished"}'] >= 3
    assert api['corral_cost_events{billing_model="fixed",provider="local"}'] >= 3

    worker = stack.scrape(stack.worker_metrics_ports["worker-local"])
    assert worker['corral_provision_seconds_count{outcome="ok",provider="local"}'] >= 3
    # The items' outcomes, counted by the api, which recorded their runners' completions.
    finished = 'corral_items_finished_total{code="",org="",outcome="succeeded",provider="local"}'
    assert api[finished] >= 3
    elapsed = 'corral_dispatch_to_finished_seconds_count{outcome="succeeded",provider="local"}'
    assert api[elapsed] >= 3


def test_env_values_reach_the_sandbox_and_nothing_at_rest_holds_them(
    stack: Stack, setup_org: str, sender: Celery, db: Database
) -> None:
    secret = f"sk-live-{uuid.uuid4().hex}"
    check = f'test "$API_TOKEN" = "{secret[:8]}$SUFFIX" && echo env-arrived'
    env = {"API_TOKEN": secret, "SUFFIX": secret[8:]}
    status, body = stack.request("POST", "/v1/dispatch", shell(setup_org, check) | {"env": env})
    assert status == 202, body
    message = shell(setup_org, check, idempotency_key=f"env-{secret[-6:]}") | {"env": env}
    sender.send_task("corral.dispatch", args=[message])
    celery_id = _await_item_by_key(db, f"env-{secret[-6:]}")
    views = stack.wait_final([body["id"], celery_id])
    assert [v["state"] for v in views] == ["succeeded", "succeeded"]
    logs = [stack.request("GET", f"/v1/work-items/{i}/logs") for i in (body["id"], celery_id)]
    assert all("env-arrived" in str(answer) for answer in logs)  # the sandbox had the value

    dump = _pg_dump(db)
    assert b"env-arrived" in dump  # the dump does hold the run's rows (its log lines)
    assert secret.encode() not in dump and secret[8:].encode() not in dump
    assert secret not in str(views) + str(logs)
    for name in stack.processes:
        assert secret[8:] not in stack.log_path(name).read_text(errors="replace"), name


def test_the_items_model_profile_reaches_its_work_default_when_it_names_none(
    stack: Stack, setup_org: str
) -> None:
    name = f"profile-{uuid.uuid4().hex[:8]}"
    profile = {"name": name, "model": f"model-of-{name}", "auth_mode": "metered"}
    assert stack.request("POST", "/v1/admin/profiles", profile)[0] == 201
    echo = 'echo "model=$CORRAL_MODEL profile=$CORRAL_PROFILE auth=$CORRAL_AUTH_MODE"'
    unnamed = {k: v for k, v in shell(setup_org, echo).items() if k != "profile"}
    ids = []
    for body in (shell(setup_org, echo) | {"profile": name}, unnamed):
        status, answer = stack.request("POST", "/v1/dispatch", body)
        assert status == 202, answer
        ids.append(answer["id"])
    assert [v["state"] for v in stack.wait_final(ids)] == ["succeeded", "succeeded"]
    profiles = stack.request("GET", "/v1/admin/profiles")[1]["profiles"]
    [default] = [p for p in profiles if p["name"] == "default"]
    printed = [str(stack.request("GET", f"/v1/work-items/{i}/logs")[1]) for i in ids]
    assert f"model=model-of-{name} profile={name} auth=metered" in printed[0]
    assert f"model={default['model']} profile=default auth={default['auth_mode']}" in printed[1]


def test_a_secret_binding_reaches_the_bound_host_and_the_sandbox_holds_only_a_placeholder(
    stack: Stack, setup_org: str, db: Database
) -> None:
    secret = f"sk-bound-{uuid.uuid4().hex}"
    with recording_server(OUTSIDE_ADDRESS) as (port, seen):
        allowed = f"{OUTSIDE_ADDRESS}:{port}"
        request = (
            f'r=u.Request("http://{allowed}/bound", headers={{"Authorization": "Bearer " + '
            'os.environ["API_TOKEN"]}); print("status", u.urlopen(r, timeout=10).status); '
            'print("env", os.environ["API_TOKEN"])'
        )
        message = shell(setup_org, f"python3 -c 'import os, urllib.request as u; {request}'")
        message["egress"] = {
            "allow_network": True,
            "allowed_hosts": [allowed],
            "secret_bindings": {
                "API_TOKEN": {"host": allowed, "value": secret, "header": "Authorization"}
            },
        }
        status, body = stack.request("POST", "/v1/dispatch", message)
        assert status == 202, body
        (view,) = stack.wait_final([body["id"]])
    assert view["state"] == "succeeded", view["error"]
    # The bound host got the real credential, through corral's egress proxy...
    assert [headers["Authorization"] for path, headers in seen if path == "/bound"] == [
        f"Bearer {secret}"
    ]
    # ... while the sandbox saw a placeholder, and nothing at rest or in a log holds it.
    logs = stack.request("GET", f"/v1/work-items/{body['id']}/logs")[1]
    lines = [line["line"] for line in logs["lines"]]
    assert "status 200" in lines
    assert any(line.startswith("env ") for line in lines)
    assert secret not in str(logs) + str(view)
    assert secret.encode() not in _pg_dump(db)
    for name in stack.processes:
        assert secret not in stack.log_path(name).read_text(errors="replace"), name


def _pg_dump(db: Database) -> bytes:
    url = db.engine.url
    where = ["-h", url.host or "127.0.0.1", "-p", str(url.port or 5432)]
    who = ["-U", url.username or "postgres", url.database or ""]
    command = ["pg_dump", "--data-only", *where, *who]
    return subprocess.run(command, capture_output=True, check=True).stdout


def _await_item_by_key(db: Database, key: str, timeout_s: float = 30) -> str:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with db.session() as session:
            found = session.scalar(select(WorkItem.id).where(WorkItem.idempotency_key == key))
        if found is not None:
            return found
        time.sleep(0.1)
    raise AssertionError(f"no item with key {key} within {timeout_s}s")


def test_a_code_item_whose_result_is_over_the_limit_fails_result_too_large(
    stack: Stack, setup_org: str
) -> None:
    message = shell(setup_org, "unused")
    message["work"] = {
        "kind": "code",
        "code": "def main(size):\n    return 'x' * size\n",
        "arguments": {"size": 1_100_000},
    }
    status, body = stack.request("POST", "/v1/dispatch", message)
    assert status == 202, body
    [view] = stack.wait_final([body["id"]])
    # The runner kept the result back and said why: not sandbox_lost, not a stored megabyte.
    assert view["state"] == "failed", view
    assert view["error"]["code"] == "result_too_large"
    assert "1100002 bytes of JSON" in view["error"]["message"]
    assert view["result"] is None


def test_every_log_record_about_an_item_or_a_sandbox_names_its_org_and_pool(
    stack: Stack, setup_org: str
) -> None:
    status, body = stack.request("POST", "/v1/dispatch", shell(setup_org, "echo logged"))
    assert status == 202
    assert stack.wait_final([body["id"]])[0]["state"] == "succeeded"
    about, missing = 0, []
    for name in stack.processes:
        for line in stack.log_path(name).read_text(errors="replace").splitlines():
            if not line.startswith("{"):
                continue
            record = json.loads(line)
            if "work_item_id" in record or "sandbox_id" in record:
                about += 1
                if "org_id" not in record or "pool_id" not in record:
                    missing.append((name, record["message"]))
    assert about > 0
    assert missing == []


def test_the_work_is_not_root_and_finds_no_token_in_any_process_it_can_see(
    stack: Stack, setup_org: str
) -> None:
    """Under this root worker: the work's uid is not 0, and a scan of every process's
    environ, command line and readable memory finds only the canary the work itself holds
    (not the runner's registration or session token, nor anything of bubblewrap's)."""
    canary = "crs_canary-0123456789"
    command = f"id -u; python3 -c {shlex.quote(SCANNER)}"
    status, body = stack.request(
        "POST", "/v1/dispatch", shell(setup_org, command) | {"env": {"CANARY": canary}}
    )
    assert status == 202, body
    [view] = stack.wait_final([body["id"]])
    _, logs = stack.request("GET", f"/v1/work-items/{body['id']}/logs")
    out = [line["line"] for line in logs["lines"] if line["stream"] == "stdout"]
    assert view["state"] == "succeeded", (view, out)

    assert out[0] == "10001", out
    assert "scan done" in out, out
    [runner] = [line for line in out if line.startswith("scanned") and "-m runner" in line]
    assert "environ=denied mem=denied" in runner, runner
    found = [line for line in out if line.startswith("found")]
    assert any("in=environ token=crs_canary" in line for line in found), out  # it does find
    assert all(line.endswith("token=crs_canary...") for line in found), found
