"""A dispatch routed to a vercel pool, through real processes (api, scheduler, a ``corral worker
--provider vercel``, maintenance and beat) and the official ``vercel-sandbox`` SDK, against the
Vercel Sandbox stand-in on loopback, which runs the runner it is told to start detached as a
real local process with the sandbox's environment: the item completes and is billed once.
And the reaper's orphan rule removes a sandbox of this deployment the database does not know."""

from __future__ import annotations

import json
import sys
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from sqlalchemy import select
from vercel.sandbox.sync import SandboxCredentials, SandboxServiceOptions, SyncSandboxClient

from corral.shared.store.db import Database, make_engine
from corral.shared.store.models import CostEvent, Sandbox
from tests.acceptance.conftest import shell
from tests.acceptance.stack import REPO, Stack
from tests.standins.vercel import VercelStandin


@pytest.fixture(scope="module")
def vercel(tmp_path_factory: pytest.TempPathFactory) -> Iterator[VercelStandin]:
    # The sandbox's python3 is this interpreter, with corral's source tree on its path.
    base_env = {"PATH": f"{REPO / '.venv' / 'bin'}:/usr/bin:/bin", "PYTHONPATH": str(REPO)}
    with VercelStandin(base_env=base_env, workdir=tmp_path_factory.mktemp("vercel")) as standin:
        yield standin


@pytest.fixture(scope="module")
def vercel_stack(
    vercel: VercelStandin, postgres_database_url: str, redis_url: str
) -> Iterator[Stack]:
    config = {
        "api_url": vercel.base_url,
        "team_id": vercel.team_id,
        "project_id": vercel.project_id,
        "deployment": f"e2e-{uuid.uuid4().hex[:8]}",
        "runner_command": f"{sys.executable} -m runner",
        "request_timeout_s": 10,
    }
    running = Stack(
        database_url=postgres_database_url,
        broker_url=redis_url,
        provider_config={"vercel": config},
        extra_env={"CORRAL_VERCEL_API_KEY": vercel.token},
    )
    try:
        running.start_only(["api", "scheduler", "worker-vercel", "maintenance", "beat"])
        yield running
    finally:
        running.stop()


def _wait(what: str, check: Any, stack: Stack, timeout_s: float = 60) -> Any:
    deadline = time.monotonic() + timeout_s
    while True:
        found = check()
        if found:
            return found
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}\n{stack.logs()}")
        stack.check_alive()
        time.sleep(0.2)


def _make_pool(stack: Stack, org: str) -> None:
    for path, body in (
        ("/v1/admin/profiles", {"name": "default", "model": "m", "auth_mode": "byok"}),
        (
            "/v1/admin/pools",
            {"org_id": org, "name": "microvms", "provider_id": "vercel", "max_concurrent": 4},
        ),
    ):
        status, answer = stack.request("POST", path, body)
        assert status in (201, 409), answer


