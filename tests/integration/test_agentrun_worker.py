"""The code-interpreter worker path on real PostgreSQL with the agentrun provider (its real
SDK against the AgentRun stand-in on loopback): a code item routed to an agentrun pool ends
succeeded with its result and logs, a failing one failed with its exit code, one past the
limit as work_timeout; a shell item is never routed there; every sandbox gets exactly one
cost event; and a task delivered again never runs the code twice."""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import func, select

from corral.providers.agentrun import AgentRunProvider
from corral.providers.credentials import CredentialResolver
from corral.scheduler.admin.pools import ProfileCreate, create_profile
from corral.scheduler.intake import accept, route_item
from corral.shared.messages import DispatchRequest
from corral.shared.runtime import Runtime
from corral.shared.settings import CoreSettings
from corral.shared.store.db import Database, make_engine
from corral.shared.store.models import (
    AuthMode,
    CostEvent,
    ItemState,
    LifecycleEvent,
    Pool,
    Sandbox,
    WorkItem,
    WorkItemLog,
)
from corral.worker.provision import Outcome, RetryLater, provision_item
from tests.standins.agentrun import ACCESS_KEY_ID, ACCESS_KEY_SECRET, ACCOUNT_ID, AgentRunStandin

SQUARE = "def main(n):\n    print('squaring', n)\n    return {'square': n * n}\n"


@dataclass
class World:
    db: Database
    rt: Runtime
    standin: AgentRunStandin

    def dispatch(self, work: dict[str, Any], **fields: Any) -> tuple[str, str | None]:
        request = DispatchRequest.model_validate(
            {"org": "acme", "project": "web", "profile": "default", "work": work, **fields}
        )
        item_id = accept(self.db, request, actor="test").item_id
        return item_id, route_item(self.db, item_id, actor="test", settings=self.rt.settings).queue

    def item(self, item_id: str) -> WorkItem:
        with self.db.session() as session:
            item = session.get_one(WorkItem, item_id)
            session.expunge(item)
            return item

    def sandboxes(self, item_id: str) -> list[Sandbox]:
        with self.db.session() as session:
            rows = list(session.scalars(select(Sandbox).where(Sandbox.work_item_id == item_id)))
            session.expunge_all()
            return rows

    def logs(self, item_id: str) -> list[tuple[str, str]]:
        with self.db.session() as session:
            rows = session.execute(
                select(WorkItemLog.stream, WorkItemLog.line)
                .where(WorkItemLog.work_item_id == item_id)
                .order_by(WorkItemLog.id)
            ).all()
        return [(stream, line) for stream, line in rows]

    def cost_events(self, sandbox_id: str) -> int:
        with self.db.session() as session:
            count = session.scalar(
                select(func.count())
                .select_from(CostEvent)
                .where(CostEvent.sandbox_id == sandbox_id)
            )
        return int(count or 0)


