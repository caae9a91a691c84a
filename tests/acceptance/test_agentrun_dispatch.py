"""Code items routed to an agentrun pool, through real processes (api, scheduler, a
``corral worker --provider agentrun``, maintenance and beat) and the official agentrun-sdk,
against the AgentRun stand-in on loopback, which really executes the code: no runner dials
in; the provider worker records the outcome."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from sqlalchemy import func, select

from corral.shared.store.db import Database, make_engine
from corral.shared.store.models import CostEvent, Sandbox
from tests.acceptance.conftest import shell
from tests.acceptance.stack import Stack
from tests.standins.agentrun import ACCESS_KEY_ID, ACCESS_KEY_SECRET, ACCOUNT_ID, AgentRunStandin

STATS = (
    "import statistics\n"
    "def main(values):\n"
    "    print('n =', len(values))\n"
    "    return {'mean': statistics.mean(values), 'max': max(values)}\n"
)


@pytest.fixture(scope="module")
def interpreter() -> Iterator[AgentRunStandin]:
    with AgentRunStandin() as standin:
        yield standin


@pytest.fixture(scope="module")
def agentrun_stack(
    interpreter: AgentRunStandin, postgres_database_url: str, redis_url: str
) -> Iterator[Stack]:
    running = Stack(
        database_url=postgres_database_url,
        broker_url=redis_url,
        provider_config={
            "agentrun": {"data_endpoint": interpreter.endpoint, "account_id": ACCOUNT_ID}
        },
        # The deployment-wide credential; nothing of Aliyun's own variables is needed.
        extra_env={
            "CORRAL_AGENTRUN_API_KEY": f"{ACCESS_KEY_ID}:{ACCESS_KEY_SECRET}",
            "AGENTRUN_ACCESS_KEY_ID": "",
            "AGENTRUN_ACCESS_KEY_SECRET": "",
            "AGENTRUN_DATA_ENDPOINT": "",
        },
    )
    try:
        running.start_only(["api", "scheduler", "worker-agentrun", "maintenance", "beat"])
        yield running
    finally:
        running.stop()


def _org(stack: Stack) -> str:
    org = f"ar-{uuid.uuid4().hex[:6]}"
    for path, body in (
        ("/v1/admin/profiles", {"name": "default", "model": "m", "auth_mode": "byok"}),
        (
            "/v1/admin/pools",
            {"org_id": org, "name": "interpreter", "provider_id": "agentrun", "max_concurrent": 4},
        ),
    ):
        status, answer = stack.request("POST", path, body)
        assert status in (201, 409), answer
    return org


def _code(org: str, source: str, **arguments: Any) -> dict[str, Any]:
    return {
        "org": org,
        "project": "web",
        "profile": "default",
        "work": {"kind": "code", "code": source, "arguments": arguments},
    }


def _cost_events(database_url: str, item_id: str) -> int:
    db = Database(make_engine(database_url))
    try:
        with db.session() as session:
            count = session.scalar(
                select(func.count())
                .select_from(CostEvent)
                .join(Sandbox, Sandbox.id == CostEvent.sandbox_id)
                .where(Sandbox.work_item_id == item_id)
            )
        return int(count or 0)
    finally:
        db.dispose()


def test_code_items_run_at_agentrun_and_end_with_their_results(
    agentrun_stack: Stack, interpreter: AgentRunStandin
) -> None:
    org = _org(agentrun_stack)
    submitted = {}
    for name, body in (
        ("ok", _code(org, STATS, values=[3, 5, 10])),
        ("fails", _code(org, "def main():\n    raise RuntimeError('bad input')\n")),
    ):
        status, answer = agentrun_stack.request("POST", "/v1/dispatch", body)
        assert status == 202, answer
        submitted[name] = answer["id"]
    ok, fails = agentrun_stack.wait_final([submitted["ok"], submitted["fails"]], timeout_s=90)

    assert ok["state"] == "succeeded", ok
    assert (ok["exit_code"], ok["result"]) == (0, {"mean": 6, "max": 10})
    assert ok["queue"] == "provision.agentrun"
    status, logs = agentrun_stack.request("GET", f"/v1/work-items/{submitted['ok']}/logs")
    assert status == 200
    lines = [(line["stream"], line["line"]) for line in logs["lines"]]
    assert ("stdout", "n = 3") in lines
    assert not any("__corral_result_" in text for _, text in lines)  # the marker line is not

    assert fails["state"] == "failed", fails
    assert fails["exit_code"] == 1
    assert fails["error"] == {
        "code": "work_failed",
        "message": "main() raised RuntimeError: bad input",
    }

    for item_id in submitted.values():
        assert _cost_events(agentrun_stack.database_url, item_id) == 1
    # Every sandbox was deleted; no registration token ever reached AgentRun.
    agentrun_stack.until(lambda: interpreter.live() == [], "the sandboxes to be deleted")
    assert not any("crt_" in repr(request) for request in interpreter.requests)


def test_a_shell_item_is_never_routed_to_an_agentrun_pool(agentrun_stack: Stack) -> None:
    org = _org(agentrun_stack)
    status, answer = agentrun_stack.request("POST", "/v1/dispatch", shell(org, "echo hi"))
    assert status in (202, 422), answer
    if status == 202:
        [view] = agentrun_stack.wait_final([answer["id"]], timeout_s=60)
        assert view["state"] == "dispatch_error", view
        assert "work of kind shell" in view["error"]["message"]
    else:
        assert "work of kind shell" in str(answer)
