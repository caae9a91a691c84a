"""The reaper on real PostgreSQL and Redis, with the in-memory provider: every rule, the
requeue, the sweep lock, and exactly one cost event per sandbox.

Each test has a database of its own (the sweep reads every row). Time passing is made by
moving a sandbox's timestamps into the past: the rules compare timestamps, nothing else.
"""

from __future__ import annotations

import logging
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import REGISTRY
from sqlalchemy import func, select, text
from sqlalchemy.exc import IntegrityError

from corral.providers.base import SandboxHandle, SandboxSpec
from corral.providers.errors import ProviderUnavailableError
from corral.providers.testing import InMemoryProvider
from corral.scheduler.intake import accept, route_item
from corral.shared.messages import DispatchRequest
from corral.shared.store.db import utcnow
from corral.shared.store.models import (
    CostEvent,
    Pool,
    Sandbox,
    TerminationReason,
)
from corral.worker.provision import Outcome, RetryLater, provision_item
from corral.worker.reaper import SweepReport, find_stale, sweep
from corral.worker.sweep_lock import SweepLock
from corral.worker.termination import end_sandbox
from tests.integration.reaping import RATE, Reaped, reaped_world


@pytest.fixture
def reaped(fresh_pg_url: str, redis_url: str, tmp_path: Path) -> Iterator[Reaped]:
    with reaped_world(fresh_pg_url, redis_url, tmp_path, InMemoryProvider()) as world:
        yield world


# -- each rule ----------------------------------------------------------------------------


def test_finished_a_sandbox_left_running_after_its_work_reported_is_ended(
    reaped: Reaped,
) -> None:
    item_id = reaped.dispatch()
    headers = reaped.claim(item_id)
    done = reaped.api.post("/v1/runner/complete", headers=headers, json={"exit_code": 0})
    assert done.json() == {"state": "succeeded"}
    sandbox = reaped.sandbox(item_id)
    # The corral.terminate the api sent was never delivered (the broker here is in memory).
    assert reaped.sweep().ended == {}  # within the grace period: the normal path's turn
    reaped.backdate(sandbox.id, end_requested_at=10)

    report = reaped.sweep()

    assert report.ended == {"finished": 1}
    ended = reaped.sandbox(item_id)
    assert (ended.status, ended.termination_reason) == ("terminated", "finished")
    assert sandbox.id not in reaped.provider.boxes
    assert reaped.item(item_id).state == "succeeded"  # untouched
    assert len(reaped.costs(sandbox.id)) == 1


def test_deadline_a_sandbox_past_its_timeout_is_ended_and_its_claimed_item_fails(
    reaped: Reaped,
) -> None:
    item_id = reaped.dispatch(resources={"timeout_s": 120})
    reaped.claim(item_id)
    sandbox = reaped.sandbox(item_id)
    assert sandbox.deadline_at is not None and sandbox.started_at is not None
    assert sandbox.deadline_at - sandbox.started_at == timedelta(seconds=120)
    assert reaped.sweep().ended == {}
    reaped.backdate(sandbox.id, started_at=121, deadline_at=1)

    report = reaped.sweep()

    assert report.ended == {"deadline": 1} and report.failed == [item_id]
    assert reaped.sandbox(item_id).termination_reason == "deadline"
    item = reaped.item(item_id)
    assert (item.state, item.error_code) == ("failed", "deadline")
    assert item.error_message == "it ran past its deadline (120 s after start)"
    assert reaped.terminate_calls()[sandbox.id] == 1


def test_without_a_timeout_the_deadline_is_the_pools_max_session_length(
    reaped: Reaped,
) -> None:
    # (Routing already refuses work whose timeout_s is longer than the pool's sessions.)
    with reaped.db.session() as session:
        session.get_one(Pool, "pool-in-memory").capabilities = {"max_session_duration_seconds": 30}
    item_id = reaped.dispatch()
    sandbox = reaped.sandbox(item_id)
    assert sandbox.deadline_at is not None and sandbox.started_at is not None
    assert sandbox.deadline_at - sandbox.started_at == timedelta(seconds=30)


