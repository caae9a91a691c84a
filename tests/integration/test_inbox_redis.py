"""The reliable Redis inbox on a real Redis: a message is held in flight until acknowledged,
handed back in order when released, and recovered from a consumer that died holding it."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator

import pytest
import redis

from corral.scheduler.inbox_redis import RedisInbox, queue_keys


@pytest.fixture
def prefix(redis_url: str) -> Iterator[str]:
    key_prefix = f"corral-test-inbox-{uuid.uuid4().hex[:8]}:"
    yield key_prefix
    client = redis.Redis.from_url(redis_url)
    for key in client.scan_iter(f"{key_prefix}*"):
        client.delete(key)
    client.close()


def _push(redis_url: str, prefix: str, *messages: bytes, priority_list: int = 0) -> None:
    client = redis.Redis.from_url(redis_url)
    for message in messages:  # as kombu does: LPUSH, consumers pop from the right
        client.lpush(queue_keys("dispatch", prefix)[priority_list], message)
    client.close()


def _inbox(redis_url: str, prefix: str, lease_s: float = 10.0) -> RedisInbox:
    return RedisInbox(redis_url, queue="dispatch", prefix=prefix, lease_s=lease_s)


def test_take_ack_and_release_keep_every_message_and_its_order(redis_url: str, prefix: str) -> None:
    _push(redis_url, prefix, b"m1", b"m2", b"m3")
    _push(redis_url, prefix, b"urgent", priority_list=1)
    inbox = _inbox(redis_url, prefix)
    try:
        taken = inbox.take(3, wait_s=0)
        assert [d.raw for d in taken] == [b"m1", b"m2", b"m3"]
        inbox.ack(taken[:1])
        inbox.release(taken[1:])  # back to the head of the line, in order
        again = inbox.take(10, wait_s=0)
        assert [d.raw for d in again] == [b"m2", b"m3", b"urgent"]
        inbox.ack(again)
        assert inbox.take(10, wait_s=0.1) == []
        _push(redis_url, prefix, b"late")
        assert [d.raw for d in inbox.take(10, wait_s=2)] == [b"late"]
    finally:
        inbox.close()
    client = redis.Redis.from_url(redis_url)
    try:  # close() handed back the unacknowledged "late"
        assert client.lrange(queue_keys("dispatch", prefix)[0], 0, -1) == [b"late"]
    finally:
        client.close()


def test_a_dead_consumers_messages_are_delivered_again(redis_url: str, prefix: str) -> None:
    _push(redis_url, prefix, b"a", b"b")
    doomed = _inbox(redis_url, prefix, lease_s=1)
    assert [d.raw for d in doomed.take(10, wait_s=0)] == [b"a", b"b"]
    doomed._stop.set()  # its heartbeat stops as a SIGKILL would stop it; it never closes
    survivor = _inbox(redis_url, prefix, lease_s=1)
    try:
        assert survivor.recover() == 0  # its lease has not run out yet
        deadline = time.monotonic() + 10
        while survivor.recover() == 0:
            assert time.monotonic() < deadline, "the dead consumer's messages never came back"
            time.sleep(0.1)
        assert [d.raw for d in survivor.take(10, wait_s=0)] == [b"a", b"b"]
    finally:
        survivor.close()


def test_messages_in_an_unprefixed_queue_are_counted_as_strays(redis_url: str, prefix: str) -> None:
    inbox = _inbox(redis_url, prefix)
    client = redis.Redis.from_url(redis_url)
    stray_key = f"dispatch{prefix.rstrip(':')}"  # unprefixed keys of its own, not "dispatch"
    try:
        inbox._queue = stray_key  # count a list that no real deployment uses
        client.lpush(stray_key, b"x", b"y")
        assert inbox.stray_messages() == 2
    finally:
        client.delete(stray_key)
        client.close()
        inbox._queue = "dispatch"
        inbox.close()


def test_every_operation_on_an_unreachable_redis_is_a_connection_error() -> None:
    # What the intake loop waits out (it reopens the inbox and backs off); redis-py's own
    # errors are not ConnectionError and ended the loop, and with it the scheduler, when
    # Redis restarted while it acknowledged a batch or recovered another's messages.
    inbox = RedisInbox("redis://127.0.0.1:1/0", queue="dispatch", prefix="nowhere:")
    try:
        delivery = inbox._delivery(b"[1]")
        calls = [
            lambda: inbox.take(10, wait_s=0),
            lambda: inbox.ack([delivery]),
            lambda: inbox.release([delivery]),
            inbox.recover,
            inbox.stray_messages,
        ]
        for call in calls:
            with pytest.raises(ConnectionError, match="Redis"):
                call()
    finally:
        inbox.close()