@pytest.fixture
def world(fresh_pg_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[World]:
    for name in list(os.environ):
        if name.startswith(("AGENTRUN_", "ALIBABA_CLOUD_", "FC_", "CORRAL_AGENTRUN")):
            monkeypatch.delenv(name)
    settings = CoreSettings(state_dir=tmp_path, db_pool_size=4)
    db = Database(make_engine(fresh_pg_url, settings=settings))
    create_profile(db, ProfileCreate(name="default", model="m", auth_mode=AuthMode.BYOK))
    with db.session() as session:
        session.add(
            Pool(
                id="pool-agentrun",
                org_id="acme",
                name="interpreter",
                provider_id="agentrun",
                max_concurrent=10,
                sandbox_config={},
                rate_micros=2000,
            )
        )
    with AgentRunStandin() as standin:
        provider = AgentRunProvider({"data_endpoint": standin.endpoint, "account_id": ACCOUNT_ID})
        key = f"{ACCESS_KEY_ID}:{ACCESS_KEY_SECRET}"
        provider.use_credentials(CredentialResolver(environ={"CORRAL_AGENTRUN_API_KEY": key}))
        rt = Runtime(settings=settings, db=db)
        rt.use_provider(provider)
        yield World(db, rt, standin)
    db.dispose()


def code(source: str, **arguments: Any) -> dict[str, Any]:
    return {"kind": "code", "code": source, "arguments": arguments}


def test_a_code_item_at_an_agentrun_pool_ends_succeeded_with_result_and_logs(
    world: World,
) -> None:
    item_id, queue = world.dispatch(code(SQUARE, n=12))
    assert queue == "provision.agentrun"
    assert provision_item(world.rt, item_id, actor="worker:t") is Outcome.RAN
    item = world.item(item_id)
    assert (item.state, item.exit_code, item.result) == ("succeeded", 0, {"square": 144})
    assert ("stdout", "squaring 12") in world.logs(item_id)
    [sandbox] = world.sandboxes(item_id)
    assert (sandbox.status, sandbox.termination_reason) == ("terminated", "finished")
    assert sandbox.external_id == sandbox.id  # the AgentRun sandbox is named by corral's id
    assert world.cost_events(sandbox.id) == 1
    assert world.standin.live() == []
    with world.db.session() as session:
        moves = session.execute(
            select(LifecycleEvent.from_state, LifecycleEvent.to_state)
            .where(LifecycleEvent.entity == "work_item", LifecycleEvent.work_item_id == item_id)
            .order_by(LifecycleEvent.id)
        ).all()
    assert [tuple(move) for move in moves][-3:] == [
        ("routed", "provisioning"),
        ("provisioning", "running"),
        ("running", "succeeded"),
    ]


def test_a_failing_code_item_fails_with_its_exit_code(world: World) -> None:
    item_id, _ = world.dispatch(code("def main():\n    return 1 / 0\n"))
    assert provision_item(world.rt, item_id, actor="worker:t") is Outcome.RAN
    item = world.item(item_id)
    assert (item.state, item.exit_code, item.error_code) == ("failed", 1, "work_failed")
    assert item.error_message == "main() raised ZeroDivisionError: division by zero"
    assert any(
        "ZeroDivisionError" in line for stream, line in world.logs(item_id) if stream == "stderr"
    )
    [sandbox] = world.sandboxes(item_id)
    assert world.cost_events(sandbox.id) == 1


def test_code_past_its_limit_fails_as_work_timeout(world: World) -> None:
    item_id, _ = world.dispatch(
        code("import time\ndef main():\n    time.sleep(30)\n"), resources={"timeout_s": 1}
    )
    assert provision_item(world.rt, item_id, actor="worker:t") is Outcome.RAN
    item = world.item(item_id)
    assert (item.state, item.error_code) == ("failed", "work_timeout")
    [sandbox] = world.sandboxes(item_id)
    assert world.cost_events(sandbox.id) == 1 and world.standin.live() == []


def test_a_shell_item_is_not_routed_to_an_agentrun_pool(world: World) -> None:
    item_id, queue = world.dispatch({"kind": "shell", "command": "echo hi"})
    item = world.item(item_id)
    assert queue is None and item.state == ItemState.DISPATCH_ERROR
    assert "work of kind shell" in (item.error_message or "")
    assert world.sandboxes(item_id) == [] and world.standin.requests == []


def test_a_throttled_create_is_retried_and_the_code_runs_once(world: World) -> None:
    item_id, _ = world.dispatch(code(SQUARE, n=3))
    world.standin.fail_next(429, path_contains="/sandboxes", method="POST")
    with pytest.raises(RetryLater):
        provision_item(world.rt, item_id, actor="worker:t")
    assert world.item(item_id).state == "provisioning"
    assert provision_item(world.rt, item_id, actor="worker:t") is Outcome.RAN
    assert world.item(item_id).result == {"square": 9}
    assert world.standin.executions() == 1
    [sandbox] = world.sandboxes(item_id)
    assert world.cost_events(sandbox.id) == 1


def test_an_error_after_the_execute_call_fails_the_item_and_a_redelivery_runs_nothing(
    world: World,
) -> None:
    item_id, _ = world.dispatch(code(SQUARE, n=3))
    world.standin.fail_next(502, path_contains="/contexts/execute")
    assert provision_item(world.rt, item_id, actor="worker:t") is Outcome.FAILED
    item = world.item(item_id)
    assert (item.state, item.error_code) == ("failed", "execution_outcome_unknown")
    assert provision_item(world.rt, item_id, actor="worker:t") is Outcome.SKIPPED
    assert world.standin.executions() == 1
    [sandbox] = world.sandboxes(item_id)
    assert world.cost_events(sandbox.id) == 1


def test_a_refused_credential_fails_the_item_naming_the_credential(world: World) -> None:
    item_id, _ = world.dispatch(code(SQUARE, n=3))
    world.standin.fail_next(403, path_contains="/sandboxes", method="POST")
    assert provision_item(world.rt, item_id, actor="worker:t") is Outcome.FAILED_OVER
    # Its one pool failed it: routing finds no other to fail over to.
    routed = route_item(world.db, item_id, actor="test", settings=world.rt.settings)
    assert routed.state.value == "failed"
    item = world.item(item_id)
    assert item.error_code == "credential_rejected"
    assert "corral credentials set --org acme --provider agentrun" in (item.error_message or "")
    assert world.standin.executions() == 0
    [sandbox] = world.sandboxes(item_id)
    assert world.cost_events(sandbox.id) == 1
