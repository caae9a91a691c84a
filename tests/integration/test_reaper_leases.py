"""Lease policies enforced on real PostgreSQL and Redis, with the in-memory provider: a
lost runner requeued for a new sandbox and a new token, failed work retried, the back-off
kept, and each level's choice (the item's, the pool's, the deployment's).

Time passing is made by moving timestamps into the past, as in test_reaper.py: the rules
and the back-off compare timestamps, nothing else.
"""

from __future__ import annotations

from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import pytest
from sqlalchemy import select, update

from corral.providers.base import SandboxHandle
from corral.providers.testing import InMemoryProvider
from corral.scheduler.batch import accept_batch
from corral.scheduler.intake import route_item
from corral.shared.messages import DispatchRequest
from corral.shared.store.db import utcnow
from corral.shared.store.models import (
    ItemState,
    LifecycleEvent,
    Pool,
    RegistrationToken,
    TerminationReason,
    WorkItem,
)
from corral.worker.maintenance import redrive
from corral.worker.provision import Outcome, provision_item
from corral.worker.termination import end_sandbox
from tests.integration.reaping import Reaped, reaped_world

REQUEUE = {"on_heartbeat_lost": "requeue"}


@pytest.fixture
def reaped(fresh_pg_url: str, redis_url: str, tmp_path: Path) -> Iterator[Reaped]:
    with reaped_world(fresh_pg_url, redis_url, tmp_path, InMemoryProvider()) as world:
        yield world  # max_attempts 2, heartbeat_timeout_s 60


def token_of(reaped: Reaped, sandbox_id: str) -> str:
    """The registration token the provider was given for ``sandbox_id``."""
    return str(reaped.provider.boxes[sandbox_id].spec.registration_token.get_secret_value())


def lose_runner(reaped: Reaped, item_id: str) -> str:
    """Claim ``item_id``'s current sandbox, then let its heartbeat go stale; its id."""
    reaped.claim(item_id)
    sandbox = reaped.sandbox(item_id)
    reaped.backdate(sandbox.id, last_heartbeat_at=61)
    return sandbox.id


def slots_in_use(reaped: Reaped) -> int:
    with reaped.db.session() as session:
        return session.get_one(Pool, "pool-in-memory").slots_in_use


def item_events(reaped: Reaped, item_id: str) -> list[tuple[str, str | None]]:
    with reaped.db.session() as session:
        rows = session.execute(
            select(LifecycleEvent.to_state, LifecycleEvent.detail)
            .where(LifecycleEvent.entity == "work_item", LifecycleEvent.entity_id == item_id)
            .order_by(LifecycleEvent.id)
        )
        return [(to, detail) for to, detail in rows]


def test_a_lost_runner_is_requeued_with_a_new_sandbox_and_token_until_max_attempts(
    reaped: Reaped,
) -> None:
    item_id = reaped.dispatch(lease={**REQUEUE, "max_attempts": 2})
    first_token = token_of(reaped, reaped.sandbox(item_id).id)
    old_runner = reaped.claim(item_id)
    first = reaped.sandbox(item_id)
    reaped.backdate(first.id, last_heartbeat_at=61)

    report = reaped.sweep()

    assert report.ended == {"heartbeat_lost": 1}
    assert (report.requeued, report.backing_off, report.failed) == ([item_id], [], [])
    item = reaped.item(item_id)
    assert (item.state, item.attempts, item.error_code, item.not_before) == (
        "received",
        1,
        None,
        None,
    )
    assert item_events(reaped, item_id)[-1] == (
        "received",
        "requeued: attempt 1 ended (heartbeat_lost: no heartbeat from its runner for 60 s)",
    )
    ended = reaped.sandbox(item_id, attempt=1)
    assert (ended.status, ended.termination_reason) == ("terminated", "heartbeat_lost")
    assert first.id not in reaped.provider.boxes
    assert slots_in_use(reaped) == 0  # a requeued item holds no slot
    # The lost runner's session ended with its sandbox.
    assert reaped.api.post("/v1/runner/heartbeat", headers=old_runner).status_code == 401

    reaped.route_and_provision(item_id)  # what the sweep's corral.route does

    second = reaped.sandbox(item_id)
    assert (second.attempt, reaped.item(item_id).attempts) == (2, 2)
    assert second.id != first.id
    assert token_of(reaped, second.id) != first_token  # a token of its own
    with reaped.db.session() as session:
        hashes = session.execute(select(RegistrationToken.sandbox_id, RegistrationToken.token_hash))
        by_sandbox = {sandbox_id: token_hash for sandbox_id, token_hash in hashes}
    assert set(by_sandbox) == {first.id, second.id}
    assert by_sandbox[first.id] != by_sandbox[second.id]
    again = reaped.api.post("/v1/runner/register", json={"token": first_token})
    assert again.status_code == 401  # the first attempt's token is spent

    lose_runner(reaped, item_id)
    report = reaped.sweep()

    assert (report.requeued, report.failed) == ([], [item_id])
    item = reaped.item(item_id)
    assert (item.state, item.error_code, item.attempts) == ("failed", "heartbeat_lost", 2)
    assert item.error_message == "no heartbeat from its runner for 60 s; gave up after 2 attempts"
    reaped.assert_ended_and_billed_once([first.id, second.id])
    assert slots_in_use(reaped) == 0


