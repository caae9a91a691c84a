"""Hostile and malformed messages on the dispatch queue, against the running processes.

Whatever arrives, the scheduler records it (an ``invalid_message`` item when it names
``corral.dispatch``, a dead letter when nothing can be read), acknowledges it, and serves
the next message; no process dies; a compression bomb costs a bounded amount of memory;
and no value the messages carried reaches a process log.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import redis
from kombu import Connection, Exchange, Producer
from sqlalchemy import select

from corral.shared.broker import celery_app
from corral.shared.store.db import Database
from corral.shared.store.models import DeadLetter, WorkItem
from tests.acceptance import hostile
from tests.acceptance.stack import Stack


@pytest.fixture(scope="module")
def setup_org(stack: Stack) -> str:
    """Org hostile with one local pool."""
    return stack.make_org("hostile")


def _push(stack: Stack, *entries: bytes) -> None:
    client = redis.Redis.from_url(stack.broker_url)
    try:
        for entry in entries:
            client.lpush(f"{stack.key_prefix}dispatch", entry)
    finally:
        client.close()


def _until(condition: Any, what: str, stack: Stack, timeout_s: float = 60) -> Any:
    return stack.until(condition, what, timeout_s)


def _items_by_key(db: Database, keys: list[str]) -> dict[str, WorkItem]:
    with db.session() as session:
        rows = session.scalars(select(WorkItem).where(WorkItem.idempotency_key.in_(keys)))
        return {row.idempotency_key or "": row for row in rows}


def _dead_letters(db: Database, since_id: int) -> list[DeadLetter]:
    with db.session() as session:
        return list(
            session.scalars(
                select(DeadLetter).where(DeadLetter.id > since_id).order_by(DeadLetter.id)
            )
        )


def _last_dead_letter(db: Database) -> int:
    with db.session() as session:
        return max(session.scalars(select(DeadLetter.id)).all(), default=0)


def _peak_rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
    raise AssertionError("no VmHWM")


def _push_the_shapes_then_two_good_messages(
    stack: Stack, org: str, celery: dict[str, tuple[str, bytes]], raw: dict[str, tuple[str, bytes]]
) -> None:
    """Every malformed shape, then a valid dispatch with a garbage time limit, then a good one."""
    _push(stack, *(entry for _, entry in celery.values()), *(entry for _, entry in raw.values()))
    _push(stack, hostile.garbage_timelimit(org, "hostile-timelimit"))
    _push(
        stack,
        hostile.envelope(
            [
                [hostile.dispatch_message(org, "echo after", idempotency_key="hostile-after")],
                {},
                {},
            ]
        ),
    )


def _assert_every_dispatch_acknowledged(stack: Stack) -> None:
    client = redis.Redis.from_url(stack.broker_url)
    try:  # everything was acknowledged: nothing waits, nothing is held in flight
        assert client.llen(f"{stack.key_prefix}dispatch") == 0
        held = list(client.scan_iter(f"{stack.key_prefix}corral.intake.inflight:*"))
        assert all(client.llen(key) == 0 for key in held)
    finally:
        client.close()


def test_every_malformed_shape_is_recorded_and_the_next_message_is_served(
    stack: Stack, setup_org: str, db: Database
) -> None:
    before = _last_dead_letter(db)
    celery = hostile.celery_shapes(setup_org)
    raw = hostile.raw_shapes()
    _push_the_shapes_then_two_good_messages(stack, setup_org, celery, raw)

    keys = [f"celery:{task_id}" for task_id, _ in celery.values()]
    invalid = _until(
        lambda: (found := _items_by_key(db, keys)) and len(found) == len(keys) and found,
        "the malformed Celery messages were not recorded",
        stack,
    )
    assert {item.state for item in invalid.values()} == {"dispatch_error"}
    assert {item.error_code for item in invalid.values()} == {"invalid_message"}

    letters = _until(
        lambda: (found := _dead_letters(db, before)) and len(found) >= len(raw) and found,
        "the raw messages were not dead-lettered",
        stack,
    )
    assert sorted(letter.reason for letter in letters) == sorted(r for r, _ in raw.values())
    assert {letter.queue for letter in letters} == {"dispatch"}
    assert max(letter.size_bytes for letter in letters) == 10 * 1024 * 1024

    good = stack.wait_final(
        [
            _until(
                lambda: _items_by_key(db, ["hostile-after"]).get("hostile-after"),
                "the message after them was not taken",
                stack,
            ).id
        ]
    )
    assert good[0]["state"] == "succeeded"
    timelimit = _items_by_key(db, ["hostile-timelimit"])["hostile-timelimit"]
    assert stack.wait_final([timelimit.id])[0]["state"] == "succeeded"
    _assert_every_dispatch_acknowledged(stack)
    stack.check_alive()


def test_a_malformed_message_published_to_the_exchange_reaches_the_scheduler_only(
    stack: Stack, setup_org: str, db: Database, sender: Any
) -> None:
    before = _last_dead_letter(db)
    queue = celery_app.app.amqp.queues["dispatch"]
    task_id = "hostile-exchange-1"
    with Connection(
        stack.broker_url, transport_options={"global_keyprefix": stack.key_prefix}
    ) as connection:
        producer = Producer(connection)
        producer.publish(
            hostile.with_secret(setup_org),
            exchange=Exchange(queue.exchange.name, "direct"),
            routing_key=queue.routing_key,
            serializer="json",
            headers={"task": "corral.dispatch", "id": task_id},
        )
    item = _until(
        lambda: _items_by_key(db, [f"celery:{task_id}"]).get(f"celery:{task_id}"),
        "the exchange's message was not recorded",
        stack,
    )
    assert (item.state, item.error_code) == ("dispatch_error", "invalid_message")
    stack.check_alive()
    assert _dead_letters(db, before) == []


def test_a_compression_bomb_is_refused_within_bounded_memory(
    stack: Stack, setup_org: str, db: Database
) -> None:
    pid = stack.processes["scheduler"].pid
    peak_before = _peak_rss_kib(pid)
    task_id, bomb = hostile.compression_bomb(setup_org)
    assert len(bomb) < 2 * 1024 * 1024  # sent: a few hundred KiB; inflated: 256 MiB
    _push(stack, bomb)
    key = f"celery:{task_id}"
    item = _until(lambda: _items_by_key(db, [key]).get(key), "the bomb was not recorded", stack)
    assert (item.state, item.error_code) == ("dispatch_error", "invalid_message")
    assert "inflates past the limit" in (item.error_message or "")
    growth_mib = (_peak_rss_kib(pid) - peak_before) / 1024
    assert growth_mib < 50, f"the scheduler's peak memory grew by {growth_mib:.0f} MiB"


def test_a_900_deep_message_becomes_an_invalid_message_item(
    stack: Stack, setup_org: str, db: Database
) -> None:
    task_id, entry = hostile.deep_message(setup_org)
    _push(stack, entry)
    key = f"celery:{task_id}"
    item = _until(lambda: _items_by_key(db, [key]).get(key), "not recorded", stack)
    assert (item.state, item.error_code) == ("dispatch_error", "invalid_message")
    assert "nested" in (item.error_message or "")


@pytest.mark.usefixtures("setup_org")
def test_no_value_a_hostile_message_carried_reaches_a_process_log(stack: Stack) -> None:
    # Runs after the tests above in this module (pytest keeps file order).
    logs = {name: stack.log_path(name).read_bytes() for name in stack.processes}
    assert logs["scheduler"], "the scheduler wrote no log"
    leaked = [name for name, text in logs.items() if hostile.SECRET.encode() in text]
    assert leaked == []
