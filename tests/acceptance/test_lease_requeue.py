"""A lease policy through real processes (api, scheduler, local provider worker, maintenance
and beat): a runner SIGKILLed after its claim loses its item, which its lease
(``on_heartbeat_lost: requeue``) sends back to routing; a new sandbox with a new token runs
it to success on attempt 2."""

from __future__ import annotations

import os
import signal
import uuid
from collections.abc import Iterator

import pytest
from sqlalchemy import select

from corral.shared.store.db import Database, make_engine
from corral.shared.store.models import LifecycleEvent, RegistrationToken, Sandbox
from tests.acceptance.conftest import shell
from tests.acceptance.stack import Stack, running_stack
from tests.processes import cmdline, descendants, supervisor_of

# The first attempt's work waits to be killed; the second one's runs at once.
WORK = 'case "$CORRAL_SANDBOX_ID" in *-1) sleep 300 ;; esac; echo "ran in $CORRAL_SANDBOX_ID"'


@pytest.fixture
def stack(postgres_database_url: str, redis_url: str) -> Iterator[Stack]:
    """A stack of the test's own whose runners count as lost after 5 s without a heartbeat
    (they heartbeat every second)."""
    with running_stack(postgres_database_url, redis_url, CORRAL_HEARTBEAT_TIMEOUT_S="5") as running:
        yield running


@pytest.fixture
def db(stack: Stack) -> Iterator[Database]:
    database = Database(make_engine(stack.database_url))
    yield database
    database.dispose()


def runner_of(stack: Stack, sandbox_id: str) -> int | None:
    """The pid of the runner in a local sandbox, once it runs."""
    try:
        supervisor, _ = supervisor_of(stack.sandbox_root, sandbox_id)
    except (FileNotFoundError, ValueError):  # its record is not written yet
        return None
    runners = [p.pid for p in descendants(supervisor) if "-m runner" in cmdline(p.pid)]
    return runners[0] if runners else None


def test_a_runner_killed_after_its_claim_is_requeued_and_its_item_succeeds_on_attempt_2(
    stack: Stack, db: Database
) -> None:
    org = stack.make_org(f"lease-{uuid.uuid4().hex[:8]}")
    lease = {"on_heartbeat_lost": "requeue", "max_attempts": 2}
    status, answer = stack.request("POST", "/v1/dispatch", shell(org, WORK, lease=lease))
    assert status == 202, answer
    item_id = answer["id"]
    first, second = (f"sb-{item_id.removeprefix('wi-')}-{n}" for n in (1, 2))
    stack.until(
        lambda: stack.request("GET", f"/v1/work-items/{item_id}")[1]["state"] == "running",
        "the first runner to claim the item",
    )
    runner = stack.until(lambda: runner_of(stack, first), "the first sandbox's runner process")

    os.kill(runner, signal.SIGKILL)
    [view] = stack.wait_final([item_id], timeout_s=120)

    assert (view["state"], view["attempts"], view["sandbox"]["id"]) == ("succeeded", 2, second)
    assert view["lease"]["on_heartbeat_lost"] == "requeue"
    _, logs = stack.request("GET", f"/v1/work-items/{item_id}/logs")
    assert f"ran in {second}" in [line["line"] for line in logs["lines"]]
    with db.session() as session:
        ended = session.get_one(Sandbox, first)
        tokens = dict(
            session.execute(
                select(RegistrationToken.sandbox_id, RegistrationToken.token_hash).where(
                    RegistrationToken.work_item_id == item_id
                )
            ).all()
        )
        requeued = session.scalars(
            select(LifecycleEvent.detail).where(
                LifecycleEvent.work_item_id == item_id,
                LifecycleEvent.entity == "work_item",
                LifecycleEvent.to_state == "received",
                LifecycleEvent.from_state == "running",
            )
        ).all()
    # Lost either way the reaper saw it first: the heartbeat stopped, or the sandbox ended.
    assert ended.termination_reason in ("heartbeat_lost", "sandbox_lost")
    assert ended.terminated_at is not None
    assert set(tokens) == {first, second} and tokens[first] != tokens[second]
    assert len(requeued) == 1 and requeued[0] is not None
    assert requeued[0].startswith("requeued: attempt 1 ended")