def test_heartbeat_lost_a_silent_claimed_sandbox_is_ended_and_its_item_fails(
    reaped: Reaped,
) -> None:
    item_id = reaped.dispatch()
    headers = reaped.claim(item_id)
    sandbox = reaped.sandbox(item_id)
    reaped.backdate(sandbox.id, last_heartbeat_at=61)
    # A heartbeat in time keeps it: the rule reads the newest heartbeat.
    assert reaped.api.post("/v1/runner/heartbeat", headers=headers).status_code == 200
    assert reaped.sweep().ended == {}
    reaped.backdate(sandbox.id, last_heartbeat_at=61)

    report = reaped.sweep()

    assert report.ended == {"heartbeat_lost": 1}
    item = reaped.item(item_id)
    assert (item.state, item.error_code) == ("failed", "heartbeat_lost")
    assert item.error_message == "no heartbeat from its runner for 60 s"
    assert reaped.sandbox(item_id).termination_reason == "heartbeat_lost"


def test_never_claimed_requeues_and_the_item_succeeds_on_its_second_sandbox(
    reaped: Reaped,
) -> None:
    item_id = reaped.dispatch()
    first = reaped.sandbox(item_id)
    reaped.backdate(first.id, started_at=601)

    report = reaped.sweep()

    assert report.ended == {"never_claimed": 1} and report.requeued == [item_id]
    assert reaped.item(item_id).state == "received"
    assert first.id not in reaped.provider.boxes
    # What corral.reaper.sweep sends next: route it again; it gets a second sandbox.
    reaped.route_and_provision(item_id)
    second = reaped.sandbox(item_id)
    assert (second.attempt, reaped.item(item_id).attempts) == (2, 2)
    headers = reaped.claim(item_id)
    done = reaped.api.post("/v1/runner/complete", headers=headers, json={"exit_code": 0})
    assert done.json() == {"state": "succeeded"}
    end_sandbox(reaped.rt, second.id, reason=reason("finished"), actor="test")  # the task's job

    assert reaped.item(item_id).state == "succeeded"
    assert reaped.sandbox(item_id, attempt=1).termination_reason == "never_claimed"
    assert reaped.sandbox(item_id, attempt=2).termination_reason == "finished"
    assert [c.sandbox_id for c in reaped.costs()] == [first.id, second.id]
    assert [c.termination_reason for c in reaped.costs()] == ["never_claimed", "finished"]


def test_an_item_out_of_attempts_fails_with_the_reason(reaped: Reaped) -> None:
    item_id = reaped.dispatch()
    for attempt in (1, 2):  # max_attempts is 2 here
        reaped.backdate(reaped.sandbox(item_id, attempt).id, started_at=601)
        report = reaped.sweep()
        assert report.ended == {"never_claimed": 1}
        if attempt == 1:
            assert report.requeued == [item_id]
            reaped.route_and_provision(item_id)

    assert report.requeued == [] and report.failed == [item_id]
    item = reaped.item(item_id)
    assert (item.state, item.error_code, item.attempts) == ("failed", "never_claimed", 2)
    assert item.error_message is not None
    assert item.error_message.endswith("; gave up after 2 attempts")
    assert len(reaped.costs()) == 2


def test_provision_stuck_ends_the_attempt_and_the_late_provision_leaves_nothing(
    reaped: Reaped,
) -> None:
    request = DispatchRequest.model_validate(
        {
            "org": "acme",
            "project": "web",
            "profile": "default",
            "work": {"kind": "shell", "command": "true"},
        }
    )
    item_id = accept(reaped.db, request, actor="test").item_id
    route_item(reaped.db, item_id, actor="test", settings=reaped.rt.settings)
    reaped.provider.hang()
    outcome: list[Outcome] = []
    worker = threading.Thread(
        target=lambda: outcome.append(provision_item(reaped.rt, item_id, actor="slow-worker"))
    )
    worker.start()
    try:
        sandbox = _wait_for_row(reaped, item_id)
        reaped.backdate(sandbox.id, created_at=901)
        report = reaped.sweep()
    finally:
        reaped.provider.release()
        worker.join(timeout=30)

    assert report.ended == {"provision_stuck": 1} and report.requeued == [item_id]
    assert reaped.sandbox(item_id).termination_reason == "provision_stuck"
    # The worker's late handle is refused (its lease was fenced) and it cleans up.
    assert outcome == [Outcome.SKIPPED]
    assert reaped.provider.boxes == {}
    assert reaped.item(item_id).state == "received"


