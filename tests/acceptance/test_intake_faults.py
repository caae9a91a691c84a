"""The intake under SIGKILL: every Celery dispatch becomes exactly one work item.

The scheduler is killed at random points (while it waits, between taking a batch and
committing it, between committing and acknowledging) twenty times while 200 messages are
sent; each time a new one starts. Messages the dead process held in flight come back when
its lease (1 s here) runs out; a second delivery finds the first item by its task id.
"""

from __future__ import annotations

import os
import random
import signal
import threading
import time
from collections.abc import Iterator

import pytest
from sqlalchemy import func, select

from corral.shared.broker import celery_app
from corral.shared.settings import CoreSettings
from corral.shared.store.db import Database, make_engine
from corral.shared.store.models import WorkItem
from tests.acceptance.stack import Stack
from tests.batches import dispatch_message

MESSAGES = 200
KILLS = 20


@pytest.fixture
def scheduler_only(postgres_database_url: str, redis_url: str) -> Iterator[Stack]:
    stack = Stack(
        database_url=postgres_database_url,
        broker_url=redis_url,
        extra_env={"CORRAL_INTAKE_LEASE_S": "1"},
    )
    try:
        yield stack.start_only(["scheduler"])
    finally:
        stack.stop()


def _items(db: Database, org: str) -> tuple[int, int]:
    with db.session() as session:
        total = session.scalar(select(func.count()).where(WorkItem.org_id == org)) or 0
        keys = (
            session.scalar(
                select(func.count(func.distinct(WorkItem.idempotency_key))).where(
                    WorkItem.org_id == org
                )
            )
            or 0
        )
    return total, keys


def test_a_scheduler_killed_again_and_again_loses_no_dispatch(scheduler_only: Stack) -> None:
    stack = scheduler_only
    org = f"chaos{os.getpid()}"
    sender = celery_app.configure(
        CoreSettings(broker_url=stack.broker_url, broker_key_prefix=stack.key_prefix)
    )
    done = threading.Event()

    def send() -> None:
        for number in range(MESSAGES):
            message = dispatch_message(org, number, profile="none", key=f"k-{number}")
            sender.send_task("corral.dispatch", args=[message])
            time.sleep(random.uniform(0, 0.02))
        done.set()

    thread = threading.Thread(target=send, daemon=True)
    thread.start()
    kills = 0
    while kills < KILLS or not done.is_set():
        time.sleep(random.uniform(0.05, 0.5))  # let it take and commit some
        process = stack.processes["scheduler"]
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()
        kills += 1
        stack.start_only(["scheduler"])
    thread.join(timeout=60)

    db = Database(make_engine(stack.database_url))
    try:
        deadline = time.monotonic() + 120
        while _items(db, org) != (MESSAGES, MESSAGES):
            assert time.monotonic() < deadline, f"items after {kills} kills: {_items(db, org)}"
            stack.check_alive()
            time.sleep(0.2)
    finally:
        db.dispose()
    assert kills >= KILLS
