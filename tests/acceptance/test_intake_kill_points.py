"""The scheduler SIGKILLed at the two points that matter, reached for certain, not by chance.

Between taking a batch and committing it: the test holds the org's pool rows locked, so the
scheduler's batch write waits on the lock with the messages in its in-flight list; it is
killed there. A write PostgreSQL was running then may still end after the kill (on the fast
path it is one statement outside a transaction, which commits on its own): all of its batch
or nothing, and nothing published. Between committing and publishing: the lock is released
while the test's private Redis refuses writes (``CLIENT PAUSE … WRITE``), so the batch
commits and its publish of the provision tasks hangs; it is killed there. In both, a new
scheduler finishes the work: one item per message, routed once, and a provision task for
every item.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from typing import Any

import pytest
import redis
from sqlalchemy import func, select
from sqlalchemy.orm import Session

from corral.shared.broker import celery_app
from corral.shared.broker.envelope import parse_redis_entry, read_task
from corral.shared.settings import CoreSettings
from corral.shared.store.db import Database, make_engine
from corral.shared.store.models import LifecycleEvent, Pool, WorkItem
from tests.acceptance.private_redis import PrivateRedis
from tests.acceptance.stack import Stack
from tests.batches import dispatch_message
from tests.lock_waits import lock_waiters, others_active
from tests.seeding import org_with_pool

MESSAGES = 20


@pytest.fixture
def scheduler(postgres_database_url: str, private_redis: PrivateRedis) -> Iterator[Stack]:
    stack = Stack(
        database_url=postgres_database_url,
        broker_url=private_redis.url,
        extra_env={"CORRAL_INTAKE_LEASE_S": "1"},
    )
    try:
        yield stack.start_only(["scheduler"])
    finally:
        stack.stop()


@pytest.fixture
def db(scheduler: Stack) -> Iterator[Database]:
    database = Database(make_engine(scheduler.database_url))
    try:
        yield database
    finally:
        database.dispose()


def _make_org(db: Database) -> str:
    return org_with_pool(db, "kill", max_concurrent=MESSAGES)


def _send(stack: Stack, org: str) -> None:
    sender = celery_app.configure(
        CoreSettings(broker_url=stack.broker_url, broker_key_prefix=stack.key_prefix)
    )
    for number in range(MESSAGES):
        message = dispatch_message(org, number, key=f"k-{number}")
        sender.send_task("corral.dispatch", args=[message], queue="dispatch")


def _held(client: redis.Redis, stack: Stack) -> int:
    """Messages in the scheduler's in-flight lists: taken, not yet acknowledged."""
    keys = client.keys(f"{stack.key_prefix}corral.intake.inflight:*")
    return sum(int(client.llen(key)) for key in keys)


def _provisioned(client: redis.Redis, stack: Stack) -> list[str]:
    """The item ids of the provision tasks on ``provision.local``, in queue order."""
    entries = client.lrange(f"{stack.key_prefix}provision.local", 0, -1)
    return [read_task(parse_redis_entry(raw)).args[0] for raw in entries]


def _items(db: Database, org: str) -> dict[str, Any]:
    with db.session() as session:
        items = dict(
            session.execute(select(WorkItem.id, WorkItem.state).where(WorkItem.org_id == org)).all()
        )
        routed = session.execute(
            select(LifecycleEvent.work_item_id, func.count())
            .where(
                LifecycleEvent.work_item_id.in_(list(items)),
                LifecycleEvent.entity == "work_item",
                LifecycleEvent.to_state == "routed",
            )
            .group_by(LifecycleEvent.work_item_id)
        ).all()
    return {"states": items, "routed": {item_id: count for item_id, count in routed}}


def _kill(stack: Stack) -> None:
    process = stack.processes["scheduler"]
    os.killpg(process.pid, signal.SIGKILL)
    assert process.wait() == -signal.SIGKILL


def _blocked_on_pools(stack: Stack, db: Database, org: str, session: Session) -> redis.Redis:
    """Lock ``org``'s pools in ``session``, send the messages, and return once the
    scheduler holds some of them in a batch transaction that waits for the lock."""
    session.execute(select(Pool.id).where(Pool.org_id == org).with_for_update()).all()
    _send(stack, org)
    client = redis.Redis.from_url(stack.broker_url)
    stack.until(
        lambda: lock_waiters(db) > 0 and _held(client, stack) > 0,
        "the scheduler to take messages and wait for the pool lock",
    )
    return client


def _finished_once(stack: Stack, db: Database, org: str, client: redis.Redis) -> None:
    """After a restart: one routed item per message, each with a provision task."""
    stack.start_only(["scheduler"])

    def done() -> bool:
        items = _items(db, org)
        return len(items["states"]) == MESSAGES and set(items["states"]) <= set(
            _provisioned(client, stack)
        )

    stack.until(done, "the new scheduler to finish the batch the old one held", timeout_s=60)
    items = _items(db, org)
    assert set(items["states"].values()) == {"routed"}
    assert items["routed"] == dict.fromkeys(items["states"], 1), "an item was routed twice"


def test_killed_between_taking_a_batch_and_committing_it(scheduler: Stack, db: Database) -> None:
    org = _make_org(db)
    with db.session() as holder:
        client = _blocked_on_pools(scheduler, db, org, holder)
        _kill(scheduler)
        holder.rollback()
    deadline = time.monotonic() + 30
    while others_active(db):  # the dead scheduler's statements, running to their end
        assert time.monotonic() < deadline, "a dead scheduler's statement never ended"
        time.sleep(0.05)
    items = _items(db, org)
    # What the dead scheduler's statements committed after the kill: whole items (each
    # routed once, with its events), and no provision task for any.
    assert set(items["states"].values()) <= {"routed"}
    assert items["routed"] == dict.fromkeys(items["states"], 1)
    assert _provisioned(client, scheduler) == []
    _finished_once(scheduler, db, org, client)
    assert len(_provisioned(client, scheduler)) == MESSAGES  # nothing had been published


def test_killed_between_committing_a_batch_and_publishing_it(
    scheduler: Stack, db: Database
) -> None:
    org = _make_org(db)
    with db.session() as holder:
        client = _blocked_on_pools(scheduler, db, org, holder)
        client.execute_command("CLIENT", "PAUSE", 60_000, "WRITE")
        try:
            held = _held(client, scheduler)  # no message moves while writes wait
            holder.rollback()  # the batches commit; their publish waits for Redis
            scheduler.until(
                lambda: len(_items(db, org)["states"]) == held,
                "the held batches to commit while Redis refuses writes",
            )
            assert _provisioned(client, scheduler) == []  # committed, not published
            _kill(scheduler)
        finally:
            client.execute_command("CLIENT", "UNPAUSE")
    _finished_once(scheduler, db, org, client)