def _wait_for_row(reaped: Reaped, item_id: str) -> Sandbox:
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        found = reaped.sandbox(item_id)
        if found is not None and any(c.method == "provision" for c in reaped.provider.calls):
            return found
        time.sleep(0.01)
    raise AssertionError("the provision never reached the provider")


def test_orphan_a_sandbox_the_database_does_not_know_is_terminated(
    reaped: Reaped, make_spec: Any
) -> None:
    known = reaped.dispatch()
    stray = reaped.provider.adopt(make_spec(sandbox_id="sb-made-by-hand"))

    report = reaped.sweep()

    assert report.orphans == ["sb-made-by-hand"] and report.ended == {"orphan": 1}
    assert stray.external_id not in reaped.provider.boxes
    assert reaped.sandbox(known).id in reaped.provider.boxes  # the known one stays


def test_orphan_a_sandbox_the_database_ended_is_terminated(reaped: Reaped, make_spec: Any) -> None:
    item_id = reaped.dispatch()
    sandbox = reaped.sandbox(item_id)
    end_sandbox(reaped.rt, sandbox.id, reason=reason("cancelled"), actor="test", kill=False)
    assert sandbox.id in reaped.provider.boxes  # as if the provider had missed the terminate

    report = reaped.sweep()

    assert report.orphans == [sandbox.id]
    assert sandbox.id not in reaped.provider.boxes
    assert len(reaped.costs(sandbox.id)) == 1  # billed when it ended, not again


def test_gone_is_marked_ended_without_a_terminate_and_requeued_before_the_claim(
    reaped: Reaped,
) -> None:
    waiting, running = reaped.dispatch(), reaped.dispatch()
    reaped.claim(running)
    for item_id in (waiting, running):
        reaped.provider.vanish(_handle(reaped.sandbox(item_id)))

    report = reaped.sweep()

    assert report.ended == {"gone": 2}
    assert report.requeued == [waiting] and report.failed == [running]
    for item_id in (waiting, running):
        sandbox = reaped.sandbox(item_id)
        assert (sandbox.status, sandbox.termination_reason) == ("failed", "gone")
        assert reaped.terminate_calls()[sandbox.id] == 0
    item = reaped.item(running)
    assert (item.state, item.error_code) == ("failed", "gone")
    assert item.error_message == "the provider no longer has it: sandbox no longer exists"


def test_a_sandbox_that_died_under_its_work_fails_the_item_and_is_cleaned_up(
    reaped: Reaped,
) -> None:
    item_id = reaped.dispatch()
    reaped.claim(item_id)
    sandbox = reaped.sandbox(item_id)
    reaped.provider.finish(_handle(sandbox), exit_code=137)

    report = reaped.sweep()

    assert report.ended == {"sandbox_lost": 1}
    item = reaped.item(item_id)
    assert (item.state, item.error_code) == ("failed", "sandbox_lost")
    assert item.error_message == "the sandbox ended before the work reported: exited with code 137"
    assert sandbox.id not in reaped.provider.boxes


def test_healthy_sandboxes_are_left_alone(reaped: Reaped) -> None:
    waiting = reaped.dispatch(resources={"timeout_s": 600})
    running = reaped.dispatch(resources={"timeout_s": 600})
    reaped.claim(running)

    report = reaped.sweep()

    assert (report.ended, report.orphans, report.errors) == ({}, [], 0)
    assert {reaped.sandbox(waiting).status, reaped.sandbox(running).status} == {"ready", "running"}
    assert reaped.terminate_calls() == Counter()


# -- one at a time, once each -------------------------------------------------------------


def _race(reaped: Reaped, locks: list[SweepLock]) -> list[SweepReport]:
    start = threading.Barrier(len(locks))
    reports: list[SweepReport] = []

    def run(lock: SweepLock) -> None:
        start.wait()
        reports.append(sweep(reaped.rt, lock))

    threads = [threading.Thread(target=run, args=(lock,)) for lock in locks]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    return reports


