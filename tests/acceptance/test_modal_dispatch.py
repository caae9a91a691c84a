"""Dispatches routed to modal pools, through real processes (api, scheduler, a ``corral worker
--provider modal``, maintenance and beat) and the official ``modal`` SDK, against the Modal
stand-in on loopback, which runs each sandbox's entrypoint — corral's runner — as a local
process with the environment of the sandbox's secrets, so that items go all the way to the
runner's register and complete."""

from __future__ import annotations

import sys
import time
import uuid
from collections.abc import Iterator
from typing import Any

import modal
import pytest
from modal_proto import api_pb2
from sqlalchemy import select

from corral.shared.store.db import Database, make_engine
from corral.shared.store.models import CostEvent
from tests.acceptance.conftest import shell
from tests.acceptance.stack import REPO, Stack
from tests.standins.modal import ModalStandin

DEPLOYMENT = f"e2e-{uuid.uuid4().hex[:8]}"
APP = "corral-e2e"


@pytest.fixture(scope="module")
def modal_cloud() -> Iterator[ModalStandin]:
    # What the sandbox image provides: a Python with corral's runner importable.
    base_env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO)}
    with ModalStandin(base_env=base_env) as standin:
        yield standin


@pytest.fixture(scope="module")
def modal_stack(
    modal_cloud: ModalStandin, postgres_database_url: str, redis_url: str
) -> Iterator[Stack]:
    config = {
        "server_url": modal_cloud.server_url,
        "app_name": APP,
        "deployment": DEPLOYMENT,
        "image": "corral-sandbox:dev",
        "command": [sys.executable, "-m", "runner"],
        "gpu_type": "A10G",
        "request_timeout_s": 10,
    }
    running = Stack(
        database_url=postgres_database_url,
        broker_url=redis_url,
        provider_config={"modal": config},
        extra_env={"CORRAL_MODAL_API_KEY": modal_cloud.api_key},
    )
    try:
        running.start_only(["api", "scheduler", "worker-modal", "maintenance", "beat"])
        yield running
    finally:
        running.stop()


def _org_with_a_modal_pool(stack: Stack, **pool: Any) -> str:
    org = f"modal-{uuid.uuid4().hex[:6]}"
    body = {"org_id": org, "name": "cloud", "provider_id": "modal", "max_concurrent": 4, **pool}
    for path, payload in (
        ("/v1/admin/profiles", {"name": "default", "model": "m", "auth_mode": "byok"}),
        ("/v1/admin/pools", body),
    ):
        status, answer = stack.request("POST", path, payload)
        assert status in (201, 409), answer
    return org


def _run(stack: Stack, message: dict[str, Any]) -> dict[str, Any]:
    status, answer = stack.request("POST", "/v1/dispatch", message)
    assert status == 202, answer
    [view] = stack.wait_final([answer["id"]], timeout_s=90)
    return view


def _cost_events(stack: Stack, sandbox_id: str) -> list[CostEvent]:
    """The sandbox's cost events, once there is one (or after 30 s)."""
    db = Database(make_engine(stack.database_url))
    try:
        deadline = time.monotonic() + 30
        while True:
            with db.session() as session:
                events = list(
                    session.scalars(select(CostEvent).where(CostEvent.sandbox_id == sandbox_id))
                )
            if events or time.monotonic() > deadline:
                return events
            time.sleep(0.2)
    finally:
        db.dispose()


def test_an_item_runs_in_a_modal_sandbox_holding_the_token_in_its_secret_and_is_billed_once(
    modal_stack: Stack, modal_cloud: ModalStandin
) -> None:
    org = _org_with_a_modal_pool(modal_stack)
    view = _run(modal_stack, shell(org, "echo from-modal"))

    assert view["state"] == "succeeded", view
    assert view["queue"] == "provision.modal"
    assert view["sandbox"]["provider_id"] == "modal"
    sandbox = modal_cloud.sandbox(view["sandbox"]["external_id"])
    assert sandbox.gpu is None
    assert sandbox.tags["corral.work-item-id"] == view["id"]
    _, logs = modal_stack.request("GET", f"/v1/work-items/{view['id']}/logs")
    assert [line["line"] for line in logs["lines"] if line["stream"] == "stdout"] == ["from-modal"]

    # The token reached the sandbox through its secret and nowhere else: not its command,
    # not its tags, not another call, not a log.
    token = sandbox.env["CORRAL_REGISTRATION_TOKEN"]
    assert token.startswith("crt_")
    assert {r.method for r in modal_cloud.requests_carrying(token)} == {"SandboxCreateV2"}
    assert token not in str(sandbox.argv) + str(sandbox.tags)
    for name in modal_stack.processes:
        assert "crt_" not in modal_stack.log_path(name).read_text(errors="replace"), name
    assert modal_cloud.token_secret not in "".join(
        modal_stack.log_path(name).read_text(errors="replace") for name in modal_stack.processes
    )

    # Ended: terminated at Modal, and billed once.
    external_id = view["sandbox"]["external_id"]
    modal_stack.until(
        lambda: modal_cloud.sandbox(external_id).result is not None, "the sandbox to be ended"
    )
    events = _cost_events(modal_stack, view["sandbox"]["id"])
    assert len(events) == 1
    assert (events[0].provider_id, events[0].billing_model) == ("modal", "wall-clock")


def test_a_gpu_item_lands_on_the_gpu_queue_and_its_sandbox_gets_the_gpu(
    modal_stack: Stack, modal_cloud: ModalStandin
) -> None:
    org = _org_with_a_modal_pool(modal_stack, capabilities={"supports_gpu": True})
    message = shell(org, "echo on-a-gpu", agent_card={"requires": [{"kind": "gpu"}]})
    view = _run(modal_stack, message)

    assert view["state"] == "succeeded", view
    assert view["queue"] == "provision.modal.gpu"
    sandbox = modal_cloud.sandbox(view["sandbox"]["external_id"])
    assert sandbox.gpu == "A10G"  # the card asked for a GPU: one, of the configured type
    token = sandbox.env["CORRAL_REGISTRATION_TOKEN"]
    # A GPU sandbox is a V1 one at Modal: the token went in its Secret, made from a dict.
    assert {r.method for r in modal_cloud.requests_carrying(token)} == {"SecretGetOrCreate"}
    assert len(_cost_events(modal_stack, view["sandbox"]["id"])) == 1


def test_the_reapers_orphan_rule_terminates_a_tagged_sandbox_the_database_does_not_know(
    modal_stack: Stack, modal_cloud: ModalStandin
) -> None:
    _org_with_a_modal_pool(modal_stack)  # the sweep reconciles the providers pools name
    tags = {
        "corral.managed": "true",
        "corral.deployment": DEPLOYMENT,
        "corral.sandbox-id": "sb-made-by-hand",
        "corral.org-id": "acme",
    }
    credentials = (modal_cloud.token_id, modal_cloud.token_secret)
    with modal.Client(modal_cloud.server_url, api_pb2.CLIENT_TYPE_CLIENT, credentials) as client:
        app = modal.App.lookup(APP, create_if_missing=True, client=client)
        stray = modal.Sandbox.create(
            "sleep", "300", app=app, tags=tags, image=modal.Image.from_registry("x"), client=client
        )
    assert modal_cloud.sandbox(stray.object_id).result is None

    modal_stack.until(
        lambda: modal_cloud.sandbox(stray.object_id).result is not None,
        "the sweep to terminate the orphan sandbox",
    )
    log = modal_stack.log_path("maintenance")
    modal_stack.until(lambda: "terminated an orphan" in log.read_text(), "the orphan's end logged")
