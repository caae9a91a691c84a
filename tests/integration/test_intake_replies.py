"""The scheduler's intake keeps what each Celery message is owed, on Redis and PostgreSQL:
its task id and its link and link_error callbacks on the item it made (in the batch that
writes it), a reply more on the item a later message names by its idempotency key, an
``invalid_message`` item for callbacks corral may not send, and, for a message too large
to read, an item under its task id that still owes its sender the result and callbacks."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from celery import signature
from sqlalchemy import select

from corral.scheduler.consumer import Intake, IntakeConfig
from corral.scheduler.inbox_redis import RedisInbox
from corral.shared import runtime
from corral.shared.broker import celery_app
from corral.shared.settings import CoreSettings
from corral.shared.store.db import Database
from corral.shared.store.models import OutcomeOutbox, WorkItem
from tests.acceptance.stack import delete_broker_keys
from tests.batches import dispatch_message
from tests.seeding import org_with_pool

LINK = signature("upstream.done", args=(1,), queue="upstream")
LINK_ERROR = signature("upstream.failed", immutable=True)
OWED_CALLBACKS = {
    "link": [
        {
            "task": "upstream.done",
            "args": [1],
            "kwargs": {},
            "queue": "upstream",
            "immutable": False,
        }
    ],
    "link_error": [
        {"task": "upstream.failed", "args": [], "kwargs": {}, "queue": "celery", "immutable": True}
    ],
}


@pytest.fixture
def intake(pg_db: Database, redis_url: str) -> Iterator[tuple[Intake, RedisInbox, str]]:
    """An intake loop with a result backend, reading messages up to 64 KiB; the org."""
    prefix = f"corral-replies-{uuid.uuid4().hex[:8]}:"
    settings = CoreSettings(
        broker_url=redis_url,
        broker_key_prefix=prefix,
        result_backend=redis_url,
        callback_queues="upstream,celery",
        max_message_bytes=64 * 1024,
    )
    celery_app.configure(settings)
    rt = runtime.install(runtime.Runtime(settings=settings, db=pg_db))
    inbox = RedisInbox(redis_url, queue="dispatch", prefix=prefix, limits=settings.message_limits())
    config = IntakeConfig(wait_s=0, limits=settings.message_limits())
    try:
        yield Intake(rt, lambda: inbox, config=config), inbox, org_with_pool(pg_db, "replies")
    finally:
        inbox.close()
        runtime.reset()
        delete_broker_keys(redis_url, prefix)


def _send(message: dict[str, Any], **options: Any) -> str:
    sent = celery_app.app.send_task(
        "corral.dispatch",
        args=[message],
        queue="dispatch",
        link=LINK,
        link_error=LINK_ERROR,
        **options,
    )
    return str(sent.id)


def _take(intake: Intake, inbox: RedisInbox) -> None:
    intake.process(inbox, inbox.take(50, wait_s=0))


def _item(db: Database, **by: Any) -> WorkItem:
    with db.session() as session:
        query = select(WorkItem).where(*(getattr(WorkItem, k) == v for k, v in by.items()))
        item = session.scalars(query).one()
        session.expunge(item)
        return item


def test_an_item_keeps_the_replies_of_every_message_that_named_it(
    intake: tuple[Intake, RedisInbox, str], pg_db: Database
) -> None:
    loop, inbox, org = intake
    first = _send(dispatch_message(org, 1, key="shared-key"))
    _take(loop, inbox)
    item = _item(pg_db, org_id=org, idempotency_key="shared-key")
    assert item.task_id == first and item.replies == [{"task_id": first, **OWED_CALLBACKS}]
    later = _send(dispatch_message(org, 2, key="shared-key"))  # another message, same key
    _send(dispatch_message(org, 2, key="shared-key"), task_id=later)  # and its second delivery
    _take(loop, inbox)
    again = _item(pg_db, id=item.id)
    assert again.task_id == first
    assert [reply["task_id"] for reply in again.replies or []] == [first, later]


@pytest.mark.parametrize(
    ("link", "said"),
    [
        (
            signature("corral.terminate", args=("sb-1", "cancelled")),
            "link[0]: a callback may not name corral's or Celery's tasks",
        ),
        # Another system's workers on the same broker: not among CORRAL_CALLBACK_QUEUES.
        (
            signature("billing.refund", args=("acct-1",), queue="billing"),
            "link[0]: callbacks may go only to the queues CORRAL_CALLBACK_QUEUES allows",
        ),
    ],
)
def test_callbacks_corral_may_not_send_make_an_invalid_message_still_answered(
    intake: tuple[Intake, RedisInbox, str], pg_db: Database, link: Any, said: str
) -> None:
    loop, inbox, org = intake
    task_id = celery_app.app.send_task(
        "corral.dispatch", args=[dispatch_message(org, 3)], queue="dispatch", link=link
    ).id
    _take(loop, inbox)
    item = _item(pg_db, task_id=task_id)
    assert (item.state, item.error_code) == ("dispatch_error", "invalid_message")
    assert said in (item.error_message or "")
    assert item.replies == [{"task_id": task_id, "link": [], "link_error": []}]
    with pg_db.session() as session:
        owed = session.scalars(
            select(OutcomeOutbox.target).where(OutcomeOutbox.work_item_id == item.id)
        )
        assert list(owed) == [{"task_id": task_id, "link": [], "link_error": []}]


def test_a_message_too_large_to_read_is_an_item_under_its_task_id_that_owes_its_sender(
    intake: tuple[Intake, RedisInbox, str], pg_db: Database
) -> None:
    loop, inbox, org = intake
    message = dispatch_message(org, 4, key="too-large") | {"env": {"BIG": "x" * 100_000}}
    task_id = _send(message)
    _take(loop, inbox)
    item = _item(pg_db, task_id=task_id)
    assert (item.state, item.error_code, item.org_id) == (
        "dispatch_error",
        "invalid_message",
        "unknown",
    )
    assert item.idempotency_key == f"celery:{task_id}"
    assert "the message is" in (item.error_message or "") and "x" * 20 not in (
        item.error_message or ""
    )
    assert item.replies == [{"task_id": task_id, **OWED_CALLBACKS}]