def test_two_sweeps_started_at_once_end_and_bill_each_sandbox_once(
    reaped: Reaped, caplog: pytest.LogCaptureFixture
) -> None:
    stale = reaped.stale(12)

    with caplog.at_level(logging.INFO, logger="corral.worker.reaper"):
        reports = _race(reaped, [reaped.lock(), reaped.lock()])

    assert sorted(r.skipped for r in reports) == [False, True]
    assert "reaper sweep skipped: another sweep holds the lock" in caplog.messages
    ran = next(r for r in reports if not r.skipped)
    assert ran.ended == {"never_claimed": 12}
    assert all(reaped.terminate_calls()[s] == 1 for s in stale)
    reaped.assert_ended_and_billed_once(stale)


class NoLock(SweepLock):
    """No mutual exclusion at all: shows the row-level guards hold on their own."""

    def acquire(self) -> bool:
        return True

    def _renew(self) -> bool:
        return True

    def release(self) -> None:
        pass  # nothing was held

    def due(self, phase: str, interval_s: float) -> bool:
        return True


def test_even_without_the_lock_concurrent_sweeps_record_and_bill_once(reaped: Reaped) -> None:
    stale = reaped.stale(12)

    reports = _race(reaped, [NoLock(30), NoLock(30), NoLock(30)])

    assert sum(sum(r.ended.values()) for r in reports) == 12
    reaped.assert_ended_and_billed_once(stale)


def test_a_crashed_sweeps_lock_expires(reaped: Reaped) -> None:
    crashed = reaped.lock(lease_s=0.5)
    assert crashed.acquire()  # and never renews nor releases: its process hangs
    assert reaped.sweep().skipped

    deadline = time.monotonic() + 30  # PostgreSQL ends the idle session after the lease
    while reaped.sweep().skipped:
        assert time.monotonic() < deadline, "the crashed sweep's lock never expired"
        time.sleep(0.1)
    assert not crashed.renew()  # its holder learns that it lost the lease
    crashed.release()  # no error: the lease had run out


def test_a_killed_sweeps_lock_is_free_at_once(reaped: Reaped) -> None:
    """A maintenance worker SIGKILLed mid-sweep: its session ends with its connection."""
    holder = subprocess.Popen(
        [sys.executable, "-c", _HOLD_LOCK, reaped.db.engine.url.render_as_string(False)],
        stdout=subprocess.PIPE,
    )
    try:
        assert holder.stdout is not None
        assert holder.stdout.readline().strip() == b"held"
        assert reaped.sweep().skipped
    finally:
        holder.kill()
        holder.wait()
        holder.stdout.close()
    deadline = time.monotonic() + 30
    while reaped.sweep().skipped:
        assert time.monotonic() < deadline, "the killed holder's lock was never freed"
        time.sleep(0.05)


_HOLD_LOCK = """
import sys, time
from corral.shared.store.db import make_engine
from corral.worker.sweep_lock import PostgresSweepLock
lock = PostgresSweepLock(make_engine(sys.argv[1]), lease_s=600)
assert lock.acquire()
print("held", flush=True)
time.sleep(600)
"""


def test_the_reconcile_phase_is_due_once_per_interval_across_locks(reaped: Reaped) -> None:
    first, second = reaped.lock(), reaped.lock()
    assert first.due("reconcile", 3600)
    assert not second.due("reconcile", 3600)  # another maintenance worker: not yet
    assert not first.due("reconcile", 3600)
    assert second.due("reconcile", 0)  # an interval of 0: always
    with reaped.db.session() as session:
        session.execute(text("UPDATE maintenance_clock SET last_run_at = now() - interval '2h'"))
    assert second.due("reconcile", 3600)


# -- the ledger ---------------------------------------------------------------------------