def test_an_item_routed_to_a_vercel_pool_runs_in_a_sandbox_completes_and_is_billed_once(
    vercel_stack: Stack, vercel: VercelStandin
) -> None:
    org = f"vc-{uuid.uuid4().hex[:6]}"
    _make_pool(vercel_stack, org)
    status, answer = vercel_stack.request(
        "POST", "/v1/dispatch", shell(org, "echo on vercel", egress={"allow_network": True})
    )
    assert status == 202, answer
    [view] = vercel_stack.wait_final([answer["id"]], timeout_s=90)
    assert view["state"] == "succeeded", view
    assert view["queue"] == "provision.vercel"

    [made] = [s for s in _made(vercel) if s.tags.get("corral.work-item-id") == view["id"]]
    token = made.env["CORRAL_REGISTRATION_TOKEN"]
    assert token.startswith("crt_")
    # The runner was started detached, with the sandbox's env, registered and succeeded
    # (the sandbox may be stopped under it as it exits).
    [runner] = made.commands
    assert [runner.name, *runner.args] == [sys.executable, "-m", "runner"]
    said = "".join(text for _, text in runner.output_from(0))
    assert f"registered: sandbox {made.name}" in said and "succeeded" in said, said
    # The token went in the create body's env and nowhere else: no tag, no command, no URL.
    carriers = {(r.method, r.path) for r in vercel.requests_containing(token)}
    assert carriers == {("POST", "/v3/sandboxes")}, carriers
    assert token not in json.dumps(made.tags)
    for name in vercel_stack.processes:
        assert "crt_" not in vercel_stack.log_path(name).read_text(errors="replace"), name

    # Terminated at the provider (stopped and destroyed), and billed exactly once.
    _wait("the sandbox to be destroyed", lambda: made.name in vercel.destroyed(), vercel_stack)
    events = _wait("its cost event", lambda: _cost_events(vercel_stack, org), vercel_stack)
    assert [e.sandbox_id for e in events] == [made.name]
    [event] = events
    assert (event.provider_id, event.billing_model) == ("vercel", "active-cpu")
    assert event.cpu_estimated  # the API reports no CPU time: wall-clock stands in
    time.sleep(2)  # a few more sweeps: nothing bills it again
    assert len(_cost_events(vercel_stack, org)) == 1


def _made(vercel: VercelStandin) -> list[Any]:
    return [vercel.sandbox(name) for name in [*vercel.sandboxes(), *vercel.destroyed()]]


def _cost_events(stack: Stack, org: str) -> list[CostEvent]:
    db = Database(make_engine(stack.database_url))
    try:
        with db.session() as session:
            return list(session.scalars(select(CostEvent).where(CostEvent.org_id == org)))
    finally:
        db.dispose()


def test_the_reapers_orphan_rule_removes_a_tagged_sandbox_the_database_does_not_know(
    vercel_stack: Stack, vercel: VercelStandin
) -> None:
    # A vercel pool exists (reconciliation lists the providers pools name).
    _make_pool(vercel_stack, f"vc-{uuid.uuid4().hex[:6]}")
    deployment = json.loads(vercel_stack.env["CORRAL_PROVIDER_CONFIG"])["vercel"]["deployment"]
    credentials = SandboxCredentials(vercel.token, vercel.team_id, vercel.project_id)
    options = SandboxServiceOptions(
        base_url=vercel.base_url, credentials_factory=lambda: credentials
    )
    client = SyncSandboxClient.create(options=options)
    tags = {"corral.managed": "true", "corral.deployment": deployment, "corral.org-id": "acme"}
    try:
        client.create_sandbox(name="sb-made-by-hand", tags=tags)
        client.create_sandbox(
            name="sb-of-another-deployment", tags={**tags, "corral.deployment": "x"}
        )
    finally:
        client.close()
    assert _known(vercel_stack, "sb-made-by-hand") is False

    _wait(
        "the sweep to destroy the orphan",
        lambda: "sb-made-by-hand" in vercel.destroyed(),
        vercel_stack,
    )
    log = vercel_stack.log_path("maintenance")
    _wait(
        "the orphan's end to be logged",
        lambda: "terminated an orphan" in log.read_text(),
        vercel_stack,
    )
    assert "sb-of-another-deployment" in vercel.sandboxes()  # not this deployment's: left alone
    # (Pools of other providers, left by other modules in the session's database, may fail
    # to reconcile here: this stack configures only vercel.)
    assert _failed_reconciliations(log.read_text(), "vercel") == []


def _failed_reconciliations(log: str, provider_id: str) -> list[dict[str, Any]]:
    records = [json.loads(line) for line in log.splitlines() if line.startswith("{")]
    return [
        r
        for r in records
        if r.get("message") == "reconciliation failed" and r.get("provider_id") == provider_id
    ]


def _known(stack: Stack, sandbox_id: str) -> bool:
    db = Database(make_engine(stack.database_url))
    try:
        with db.session() as session:
            return session.get(Sandbox, sandbox_id) is not None
    finally:
        db.dispose()
