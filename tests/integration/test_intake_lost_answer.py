"""The intake's write answered by nothing: on PostgreSQL a one-pool batch is one statement
that commits on its own, so a connection lost after the database ran it leaves the items
written and the scheduler not knowing. The batch goes back to the queue unacknowledged, and
its second delivery finds the items by their keys: no item twice, a provision task each."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import redis
from sqlalchemy import func, select
from sqlalchemy.exc import OperationalError

from corral.scheduler import batch
from corral.scheduler.consumer import DatabaseUnavailableError, Intake, IntakeConfig
from corral.scheduler.inbox_redis import RedisInbox
from corral.shared import runtime
from corral.shared.broker import celery_app
from corral.shared.settings import CoreSettings
from corral.shared.store.db import Database
from corral.shared.store.models import LifecycleEvent, WorkItem
from tests.acceptance.stack import delete_broker_keys
from tests.batches import dispatch_message
from tests.seeding import org_with_pool

MESSAGES = 3


@pytest.fixture
def scheduler(pg_db: Database, redis_url: str) -> Iterator[tuple[Intake, RedisInbox, str, str]]:
    """An intake loop on a Redis key prefix of its own, its inbox, the org, the prefix."""
    prefix = f"corral-lost-{uuid.uuid4().hex[:8]}:"
    settings = CoreSettings(broker_url=redis_url, broker_key_prefix=prefix)
    celery_app.configure(settings)
    rt = runtime.install(runtime.Runtime(settings=settings, db=pg_db))
    org = org_with_pool(pg_db, "lost")
    inbox = RedisInbox(redis_url, queue="dispatch", prefix=prefix)
    try:
        yield Intake(rt, lambda: inbox, config=IntakeConfig(wait_s=0)), inbox, org, prefix
    finally:
        inbox.close()
        runtime.reset()
        delete_broker_keys(redis_url, prefix)


def _routed(db: Database, org: str) -> dict[str, int]:
    """Each of ``org``'s items, with how many times it was routed."""
    with db.session() as session:
        items = session.scalars(select(WorkItem.id).where(WorkItem.org_id == org)).all()
        moves = session.execute(
            select(LifecycleEvent.work_item_id, func.count())
            .where(LifecycleEvent.work_item_id.in_(items), LifecycleEvent.to_state == "routed")
            .group_by(LifecycleEvent.work_item_id)
        ).all()
    return {item_id: count for item_id, count in moves}


@pytest.mark.parametrize("kept", [False, True], ids=["read", "kept-configuration"])
def test_a_write_whose_answer_was_lost_is_delivered_again_and_finished_once(
    scheduler: tuple[Intake, RedisInbox, str, str],
    pg_db: Database,
    redis_url: str,
    monkeypatch: pytest.MonkeyPatch,
    kept: bool,
) -> None:
    """``kept``: an earlier batch left the org's configuration kept, so the batch is written
    by the write that checks its version (scheduler/routing_cache.py)."""
    intake, inbox, org, prefix = scheduler
    client = redis.Redis.from_url(redis_url)
    provisions = f"{prefix}provision.local"
    if kept:
        celery_app.app.send_task("corral.dispatch", args=[dispatch_message(org, -1)])
        intake.process(inbox, inbox.take(10, wait_s=0))
        client.delete(provisions)
    for number in range(MESSAGES):
        message = dispatch_message(org, number)
        celery_app.app.send_task("corral.dispatch", args=[message], queue="dispatch")
    write = batch._write_one_pool
    lost: list[bool] = []

    def answer_lost(*args: Any, **kwargs: Any) -> tuple[str, int]:
        written = write(*args, **kwargs)  # PostgreSQL ran it, and it committed
        if not lost:
            lost.append(kwargs.get("version") is not None)
            raise OperationalError("WITH items …", {}, Exception("server closed the connection"))
        return written

    monkeypatch.setattr(batch, "_write_one_pool", answer_lost)
    with pytest.raises(DatabaseUnavailableError):
        intake.process(inbox, inbox.take(10, wait_s=0))
    assert lost == [kept]  # the kept configuration's write, when kept
    assert list(_routed(pg_db, org).values()) == [1] * (MESSAGES + kept)  # written, unknown
    assert client.llen(provisions) == 0
    again = inbox.take(10, wait_s=0)  # handed back, not acknowledged
    assert len(again) == MESSAGES
    intake.process(inbox, again)
    assert list(_routed(pg_db, org).values()) == [1] * (MESSAGES + kept)  # no item twice
    assert client.llen(provisions) == MESSAGES  # each item's provision task, once
    assert inbox.take(10, wait_s=0) == []