def test_a_failed_cost_emission_does_not_block_the_end_and_the_next_sweep_writes_it(
    reaped: Reaped, caplog: pytest.LogCaptureFixture
) -> None:
    item_id = reaped.dispatch()
    sandbox = reaped.sandbox(item_id)
    reaped.backdate(sandbox.id, started_at=601)
    with reaped.db.session() as session:  # the ledger table refuses writes for a while
        session.execute(
            text(
                "CREATE FUNCTION refuse_costs() RETURNS trigger LANGUAGE plpgsql AS "
                "$$ BEGIN RAISE EXCEPTION 'the ledger is unavailable'; END $$"
            )
        )
        session.execute(
            text(
                "CREATE TRIGGER refuse_costs BEFORE INSERT ON cost_events "
                "FOR EACH ROW EXECUTE FUNCTION refuse_costs()"
            )
        )

    with caplog.at_level(logging.WARNING, logger="corral.shared.store.ledger"):
        first = reaped.sweep()

    assert first.ended == {"never_claimed": 1} and first.costs_written == 0
    assert reaped.sandbox(item_id).status == "terminated"  # the end went through
    assert reaped.costs() == []
    assert "cost event not written; the next sweep retries it" in caplog.messages
    with reaped.db.session() as session:
        session.execute(text("DROP TRIGGER refuse_costs ON cost_events"))

    second = reaped.sweep()

    assert second.costs_written == 1
    assert [c.sandbox_id for c in reaped.costs()] == [sandbox.id]
    assert reaped.sweep().costs_written == 0
    assert reaped.sandbox(item_id).cost_due_at is None


@pytest.mark.parametrize(
    ("billing_model", "cpu_seconds", "expected_estimated"),
    [
        ("wall-clock", None, False),
        ("fixed", None, False),
        ("active-cpu", 12.5, False),
        ("active-cpu", None, True),
    ],
)
def test_the_cost_event_follows_the_pools_billing_model(
    reaped: Reaped, billing_model: str, cpu_seconds: float | None, expected_estimated: bool
) -> None:
    with reaped.db.session() as session:
        session.get_one(Pool, "pool-in-memory").billing_model = billing_model
    item_id = reaped.dispatch()
    reaped.claim(item_id)
    sandbox = reaped.sandbox(item_id)
    reaped.backdate(sandbox.id, started_at=90)
    reaped.provider.use_cpu(_handle(sandbox), cpu_seconds)

    end_sandbox(reaped.rt, sandbox.id, reason=reason("finished"), actor="test")

    [event] = reaped.costs(sandbox.id)
    ended = reaped.sandbox(item_id)
    assert ended.started_at is not None and ended.terminated_at is not None
    elapsed_us = (ended.terminated_at - ended.started_at) // timedelta(microseconds=1)
    assert event.seconds == pytest.approx(elapsed_us / 1e6)
    assert 90 <= event.seconds < 100
    expected = {
        "wall-clock": (elapsed_us * RATE + 500_000) // 1_000_000,
        "fixed": RATE,
        "active-cpu": round(12.5 * RATE)
        if cpu_seconds
        else (elapsed_us * RATE + 500_000) // 1_000_000,
    }[billing_model]
    assert (event.billing_model, event.amount_micros) == (billing_model, expected)
    assert event.cpu_estimated is expected_estimated
    assert event.cpu_seconds == cpu_seconds
    attribution = (event.org_id, event.project_id, event.pool_id, event.provider_id)
    assert attribution == ("acme", "web", "pool-in-memory", "in-memory")
    assert event.work_item_id == item_id


def test_the_unique_key_allows_one_cost_event_per_sandbox(reaped: Reaped) -> None:
    item_id = reaped.dispatch()
    sandbox = reaped.sandbox(item_id)
    end_sandbox(reaped.rt, sandbox.id, reason=reason("cancelled"), actor="test")
    [event] = reaped.costs()

    with pytest.raises(IntegrityError), reaped.db.session() as session:
        session.add(
            CostEvent(
                sandbox_id=sandbox.id,
                work_item_id=item_id,
                org_id="acme",
                project_id="web",
                pool_id="pool-in-memory",
                provider_id="in-memory",
                started_at=event.started_at,
                ended_at=event.ended_at,
                seconds=1,
                billing_model="fixed",
                amount_micros=1,
            )
        )
    with reaped.db.session() as session:
        assert session.scalar(select(func.count()).select_from(CostEvent)) == 1


def reason(value: str) -> TerminationReason:
    return TerminationReason(value)


def _handle(sandbox: Sandbox) -> SandboxHandle:
    assert sandbox.external_id is not None
    return SandboxHandle(
        provider_id=sandbox.provider_id,
        external_id=sandbox.external_id,
        metadata=dict(sandbox.handle_metadata),
    )


