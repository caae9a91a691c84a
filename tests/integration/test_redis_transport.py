"""corral's Redis transport on real Redis: what it pops and cannot deliver is a dead letter,
and what comes after it is delivered as usual."""

from __future__ import annotations

import contextlib
import hashlib
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import redis
from kombu import Exchange, Queue
from kombu.common import Broadcast
from sqlalchemy import select

from corral.shared import runtime
from corral.shared.broker import celery_app
from corral.shared.broker.celery_app import CorralConnection
from corral.shared.broker.redis_transport import (
    DELIVERED_FROM,
    GuardedRedisChannel,
    GuardedRedisTransport,
)
from corral.shared.settings import CoreSettings
from corral.shared.store.db import Database
from corral.shared.store.models import DeadLetter
from tests.acceptance.stack import delete_broker_keys

EXCHANGE = Exchange("corral", type="direct")
PLANTED = "planted-env-value-0b7e"


@pytest.fixture
def prefix(redis_url: str) -> Iterator[str]:
    key_prefix = f"corral-t-{uuid.uuid4().hex[:8]}:"
    yield key_prefix
    delete_broker_keys(redis_url, key_prefix)


@pytest.fixture
def dead_letters(sqlite_db: Database) -> Iterator[Database]:
    """The process's runtime, whose database the transport writes dead letters to."""
    runtime.install(runtime.Runtime(settings=CoreSettings(broker_url="memory://"), db=sqlite_db))
    yield sqlite_db
    runtime.reset()


def stored(db: Database) -> list[tuple[str, str, str]]:
    with db.session() as session:
        rows = session.scalars(select(DeadLetter).order_by(DeadLetter.id))
        return [(row.queue, row.reason, row.sha256) for row in rows]


def digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


GARBAGE = [b"\xff\xfe not utf-8", b"42", b""]
EXPECTED = ["not_json", "not_an_envelope", "not_json"]


def test_a_consumer_gets_the_message_after_garbage_and_the_garbage_is_dead_lettered(
    redis_url: str, prefix: str, dead_letters: Database
) -> None:
    queue = Queue(f"q-{uuid.uuid4().hex[:6]}", EXCHANGE, routing_key="brpop")
    client = redis.Redis.from_url(redis_url)
    received: list[tuple[Any, dict[str, Any]]] = []

    def on_message(body: Any, message: Any) -> None:
        received.append((body, message.delivery_info))
        message.ack()

    with CorralConnection(redis_url, transport_options={"global_keyprefix": prefix}) as conn:
        conn.Producer().publish({"n": 0}, exchange=EXCHANGE, routing_key="brpop", declare=[queue])
        client.lpush(f"{prefix}{queue.name}", *GARBAGE)  # queued between the two messages
        conn.Producer().publish({"n": 1}, exchange=EXCHANGE, routing_key="brpop", declare=[queue])
        with conn.Consumer([queue], callbacks=[on_message]):
            deadline = time.monotonic() + 10
            while len(received) < 2 and time.monotonic() < deadline:
                conn.drain_events(timeout=10)  # BRPOP, through the channel's _brpop_read
    client.close()
    assert [body for body, _ in received] == [{"n": 0}, {"n": 1}]
    assert all(info[DELIVERED_FROM] == queue.name for _, info in received)
    assert stored(dead_letters) == [
        (queue.name, reason, digest(data)) for data, reason in zip(GARBAGE, EXPECTED, strict=True)
    ]


def test_basic_get_skips_garbage_and_returns_the_message(
    redis_url: str, prefix: str, dead_letters: Database
) -> None:
    queue = Queue(f"q-{uuid.uuid4().hex[:6]}", EXCHANGE, routing_key="get")
    client = redis.Redis.from_url(redis_url)
    with CorralConnection(redis_url, transport_options={"global_keyprefix": prefix}) as conn:
        client.lpush(f"{prefix}{queue.name}", b"not json")
        conn.Producer().publish({"n": 1}, exchange=EXCHANGE, routing_key="get", declare=[queue])
        bound = queue(conn.default_channel)
        assert bound.get() is None  # RPOP took the garbage: nothing to deliver this time
        message = bound.get()
        assert message is not None and message.payload == {"n": 1}
        message.ack()
    client.close()
    assert stored(dead_letters) == [(queue.name, "not_json", digest(b"not json"))]