def test_a_sandbox_lost_under_claimed_work_is_requeued_when_the_lease_says_so(
    reaped: Reaped,
) -> None:
    item_id = reaped.dispatch(lease=REQUEUE)
    reaped.claim(item_id)
    sandbox = reaped.sandbox(item_id)
    assert sandbox.external_id is not None
    handle = SandboxHandle(
        provider_id=sandbox.provider_id,
        external_id=sandbox.external_id,
        metadata=dict(sandbox.handle_metadata),
    )
    reaped.provider.finish(handle, exit_code=137)  # it died under its work

    report = reaped.sweep()

    assert report.ended == {"sandbox_lost": 1} and report.requeued == [item_id]
    assert reaped.item(item_id).state == "received"


def test_the_pools_default_lease_applies_where_the_item_chose_nothing(reaped: Reaped) -> None:
    with reaped.db.session() as session:
        session.get_one(Pool, "pool-in-memory").lease = {**REQUEUE, "max_attempts": 2}
    by_pool = reaped.dispatch()
    own = reaped.dispatch(lease={"on_heartbeat_lost": "fail"})
    with reaped.db.session() as session:  # changed after routing: the items keep theirs
        session.get_one(Pool, "pool-in-memory").lease = None
    for item_id in (by_pool, own):
        lose_runner(reaped, item_id)

    report = reaped.sweep()

    assert (report.requeued, report.failed) == ([by_pool], [own])
    assert reaped.item(by_pool).lease == {**REQUEUE, "max_attempts": 2}
    assert reaped.item(own).lease == {"on_heartbeat_lost": "fail", "max_attempts": 2}
    view = reaped.api.get(
        f"/v1/work-items/{by_pool}", headers={"Authorization": "Bearer reaper-admin-token"}
    ).json()
    assert view["lease"] == {
        "max_attempts": 2,
        "retry_on_work_failed": False,
        "on_heartbeat_lost": "requeue",
        "backoff_s": 0.0,
        "backoff_factor": 2.0,
        "backoff_max_s": 300.0,
    }


def test_without_a_lease_nothing_is_stored_and_a_lost_runner_fails_the_item(
    reaped: Reaped,
) -> None:
    item_id = reaped.dispatch()
    lose_runner(reaped, item_id)

    report = reaped.sweep()

    assert (report.requeued, report.failed) == ([], [item_id])
    item = reaped.item(item_id)
    assert item.lease == {}  # nothing chosen: the deployment's defaults when they apply
    assert item.error_message == "no heartbeat from its runner for 60 s"  # as before


def test_failed_work_is_retried_on_a_new_sandbox_when_the_lease_says_so(reaped: Reaped) -> None:
    item_id = reaped.dispatch(lease={"retry_on_work_failed": True})
    old_runner = reaped.claim(item_id)
    first = reaped.sandbox(item_id)

    done = reaped.api.post("/v1/runner/complete", headers=old_runner, json={"exit_code": 3})

    assert done.status_code == 200 and done.json() == {"state": "received"}
    # A repeated report (the runner retries a lost answer) is answered as the first was.
    again = reaped.api.post("/v1/runner/complete", headers=old_runner, json={"exit_code": 3})
    assert again.json() == {"state": "received"}
    item = reaped.item(item_id)
    assert (item.state, item.exit_code, item.error_code, item.attempts) == (
        "received",
        None,
        None,
        1,
    )
    assert item_events(reaped, item_id)[-1] == (
        "received",
        "requeued: attempt 1 ended (work_failed: work exited with code 3)",
    )
    assert reaped.sandbox(item_id, attempt=1).end_requested_at is not None
    assert slots_in_use(reaped) == 0
    reaped.route_and_provision(item_id)
    # The first attempt's runner speaks for nothing any more, even before its sandbox ends.
    assert reaped.api.post("/v1/runner/claim", headers=old_runner).status_code == 409
    beat = reaped.api.post("/v1/runner/heartbeat", headers=old_runner)
    assert beat.json() == {"cancel": True}
    new_runner = reaped.claim(item_id)
    late = reaped.api.post("/v1/runner/complete", headers=old_runner, json={"exit_code": 0})
    assert late.json() == {"state": "received"}  # its own report, not the new attempt's
    assert reaped.item(item_id).state == "running"
    end_sandbox(reaped.rt, first.id, reason=TerminationReason.FINISHED, actor="test")
    assert reaped.item(item_id).state == "running"  # an old attempt's end changes nothing

    done = reaped.api.post("/v1/runner/complete", headers=new_runner, json={"exit_code": 0})

    assert done.json() == {"state": "succeeded"}
    assert reaped.sandbox(item_id).attempt == 2


