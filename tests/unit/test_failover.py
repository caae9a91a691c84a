"""Failover and brown-outs on SQLite with the in-memory provider: a provision that fails on
one pool sends its item to the next qualifying pool (and fails it once none is left, with
the last pool's error); one that fails transiently past the task's retries sends it back to
waiting, its pool not passed by; ``failover: false`` fails it as before. Attempts that made
no sandbox do not count against the lease's ``max_attempts``, and sandboxes that end before
their runner claims count toward their pool's breaker."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import pytest
from sqlalchemy import select, update

from corral.providers.testing import InMemoryProvider
from corral.scheduler.intake import route_item
from corral.shared.runtime import Runtime
from corral.shared.settings import CoreSettings
from corral.shared.store.db import Database, utcnow
from corral.shared.store.models import (
    ItemState,
    LifecycleEvent,
    Pool,
    Sandbox,
    TerminationReason,
    WorkItem,
)
from corral.worker.provision import Outcome, provision_item
from corral.worker.termination import end_sandbox
from tests.seeding import in_memory_pool
from tests.unit.test_provision import routed_item

BACKOFF_MAX_S = 30.0


@pytest.fixture
def provider() -> InMemoryProvider:
    return InMemoryProvider()


@pytest.fixture
def rt(sqlite_db: Database, provider: InMemoryProvider, tmp_path: Path) -> Iterator[Runtime]:
    """Org acme's pools ``mem`` (routed to first) and ``spare``, one in-memory provider."""
    settings = CoreSettings(
        state_dir=tmp_path,
        max_attempts=2,
        provision_backoff_max_s=BACKOFF_MAX_S,
        breaker_failures=2,
    )
    runtime = Runtime(settings=settings, db=sqlite_db)
    runtime.use_provider(provider)
    in_memory_pool(sqlite_db)
    with sqlite_db.session() as session:
        session.add(
            Pool(
                id="pool-spare",
                org_id="acme",
                name="spare",
                provider_id="in-memory",
                priority=-1,
                max_concurrent=10,
                sandbox_config={},
            )
        )
    yield runtime


def _route(rt: Runtime, item_id: str) -> ItemState:
    return route_item(rt.db, item_id, actor="test", settings=rt.settings).state


def _item(rt: Runtime, item_id: str) -> WorkItem:
    with rt.db.session() as session:
        return session.get_one(WorkItem, item_id)


def _attempts(rt: Runtime, item_id: str) -> list[tuple[str, str, str | None]]:
    """Each attempt's (pool, status, termination reason), in order."""
    with rt.db.session() as session:
        rows = session.execute(
            select(Sandbox.pool_id, Sandbox.status, Sandbox.termination_reason)
            .where(Sandbox.work_item_id == item_id)
            .order_by(Sandbox.attempt)
        )
        return [tuple(row) for row in rows]  # type: ignore[misc]


def _item_events(rt: Runtime, item_id: str) -> list[tuple[str, str | None]]:
    with rt.db.session() as session:
        rows = session.execute(
            select(LifecycleEvent.to_state, LifecycleEvent.detail)
            .where(LifecycleEvent.entity == "work_item", LifecycleEvent.entity_id == item_id)
            .order_by(LifecycleEvent.id)
        )
        return [tuple(row) for row in rows]  # type: ignore[misc]


def test_a_pool_that_cannot_make_the_sandbox_hands_the_item_to_the_next_qualifying_pool(
    rt: Runtime, provider: InMemoryProvider
) -> None:
    item_id = routed_item(rt)
    assert _item(rt, item_id).pool_id == "pool-mem"
    provider.fail_permanently("image acme/runner:9 does not exist")
    assert provision_item(rt, item_id, actor="test") is Outcome.FAILED_OVER
    item = _item(rt, item_id)
    assert (item.state, item.error_code) == ("received", "create_failed")  # why, while it waits
    assert item.not_before is None  # routed again at once
    to_state, detail = _item_events(rt, item_id)[-1]
    assert to_state == "received" and "failover" in (detail or "")

    provider.recover()
    assert _route(rt, item_id) is ItemState.ROUTED
    assert _item(rt, item_id).pool_id == "pool-spare"
    assert "passed by pool-mem" in (_item_events(rt, item_id)[-1][1] or "")
    assert provision_item(rt, item_id, actor="test") is Outcome.PROVISIONED
    assert _attempts(rt, item_id) == [
        ("pool-mem", "failed", "provision_failed"),
        ("pool-spare", "ready", None),
    ]
    assert _item(rt, item_id).error_code is None


def test_when_every_qualifying_pool_failed_the_item_it_fails_with_the_last_error(
    rt: Runtime, provider: InMemoryProvider
) -> None:
    item_id = routed_item(rt)
    provider.fail_permanently("the first pool's image is gone")
    assert provision_item(rt, item_id, actor="test") is Outcome.FAILED_OVER
    assert _route(rt, item_id) is ItemState.ROUTED
    provider.fail_permanently("the spare pool's image is gone too")
    assert provision_item(rt, item_id, actor="test") is Outcome.FAILED_OVER
    assert _route(rt, item_id) is ItemState.FAILED
    item = _item(rt, item_id)
    assert item.error_code == "create_failed"
    assert item.error_message is not None
    assert item.error_message.startswith("the spare pool's image is gone too")
    assert "mem (in-memory)" in item.error_message and "spare (in-memory)" in item.error_message
    assert [pool for pool, _, _ in _attempts(rt, item_id)] == ["pool-mem", "pool-spare"]