def test_a_malformed_fanout_message_is_dead_lettered_and_the_next_is_delivered(
    redis_url: str, prefix: str, dead_letters: Database, caplog: pytest.LogCaptureFixture
) -> None:
    broadcast = Broadcast(f"bc-{uuid.uuid4().hex[:6]}")
    client = redis.Redis.from_url(redis_url)
    received: list[Any] = []
    with CorralConnection(redis_url, transport_options={"global_keyprefix": prefix}) as conn:
        channel = conn.default_channel
        topic = channel._get_publish_topic(broadcast.exchange.name, broadcast.routing_key)
        with conn.Consumer([broadcast], callbacks=[lambda body, _: received.append(body)]):
            deadline = time.monotonic() + 10
            # Pub/sub keeps nothing for later: publish until the subscription (made by the
            # first drain) has seen both.
            while not received and time.monotonic() < deadline:
                client.publish(f"{prefix}{topic}", b'{"properties": "not an envelope"}')
                client.publish(f"{prefix}{topic}", f"{PLANTED} is not JSON".encode())
                conn.Producer().publish({"n": 1}, exchange=broadcast.exchange, routing_key="")
                with contextlib.suppress(TimeoutError):
                    conn.drain_events(timeout=0.5)
    client.close()
    assert received[:1] == [{"n": 1}]
    assert {(queue, reason) for queue, reason, _ in stored(dead_letters)} == {
        (broadcast.name, "not_an_envelope"),
        (broadcast.name, "not_json"),
    }
    assert PLANTED not in caplog.text  # kombu would log what it cannot decode


def test_unbinding_a_queue_removes_its_binding_from_redis(redis_url: str, prefix: str) -> None:
    legacy = Exchange("dispatch", type="direct")
    queue = Queue("maintenance", legacy, routing_key="dispatch")
    client = redis.Redis.from_url(redis_url)
    table = f"{prefix}_kombu.binding.dispatch"
    with CorralConnection(redis_url, transport_options={"global_keyprefix": prefix}) as conn:
        queue(conn.default_channel).declare()
        assert client.smembers(table) == {b"dispatch\x06\x16\x06\x16maintenance"}
        conn.default_channel.queue_unbind("maintenance", "dispatch", "dispatch")
        assert client.smembers(table) == set()
    client.close()


def test_a_channel_reuses_one_client_for_its_commands_until_its_pool_changes(
    redis_url: str, prefix: str
) -> None:
    client = redis.Redis.from_url(redis_url)
    with CorralConnection(redis_url, transport_options={"global_keyprefix": prefix}) as conn:
        channel = conn.default_channel
        with channel.conn_or_acquire() as first, channel.conn_or_acquire() as second:
            assert first is second  # kombu's own builds a client per publish and ack
        given = object()
        with channel.conn_or_acquire(given) as passed:
            assert passed is given
        queue = Queue("maintenance", EXCHANGE, routing_key="maintenance")
        queue(channel).declare()
        producer = conn.Producer(channel)
        for number in range(3):
            producer.publish({"n": number}, exchange=EXCHANGE, routing_key="maintenance")
        assert client.llen(f"{prefix}maintenance") == 3
        channel._disconnect_pools()  # as after a fork: a new pool, and a new client with it
        with channel.conn_or_acquire() as third:
            assert third is not first and third.connection_pool is channel.pool
            assert third.ping()
    client.close()


def test_celerys_pooled_connections_are_corrals(
    redis_url: str, prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Tasks and events are published through Celery's connection and producer pools: their
    connections must resolve to corral's transport too (kombu's pool makes plain pooled
    connections), so publishing shares its channel's one Redis client."""
    app = celery_app.configure(CoreSettings(broker_url=redis_url, broker_key_prefix=prefix))
    with app.pool.acquire(block=True) as connection:
        assert isinstance(connection.transport, GuardedRedisTransport)
    built = []
    real_init = redis.Redis.__init__

    def counted(self: redis.Redis, *args: Any, **kwargs: Any) -> None:
        built.append(self)
        real_init(self, *args, **kwargs)

    monkeypatch.setattr(redis.Redis, "__init__", counted)
    client = redis.Redis.from_url(redis_url)
    app.send_task("corral.redrive", args=[-1])  # the pool's connection and channel, made once
    built.clear()
    for number in range(5):
        with app.producer_or_acquire() as producer:
            assert isinstance(producer.channel, GuardedRedisChannel)
            app.send_task("corral.redrive", args=[number], producer=producer)
    assert client.llen(f"{prefix}maintenance") == 6
    assert not built, f"{len(built)} Redis clients built for 5 publishes"
    client.close()