def test_failed_work_out_of_attempts_fails_naming_them(reaped: Reaped) -> None:
    item_id = reaped.dispatch(lease={"retry_on_work_failed": True, "max_attempts": 1})
    runner = reaped.claim(item_id)

    done = reaped.api.post("/v1/runner/complete", headers=runner, json={"exit_code": 3})

    assert done.json() == {"state": "failed"}
    item = reaped.item(item_id)
    assert (item.error_code, item.error_message) == (
        "work_failed",
        "work exited with code 3; gave up after 1 attempt",
    )


def test_other_failures_are_not_retried(reaped: Reaped) -> None:
    item_id = reaped.dispatch(lease={"retry_on_work_failed": True})
    runner = reaped.claim(item_id)

    body = {"exit_code": 1, "phase": "install"}
    done = reaped.api.post("/v1/runner/complete", headers=runner, json=body)

    assert done.json() == {"state": "failed"}
    assert reaped.item(item_id).error_code == "install_failed"


def test_a_requeued_item_is_not_routed_or_provisioned_before_its_back_off(
    reaped: Reaped,
) -> None:
    lease = {**REQUEUE, "max_attempts": 3, "backoff_s": 120, "backoff_factor": 2}
    item_id = reaped.dispatch(lease=lease)
    lose_runner(reaped, item_id)
    before = utcnow()

    report = reaped.sweep()

    after = utcnow()
    assert report.requeued == report.backing_off == [item_id]
    not_before = reaped.item(item_id).not_before
    assert not_before is not None
    assert before + timedelta(seconds=120) <= not_before <= after + timedelta(seconds=120)
    assert slots_in_use(reaped) == 0  # it waits holding no slot
    # Routing it before its time does nothing: a route task, a second delivery, a re-drive.
    outcome = route_item(reaped.db, item_id, actor="test", settings=reaped.rt.settings)
    assert (outcome.state, outcome.queue, outcome.detail) == (
        ItemState.RECEIVED,
        None,
        "backing off",
    )
    with reaped.db.session() as session:  # long since requeued: it counts as stranded
        session.execute(
            update(WorkItem)
            .where(WorkItem.id == item_id)
            .values(updated_at=utcnow() - timedelta(seconds=60))
        )
    assert redrive(reaped.rt, actor="test").routed == []
    assert provision_item(reaped.rt, item_id, actor="test") is not Outcome.PROVISIONED
    assert reaped.sandbox(item_id).attempt == 1  # nothing provisioned
    assert reaped.item(item_id).state == "received"

    with reaped.db.session() as session:  # its time has come
        session.execute(
            update(WorkItem)
            .where(WorkItem.id == item_id)
            .values(not_before=utcnow() - timedelta(seconds=1))
        )
    routed = redrive(reaped.rt, actor="test").routed

    assert [(one.item_id, one.state) for one in routed] == [(item_id, ItemState.ROUTED)]
    assert provision_item(reaped.rt, item_id, actor="test") is Outcome.PROVISIONED
    assert (reaped.sandbox(item_id).attempt, reaped.item(item_id).not_before) == (2, None)
    lose_runner(reaped, item_id)
    before = utcnow()
    reaped.sweep()
    not_before = reaped.item(item_id).not_before
    assert not_before is not None  # the second requeue waits twice as long
    assert before + timedelta(seconds=240) <= not_before <= utcnow() + timedelta(seconds=240)


def test_a_batch_routed_item_keeps_the_lease_chosen_for_it(reaped: Reaped) -> None:
    with reaped.db.session() as session:
        session.get_one(Pool, "pool-in-memory").lease = {"max_attempts": 5, "backoff_s": 3}
    message = {
        "org": "acme",
        "project": "web",
        "profile": "default",
        "work": {"kind": "shell", "command": "echo hi"},
    }
    plain, leased = (
        DispatchRequest.model_validate(message),
        DispatchRequest.model_validate({**message, "lease": {"max_attempts": 1}}),
    )

    taken = accept_batch(reaped.db, [plain, leased], actor="test", settings=reaped.rt.settings)

    assert [one.outcome.state for one in taken] == [ItemState.ROUTED, ItemState.ROUTED]
    assert reaped.item(taken[0].item_id).lease == {"max_attempts": 5, "backoff_s": 3}
    assert reaped.item(taken[1].item_id).lease == {"max_attempts": 1, "backoff_s": 3}
