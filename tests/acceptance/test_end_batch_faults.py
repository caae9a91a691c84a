"""A batch of sandbox ends lost with the api (corral.scheduler.end_batches), through real
processes on PostgreSQL and Redis: the api is SIGKILLed while it holds the ended sandbox of
a finished item; the reaper's ``finished`` rule ends the sandbox once, as finished, and
bills it once. Reconciliation is set far off, so that only that rule can end it."""

from __future__ import annotations

import os
import signal
import uuid
from collections.abc import Iterator

import pytest
from sqlalchemy import func, select

from corral.shared.store.db import Database, make_engine
from corral.shared.store.models import CostEvent, Sandbox, WorkItem
from tests.acceptance.conftest import shell
from tests.acceptance.stack import Stack, running_stack

HELD_ENV = {
    "CORRAL_END_BATCH_S": "30",  # the api holds the end far past its death
    "CORRAL_FINISH_GRACE_S": "5",
    "CORRAL_RECONCILE_INTERVAL_S": "3600",
}
RUN_S = 5


@pytest.fixture
def stack(fresh_pg_url: str, redis_url: str) -> Iterator[Stack]:
    with running_stack(fresh_pg_url, redis_url, **HELD_ENV) as running:
        yield running


@pytest.fixture
def db(stack: Stack) -> Iterator[Database]:
    database = Database(make_engine(stack.database_url))
    yield database
    database.dispose()


def _sandbox(db: Database, item_id: str) -> Sandbox | None:
    with db.session() as session:
        found = session.scalars(select(Sandbox).where(Sandbox.work_item_id == item_id)).all()
        session.expunge_all()
    return found[0] if len(found) == 1 else None


def _state(db: Database, item_id: str) -> str | None:
    with db.session() as session:
        return session.scalar(select(WorkItem.state).where(WorkItem.id == item_id))


def test_a_batch_lost_with_the_api_is_ended_by_the_reaper_once(stack: Stack, db: Database) -> None:
    org = stack.make_org(f"endkill-{uuid.uuid4().hex[:8]}")
    # Long enough that its provider worker records the sandbox's handle while it runs: an
    # item that ends before that has its sandbox ended by the provider worker, with no batch.
    status, item = stack.request("POST", "/v1/dispatch", shell(org, f"sleep {RUN_S}"))
    assert status == 202, item
    stack.until(
        lambda: (s := _sandbox(db, item["id"])) is not None and s.external_id is not None,
        "the sandbox's handle to be recorded",
    )
    assert _state(db, item["id"]) in {"awaiting_claim", "running"}, f"ended within {RUN_S} s"
    stack.until(lambda: _state(db, item["id"]) == "succeeded", "the item to succeed")

    api = stack.processes.pop("api")
    os.killpg(api.pid, signal.SIGKILL)  # its batch of ends with it
    assert api.wait() == -signal.SIGKILL
    sandbox = _sandbox(db, item["id"])
    assert sandbox is not None and sandbox.end_requested_at is not None
    assert sandbox.terminated_at is None, "ended before the api died: nothing was lost"

    ended = stack.until(
        lambda: (s := _sandbox(db, item["id"])) is not None and s.terminated_at is not None and s,
        "the reaper to end the sandbox",
        timeout_s=60,
    )
    assert ended.termination_reason == "finished"
    with db.session() as session:
        costs = session.scalar(
            select(func.count()).select_from(CostEvent).where(CostEvent.sandbox_id == ended.id)
        )
    assert costs == 1
