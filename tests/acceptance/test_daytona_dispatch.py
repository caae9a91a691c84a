"""A dispatch routed to a daytona pool, through real processes (api, scheduler, a ``corral worker
--provider daytona``, maintenance and beat) and the official Daytona SDK, against the Daytona
stand-in on loopback, which runs each sandbox's runner as a real local process."""

from __future__ import annotations

import json
import os
import shlex
import sys
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from daytona import CreateSandboxFromSnapshotParams, Daytona, DaytonaConfig
from sqlalchemy import select

from corral.shared.store.db import Database, make_engine
from corral.shared.store.models import CostEvent
from tests.acceptance.conftest import shell
from tests.acceptance.stack import REPO, Stack
from tests.standins.daytona import DaytonaStandin, StandinSandbox

ORG = f"dtn-{uuid.uuid4().hex[:6]}"


@pytest.fixture(scope="module")
def cloud() -> Iterator[DaytonaStandin]:
    # The snapshot's image: a Python that finds corral's runner (standard library only).
    image_env = {"PATH": os.environ["PATH"], "PYTHONPATH": str(REPO)}
    with DaytonaStandin(snapshots=["corral-runner"], base_env=image_env) as standin:
        yield standin


@pytest.fixture(scope="module")
def daytona_stack(
    cloud: DaytonaStandin, postgres_database_url: str, redis_url: str
) -> Iterator[Stack]:
    config = {
        "api_url": cloud.api_url,
        "snapshot": "corral-runner",
        "command": [sys.executable, "-m", "runner"],
        "deployment": f"e2e-{uuid.uuid4().hex[:8]}",
        "request_timeout_s": 10,
    }
    running = Stack(
        database_url=postgres_database_url,
        broker_url=redis_url,
        provider_config={"daytona": config},
        extra_env={"CORRAL_DAYTONA_API_KEY": cloud.api_key},
    )
    try:
        running.start_only(["api", "scheduler", "worker-daytona", "maintenance", "beat"])
        for path, body in (
            ("/v1/admin/profiles", {"name": "default", "model": "m", "auth_mode": "byok"}),
            (
                "/v1/admin/pools",
                {"org_id": ORG, "name": "cloud", "provider_id": "daytona", "max_concurrent": 4},
            ),
        ):
            status, answer = running.request("POST", path, body)
            assert status in (201, 409), answer
        yield running
    finally:
        running.stop()


def _wait(what: str, check: Any, timeout_s: float = 30) -> Any:
    deadline = time.monotonic() + timeout_s
    while True:
        found = check()
        if found:
            return found
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.2)


def test_a_dispatch_to_a_daytona_pool_runs_its_runner_completes_and_is_billed_once(
    daytona_stack: Stack, cloud: DaytonaStandin
) -> None:
    status, answer = daytona_stack.request(
        "POST", "/v1/dispatch", shell(ORG, "echo hello from daytona")
    )
    assert status == 202, answer
    [view] = daytona_stack.wait_final([answer["id"]], timeout_s=90)
    assert view["state"] == "succeeded", view
    assert view["queue"] == "provision.daytona"
    assert view["sandbox"]["provider_id"] == "daytona"
    _, logs = daytona_stack.request("GET", f"/v1/work-items/{view['id']}/logs")
    assert [line["line"] for line in logs["lines"] if line["stream"] == "stdout"] == [
        "hello from daytona"
    ]

    made = cloud.sandbox(view["sandbox"]["external_id"])
    assert made.labels["corral.work-item-id"] == view["id"]
    assert made.network_allow_list == "127.0.0.1/32"  # no network: the control plane alone
    _assert_the_token_is_only_in_the_sandbox_env(daytona_stack, cloud, made)

    # The api asked for its end once the work reported: the sandbox is deleted at Daytona.
    _wait("the sandbox to be deleted", lambda: made.id in cloud.destroyed())
    billed = _wait("the cost event", lambda: _cost_events(daytona_stack, view["id"]))
    assert billed == [(view["sandbox"]["id"], "wall-clock")]
    time.sleep(2)  # a few more sweeps: still one
    assert _cost_events(daytona_stack, view["id"]) == [(view["sandbox"]["id"], "wall-clock")]


def _assert_the_token_is_only_in_the_sandbox_env(
    stack: Stack, cloud: DaytonaStandin, made: StandinSandbox
) -> None:
    token = made.env["CORRAL_REGISTRATION_TOKEN"]
    assert token.startswith("crt_")
    carriers = [
        (r.method, r.path)
        for r in cloud.requests()
        if token in f"{r.path} {r.query} {r.headers} {r.body!r}"
    ]
    assert carriers == [("POST", "/api/sandbox")], carriers  # the create body's env only
    assert token not in json.dumps(made.labels)
    # The runner was started detached in the sandbox, by its command line alone.
    [start] = cloud.requests(
        method="POST", path=f"/toolbox/{made.id}/process/session/corral-runner/exec"
    )
    assert start.body == {"command": shlex.join([sys.executable, "-m", "runner"]), "runAsync": True}
    for name in stack.processes:
        assert "crt_" not in stack.log_path(name).read_text(errors="replace"), name


def _cost_events(stack: Stack, item_id: str) -> list[tuple[str, str]]:
    db = Database(make_engine(stack.database_url))
    try:
        with db.session() as session:
            rows = session.execute(
                select(CostEvent.sandbox_id, CostEvent.billing_model).where(
                    CostEvent.work_item_id == item_id
                )
            ).all()
            return [(sandbox_id, model) for sandbox_id, model in rows]
    finally:
        db.dispose()


def test_the_reapers_orphan_rule_deletes_a_labelled_sandbox_the_database_does_not_know(
    daytona_stack: Stack, cloud: DaytonaStandin
) -> None:
    deployment = json.loads(daytona_stack.env["CORRAL_PROVIDER_CONFIG"])["daytona"]["deployment"]
    labels = {
        "corral.managed": "true",
        "corral.deployment": deployment,
        "corral.sandbox-id": "sb-made-by-hand",
        "corral.org-id": "acme",
    }
    sdk = Daytona(DaytonaConfig(**cloud.sdk_config()))
    stray = sdk.create(CreateSandboxFromSnapshotParams(name="made-by-hand", labels=labels))
    assert stray.id in cloud.sandboxes()

    _wait("the sweep to delete the orphan sandbox", lambda: stray.id in cloud.destroyed())
    # logged once the provider's terminate returned, so possibly just after the deletion
    log = daytona_stack.log_path("maintenance")
    _wait("the orphan's end to be logged", lambda: "terminated an orphan" in log.read_text())
