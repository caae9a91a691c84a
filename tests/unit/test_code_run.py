"""The code-interpreter transport's worker path on SQLite, with the in-memory code
interpreter (which really runs the wrapped code in a local Python): the outcome recorded as
a runner's completion would be, the token never used, retries only before the execute call,
and no item ever run twice."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest
from sqlalchemy import select

from corral.providers.testing import InMemoryCodeInterpreter
from corral.scheduler.admin.pools import ProfileCreate, create_profile
from corral.scheduler.intake import accept, route_item
from corral.shared.messages import DispatchRequest
from corral.shared.runtime import Runtime
from corral.shared.settings import CoreSettings
from corral.shared.store import secrets
from corral.shared.store.db import Database
from corral.shared.store.lifecycle import transition
from corral.shared.store.models import (
    AuthMode,
    CostEvent,
    ItemState,
    Pool,
    RegistrationToken,
    Sandbox,
    WorkItem,
    WorkItemLog,
)
from corral.worker.provision import Outcome, RetryLater, provision_item

ADD = (
    "import sys\n"
    "def main(a, b):\n"
    "    print('adding', a, b)\n"
    "    print('to stderr', file=sys.stderr)\n"
    "    return {'sum': a + b}\n"
)
RAISES = "def main():\n    raise ValueError('no such thing')\n"


@pytest.fixture
def provider() -> InMemoryCodeInterpreter:
    return InMemoryCodeInterpreter()


@pytest.fixture
def rt(sqlite_db: Database, provider: InMemoryCodeInterpreter, tmp_path) -> Iterator[Runtime]:  # type: ignore[no-untyped-def]
    runtime = Runtime(settings=CoreSettings(state_dir=tmp_path), db=sqlite_db)
    runtime.use_provider(provider)
    create_profile(sqlite_db, ProfileCreate(name="default", model="m", auth_mode=AuthMode.BYOK))
    with sqlite_db.session() as session:
        session.add(
            Pool(
                id="pool-code",
                org_id="acme",
                name="code",
                provider_id="in-memory-code",
                max_concurrent=10,
                sandbox_config={},
                rate_micros=1000,
            )
        )
    yield runtime


def routed(rt: Runtime, work: dict[str, object], **fields: object) -> str:
    request = DispatchRequest.model_validate(
        {"org": "acme", "project": "web", "profile": "default", "work": work, **fields}
    )
    item_id = accept(rt.db, request, actor="test").item_id
    assert (
        route_item(rt.db, item_id, actor="test", settings=rt.settings).queue
        == "provision.in-memory-code"
    )
    return item_id


def code(source: str, **arguments: object) -> dict[str, object]:
    return {"kind": "code", "code": source, "arguments": arguments}


def state(rt: Runtime, item_id: str) -> tuple[WorkItem, list[Sandbox], list[tuple[str, str]]]:
    with rt.db.session() as session:
        item = session.get_one(WorkItem, item_id)
        sandboxes = list(session.scalars(select(Sandbox).where(Sandbox.work_item_id == item_id)))
        logs = session.execute(
            select(WorkItemLog.stream, WorkItemLog.line)
            .where(WorkItemLog.work_item_id == item_id)
            .order_by(WorkItemLog.id)
        ).all()
        session.expunge_all()
    return item, sandboxes, [tuple(row) for row in logs]  # type: ignore[misc]


def cost_events(rt: Runtime, sandbox_id: str) -> int:
    with rt.db.session() as session:
        return len(
            list(session.scalars(select(CostEvent).where(CostEvent.sandbox_id == sandbox_id)))
        )


def test_a_code_item_ends_succeeded_with_its_result_logs_and_one_cost_event(
    rt: Runtime, provider: InMemoryCodeInterpreter
) -> None:
    item_id = routed(rt, code(ADD, a=2, b=3), env={"GREETING": "hi"})
    assert provision_item(rt, item_id, actor="worker:t") is Outcome.RAN
    item, [sandbox], logs = state(rt, item_id)
    assert (item.state, item.exit_code, item.result) == ("succeeded", 0, {"sum": 5})
    assert item.claimed_at is not None and item.finished_at is not None
    assert ("stdout", "adding 2 3") in logs and ("stderr", "to stderr") in logs
    assert not any("__corral_result_" in line for _, line in logs)  # the marker line is taken out
    assert logs[0] == ("system", "work: python code, main(**arguments), at in-memory-code")
    assert (sandbox.status, sandbox.termination_reason) == ("terminated", "finished")
    assert sandbox.external_id == sandbox.id and sandbox.started_at is not None
    assert cost_events(rt, sandbox.id) == 1
    assert provider.boxes == {}  # ended after the run
    assert provider.executed == [sandbox.id]
    with rt.db.session() as session:
        token = session.scalars(select(RegistrationToken)).one()
        assert token.redeemed_at is not None  # revoked at once: no runner will redeem it


def test_the_work_env_reaches_the_code_and_corrals_control_variables_do_not(
    rt: Runtime,
) -> None:
    source = (
        "import os\ndef main():\n"
        "    return {k: os.environ.get(k) for k in "
        "('GREETING', 'CORRAL_REGISTRATION_TOKEN', 'CORRAL_CONTROL_URL')}\n"
    )
    item_id = routed(rt, code(source), env={"GREETING": "hi"})
    provision_item(rt, item_id, actor="worker:t")
    item, _, _ = state(rt, item_id)
    assert item.result == {
        "GREETING": "hi",
        "CORRAL_REGISTRATION_TOKEN": None,
        "CORRAL_CONTROL_URL": None,
    }


def test_a_failing_code_item_fails_with_its_exit_code_and_the_error(rt: Runtime) -> None:
    item_id = routed(rt, code(RAISES))
    assert provision_item(rt, item_id, actor="worker:t") is Outcome.RAN
    item, [sandbox], logs = state(rt, item_id)
    assert (item.state, item.exit_code, item.error_code) == ("failed", 1, "work_failed")
    assert item.error_message == "main() raised ValueError: no such thing"
    assert any(s == "stderr" and "ValueError: no such thing" in line for s, line in logs)
    assert sandbox.status == "terminated"
    assert cost_events(rt, sandbox.id) == 1


def test_failing_code_is_run_again_on_a_new_sandbox_when_its_lease_retries(rt: Runtime) -> None:
    item_id = routed(rt, code(RAISES), lease={"retry_on_work_failed": True, "max_attempts": 2})
    assert provision_item(rt, item_id, actor="worker:t") is Outcome.RAN
    item, [first], _ = state(rt, item_id)
    assert (item.state, item.error_code, item.attempts) == ("received", None, 1)
    assert (first.status, cost_events(rt, first.id)) == ("terminated", 1)

    assert (
        route_item(rt.db, item_id, actor="test", settings=rt.settings).queue
        == "provision.in-memory-code"
    )
    assert provision_item(rt, item_id, actor="worker:t") is Outcome.RAN

    item, sandboxes, _ = state(rt, item_id)
    assert (item.state, item.error_code, item.attempts) == ("failed", "work_failed", 2)
    assert item.error_message == "main() raised ValueError: no such thing; gave up after 2 attempts"
    assert sorted(sandbox.attempt for sandbox in sandboxes) == [1, 2]


def test_code_past_its_time_limit_fails_as_work_timeout(rt: Runtime) -> None:
    source = "import time\ndef main():\n    print('started', flush=True)\n    time.sleep(30)\n"
    item_id = routed(rt, code(source), resources={"timeout_s": 1})
    assert provision_item(rt, item_id, actor="worker:t") is Outcome.RAN
    item, [sandbox], _ = state(rt, item_id)
    assert (item.state, item.error_code, item.exit_code) == ("failed", "work_timeout", 124)
    assert "time limit of 1 s" in (item.error_message or "")
    assert cost_events(rt, sandbox.id) == 1


def test_a_transient_error_before_the_execute_call_is_retried_and_runs_once(
    rt: Runtime, provider: InMemoryCodeInterpreter
) -> None:
    item_id = routed(rt, code(ADD, a=1, b=1))
    provider.fail_transiently(1)
    with pytest.raises(RetryLater):
        provision_item(rt, item_id, actor="worker:t")
    item, [sandbox], _ = state(rt, item_id)
    assert (item.state, sandbox.lease_until, provider.executed) == ("provisioning", None, [])
    assert provision_item(rt, item_id, actor="worker:t") is Outcome.RAN
    item, [sandbox], _ = state(rt, item_id)
    assert (item.state, item.result) == ("succeeded", {"sum": 2})
    assert provider.executed == [sandbox.id]
    assert cost_events(rt, sandbox.id) == 1


def test_an_error_after_the_execute_call_fails_the_item_and_is_never_retried(
    rt: Runtime, provider: InMemoryCodeInterpreter
) -> None:
    item_id = routed(rt, code(ADD, a=1, b=1))
    provider.fail_after_execute("the connection broke during execute")
    assert provision_item(rt, item_id, actor="worker:t") is Outcome.FAILED
    item, [sandbox], _ = state(rt, item_id)
    assert (item.state, item.error_code) == ("failed", "execution_outcome_unknown")
    assert item.error_message == "the connection broke during execute"
    assert sandbox.status == "failed" and sandbox.terminated_at is not None
    # A redelivery of the task finds the item ended: the code is not executed again.
    assert provision_item(rt, item_id, actor="worker:t") is Outcome.SKIPPED
    assert provider.executed == [sandbox.id]
    assert cost_events(rt, sandbox.id) == 1


def test_a_redelivery_while_the_code_runs_does_not_run_it_again(
    rt: Runtime, provider: InMemoryCodeInterpreter
) -> None:
    item_id = routed(rt, code(ADD, a=4, b=4))
    provider.block_execute()
    with ThreadPoolExecutor(1) as pool:
        first = pool.submit(provision_item, rt, item_id, actor="worker:a")
        deadline = time.monotonic() + 10
        while state(rt, item_id)[0].state != "running":
            assert time.monotonic() < deadline, "the execute call was never reached"
            time.sleep(0.01)
        assert provision_item(rt, item_id, actor="worker:b") is Outcome.ALREADY_PROVISIONED
        provider.unblock_execute()
        assert first.result(30) is Outcome.RAN
    item, [sandbox], _ = state(rt, item_id)
    assert (item.state, item.result) == ("succeeded", {"sum": 8})
    assert provider.executed == [sandbox.id]


def test_a_shell_item_at_a_code_interpreter_fails_without_running_anything(
    rt: Runtime, provider: InMemoryCodeInterpreter
) -> None:
    item_id = routed(rt, {"kind": "shell", "command": "echo hi"})
    assert provision_item(rt, item_id, actor="worker:t") is Outcome.FAILED
    item, [sandbox], _ = state(rt, item_id)
    assert (item.state, item.error_code) == ("failed", "unsupported_work")
    assert "runs python code work items only" in (item.error_message or "")
    assert provider.methods() == [] and provider.executed == []
    assert sandbox.status == "failed"


def test_a_javascript_item_at_a_code_interpreter_fails_without_running_anything(
    rt: Runtime, provider: InMemoryCodeInterpreter
) -> None:
    # Routing never sends one (the matrix's code_languages and its substrate without
    # node); should one arrive (a pool changed after routing), the worker refuses it.
    item_id = routed(rt, code(ADD, a=1, b=2))
    with rt.db.session() as session:
        item = session.get_one(WorkItem, item_id)
        item.payload = {**item.payload, "work": {**item.payload["work"], "language": "javascript"}}
    assert provision_item(rt, item_id, actor="worker:t") is Outcome.FAILED
    item, _, _ = state(rt, item_id)
    assert (item.state, item.error_code) == ("failed", "unsupported_work")
    assert "not javascript code" in (item.error_message or "")
    assert provider.executed == []


def test_an_item_cancelled_before_the_execute_call_is_not_executed(
    rt: Runtime, provider: InMemoryCodeInterpreter
) -> None:
    item_id = routed(rt, code(ADD, a=1, b=2))
    cancelled = threading.Event()
    original = provider.run_code

    def cancel_then_run(*args, **kwargs):  # type: ignore[no-untyped-def]
        with rt.db.session() as session:
            transition(session, session.get_one(WorkItem, item_id), ItemState.CANCELLED, actor="t")
        cancelled.set()
        return original(*args, **kwargs)

    provider.run_code = cancel_then_run  # type: ignore[method-assign]
    assert provision_item(rt, item_id, actor="worker:t") is Outcome.SKIPPED
    item, [sandbox], _ = state(rt, item_id)
    assert cancelled.is_set() and item.state == "cancelled"
    assert provider.executed == [] and provider.boxes == {}
    assert (sandbox.status, sandbox.termination_reason) == ("terminated", "cancelled")
    assert cost_events(rt, sandbox.id) == 1


def test_a_code_interpreter_gets_secret_env_as_it_runs_and_a_deleted_one_fails_the_item(
    rt: Runtime, provider: InMemoryCodeInterpreter
) -> None:
    reads = code("import os\ndef main():\n    return {'token': os.environ['TOKEN'][::-1]}\n")
    secrets.set_secret(rt.db, "acme", "api-token", "named-4711")
    item_id = routed(rt, reads, secret_env={"TOKEN": "api-token"})
    gone_id = routed(rt, reads, secret_env={"TOKEN": "api-token"})

    assert provision_item(rt, item_id, actor="test") is Outcome.RAN
    item, _, _ = state(rt, item_id)
    assert (item.state, item.result) == ("succeeded", {"token": "1174-deman"})
    with rt.db.session() as session:
        assert [u["target"] for u in secrets.uses_of(session, item_id)] == ["TOKEN"]

    secrets.delete_secret(rt.db, "acme", "api-token")
    assert provision_item(rt, gone_id, actor="test") is Outcome.FAILED
    gone, _, _ = state(rt, gone_id)
    assert (gone.state, gone.error_code) == ("failed", "unknown_secret")
    assert "secret_env.TOKEN" in (gone.error_message or "")
    assert len(provider.executed) == 1  # the first item alone: never run without it


def test_a_code_interpreter_runs_the_code_with_the_items_model_profile(
    rt: Runtime, provider: InMemoryCodeInterpreter
) -> None:
    reads = code(
        "import os\ndef main():\n"
        "    return [os.environ.get(n) for n in "
        "('CORRAL_MODEL', 'CORRAL_PROFILE', 'CORRAL_AUTH_MODE')]\n"
    )
    item_id = routed(rt, reads)
    assert provision_item(rt, item_id, actor="test") is Outcome.RAN
    item, _, _ = state(rt, item_id)
    assert (item.state, item.result) == ("succeeded", ["m", "default", "byok"])