def test_without_failover_the_first_pools_failure_fails_the_item(
    rt: Runtime, provider: InMemoryProvider
) -> None:
    permanent = routed_item(rt, failover=False)
    provider.fail_permanently("no such image")
    assert provision_item(rt, permanent, actor="test") is Outcome.FAILED
    assert (_item(rt, permanent).state, _item(rt, permanent).error_code) == (
        "failed",
        "create_failed",
    )
    provider.recover()
    transient = routed_item(rt, failover=False)
    provider.fail_transiently(1)
    assert provision_item(rt, transient, actor="test", final_attempt=True) is Outcome.FAILED
    assert "gave up after retrying" in (_item(rt, transient).error_message or "")


def test_a_brown_out_past_the_retries_sends_the_item_back_to_waiting_for_the_same_pools(
    rt: Runtime, provider: InMemoryProvider
) -> None:
    item_id = routed_item(rt)
    provider.fail_transiently(1)
    before = utcnow()
    assert provision_item(rt, item_id, actor="test", final_attempt=True) is Outcome.WAITING
    item = _item(rt, item_id)
    assert (item.state, item.error_code) == ("received", "provider_unavailable")
    assert item.not_before is not None
    assert item.not_before >= before + timedelta(seconds=BACKOFF_MAX_S)
    assert "transiently" in (_item_events(rt, item_id)[-1][1] or "")
    assert _attempts(rt, item_id) == [("pool-mem", "failed", "provision_unavailable")]

    assert route_item(rt.db, item_id, actor="t", settings=rt.settings).detail == "backing off"
    with rt.db.session() as session:
        session.execute(update(WorkItem).values(not_before=utcnow() - timedelta(seconds=1)))
    assert _route(rt, item_id) is ItemState.ROUTED
    assert _item(rt, item_id).pool_id == "pool-mem"  # not passed by: its breaker decides
    assert provision_item(rt, item_id, actor="test") is Outcome.PROVISIONED


def test_attempts_that_made_no_sandbox_do_not_count_against_max_attempts(
    rt: Runtime, provider: InMemoryProvider
) -> None:
    item_id = routed_item(rt)  # max_attempts 2 (the deployment's)
    provider.fail_permanently("down")
    assert provision_item(rt, item_id, actor="test") is Outcome.FAILED_OVER
    provider.recover()
    assert _route(rt, item_id) is ItemState.ROUTED
    assert provision_item(rt, item_id, actor="test") is Outcome.PROVISIONED
    sandbox_id = _sandbox_of(rt, item_id, attempt=2)
    ended = end_sandbox(rt, sandbox_id, reason=TerminationReason.NEVER_CLAIMED, actor="reaper")
    assert ended.requeued == item_id, "the first sandbox it got ended: one attempt is left"
    assert _route(rt, item_id) is ItemState.ROUTED
    assert provision_item(rt, item_id, actor="test") is Outcome.PROVISIONED
    ended = end_sandbox(
        rt, _sandbox_of(rt, item_id, 3), reason=TerminationReason.NEVER_CLAIMED, actor="reaper"
    )
    assert ended.failed == item_id
    assert "gave up after 2 attempts" in (_item(rt, item_id).error_message or "")


def test_sandboxes_that_end_before_their_runner_claims_count_toward_the_pools_breaker(
    rt: Runtime,
) -> None:
    def breaker() -> tuple[str, int]:
        with rt.db.session() as session:
            pool = session.get_one(Pool, "pool-mem")
            return pool.breaker_state, pool.breaker_failures

    finished = routed_item(rt)
    assert provision_item(rt, finished, actor="test") is Outcome.PROVISIONED
    end_sandbox(rt, _sandbox_of(rt, finished, 1), reason=TerminationReason.FINISHED, actor="api")
    assert breaker() == ("closed", 0)  # the work's end says nothing of the pool

    for number, reason in enumerate((TerminationReason.NEVER_CLAIMED, TerminationReason.LOST)):
        item_id = routed_item(rt)
        assert provision_item(rt, item_id, actor="test") is Outcome.PROVISIONED
        end_sandbox(rt, _sandbox_of(rt, item_id, 1), reason=reason, actor="reaper")
        assert breaker() == ("open" if number else "closed", number + 1)
    with rt.db.session() as session:
        opened = session.scalars(
            select(LifecycleEvent.detail).where(LifecycleEvent.entity == "pool")
        ).one()
    assert opened == "2 failures in a row, the last sandbox_lost"


def _sandbox_of(rt: Runtime, item_id: str, attempt: int) -> str:
    with rt.db.session() as session:
        return session.scalars(
            select(Sandbox.id).where(Sandbox.work_item_id == item_id, Sandbox.attempt == attempt)
        ).one()