def test_metrics_count_sandboxes_reaped_by_reason_and_cost_totals(reaped: Reaped) -> None:
    def sample(name: str, **labels: str) -> float:
        return REGISTRY.get_sample_value(name, labels) or 0.0

    cost_labels = {"provider": "in-memory", "billing_model": "wall-clock"}
    before = (
        sample("corral_sandboxes_reaped_total", reason="never_claimed"),
        sample("corral_cost_events_total", **cost_labels),
        sample("corral_cost_micros_total", **cost_labels),
    )
    reaped.stale(3)

    reaped.sweep()

    events = reaped.costs()
    assert sample("corral_sandboxes_reaped_total", reason="never_claimed") == before[0] + 3
    assert sample("corral_cost_events_total", **cost_labels) == before[1] + 3
    assert sample("corral_cost_micros_total", **cost_labels) == before[2] + sum(
        e.amount_micros for e in events
    )


# -- rows that change under a sweep ----------------------------------------------------


def test_a_rule_is_checked_again_before_the_kill(reaped: Reaped) -> None:
    item_id = reaped.dispatch()
    reaped.backdate(reaped.sandbox(item_id).id, started_at=601)
    [candidate] = find_stale(reaped.rt, utcnow())
    assert candidate.reason == "never_claimed"
    reaped.claim(item_id)  # the runner claims after the sweep read the rows

    outcome = end_sandbox(
        reaped.rt,
        candidate.sandbox_id,
        reason=candidate.reason,
        actor="reaper",
        still_applies=candidate.still_applies,
    )

    assert not outcome.ended
    assert reaped.item(item_id).state == "running"
    assert reaped.terminate_calls() == Counter()


class ClaimedThenFailed(InMemoryProvider):
    """The runner starts, registers and claims while provision() is still running, and
    then the provider call fails: the handle is never recorded."""

    def __init__(self) -> None:
        super().__init__()
        self.on_provision: Any = None

    def provision(self, spec: SandboxSpec) -> SandboxHandle:
        self.on_provision(spec.registration_token.get_secret_value())
        raise ProviderUnavailableError("the provider went away after starting the sandbox")


def test_a_claimed_sandbox_whose_handle_was_never_recorded_is_still_reaped(
    fresh_pg_url: str, redis_url: str, tmp_path: Path
) -> None:
    provider = ClaimedThenFailed()
    provider.id = "in-memory"  # type: ignore[misc]
    with reaped_world(fresh_pg_url, redis_url, tmp_path, provider) as world:

        def runner(token: str) -> None:
            answer = world.api.post("/v1/runner/register", json={"token": token})
            headers = {"Authorization": f"Bearer {answer.json()['session_token']}"}
            assert world.api.post("/v1/runner/claim", headers=headers).status_code == 200

        provider.on_provision = runner
        request = DispatchRequest.model_validate(
            {
                "org": "acme",
                "project": "web",
                "profile": "default",
                "work": {"kind": "shell", "command": "true"},
            }
        )
        item_id = accept(world.db, request, actor="test").item_id
        route_item(world.db, item_id, actor="test", settings=world.rt.settings)
        with pytest.raises(RetryLater):
            provision_item(world.rt, item_id, actor="test")
        sandbox = world.sandbox(item_id)
        assert (sandbox.status, sandbox.external_id) == ("running", None)
        world.backdate(sandbox.id, last_heartbeat_at=61)

        report = world.sweep()

        assert report.ended == {"heartbeat_lost": 1}
        item = world.item(item_id)
        assert (item.state, item.error_code) == ("failed", "heartbeat_lost")
        assert len(world.costs(sandbox.id)) == 1


def test_a_pool_of_a_provider_corral_lacks_is_said_once_not_failed_every_sweep(
    reaped: Reaped, caplog: pytest.LogCaptureFixture
) -> None:
    # A pool made before provider ids were checked, naming one that does not exist.
    with reaped.db.session() as session:
        session.add(
            Pool(
                id="pool-gone",
                org_id="acme",
                name="gone",
                provider_id="gone-cloud",
                max_concurrent=1,
                sandbox_config={},
            )
        )
    with caplog.at_level(logging.WARNING, logger="corral.worker.reaper"):
        first, second = reaped.sweep(), reaped.sweep()

    assert (first.errors, second.errors) == (0, 0)
    said = [r.getMessage() for r in caplog.records if "gone-cloud" in r.getMessage()]
    assert len(said) == 1 and "which corral does not have" in said[0]
    assert all(r.exc_info is None for r in caplog.records)
