"""The intake's kombu inbox on a real RabbitMQ: batches, acknowledgement after the work,
release back to the queue, and redelivery of what a consumer held when its connection
died. Each test uses a queue of its own on the default vhost, deleted afterwards."""

from __future__ import annotations

import os
import socket
import uuid
from collections.abc import Iterator

import pytest
from kombu import Connection, Exchange, Producer, Queue

from corral.scheduler.inbox_kombu import KombuInbox

AMQP_URL = os.environ.get("CORRAL_TEST_AMQP_URL", "amqp://guest:guest@127.0.0.1:5672//")


def _reachable() -> bool:
    try:
        with socket.create_connection(("127.0.0.1", 5672), timeout=1):
            return True
    except OSError:
        return False


@pytest.fixture
def queue() -> Iterator[Queue]:
    if not _reachable():
        if os.environ.get("CI"):
            pytest.fail("RabbitMQ is not reachable on 127.0.0.1:5672")
        pytest.skip("RabbitMQ is not reachable on 127.0.0.1:5672")
    name = f"corral-test-inbox-{uuid.uuid4().hex[:8]}"
    declared = Queue(name, Exchange(name, "direct"), routing_key=name, auto_delete=False)
    with Connection(AMQP_URL) as connection:
        declared.bind(connection.default_channel).declare()
    yield declared
    with Connection(AMQP_URL) as connection:
        channel = connection.default_channel
        declared.bind(channel).delete()
        declared.exchange.bind(channel).delete()


def _publish(queue: Queue, *bodies: bytes) -> None:
    with Connection(AMQP_URL) as connection:
        producer = Producer(connection.default_channel)
        for body in bodies:
            producer.publish(
                body,
                exchange=queue.exchange,
                routing_key=queue.routing_key,
                content_type="application/json",
                content_encoding="utf-8",
                headers={"task": "corral.dispatch"},
            )


def _inbox(queue: Queue) -> KombuInbox:
    return KombuInbox(Connection(AMQP_URL), queue, prefetch=10)


def test_a_batch_is_taken_acknowledged_and_released(queue: Queue) -> None:
    _publish(queue, b"[1]", b"[2]", b"[3]")
    inbox = _inbox(queue)
    try:
        taken: list[bytes] = []
        while len(taken) < 3:
            taken += [d.raw for d in inbox.take(10, wait_s=2)]
        assert taken == [b"[1]", b"[2]", b"[3]"]
        assert inbox.take(10, wait_s=0.2) == []
    finally:
        inbox.close()  # nothing acknowledged: RabbitMQ keeps all three
    again = _inbox(queue)
    try:
        held = []
        while len(held) < 3:
            held += again.take(10, wait_s=2)
        assert held[0].read().headers["task"] == "corral.dispatch"
        again.ack(held[:2])
        again.release(held[2:])
        back = again.take(10, wait_s=2)
        assert [d.raw for d in back] == [b"[3]"]
        again.ack(back)
    finally:
        again.close()
    empty = _inbox(queue)
    try:
        assert empty.take(10, wait_s=0.5) == []
    finally:
        empty.close()


def test_messages_held_by_a_dead_connection_come_back(queue: Queue) -> None:
    _publish(queue, b"[7]")
    doomed = _inbox(queue)
    assert [d.raw for d in doomed.take(10, wait_s=2)] == [b"[7]"]
    doomed._connection.collect()  # the socket goes as a killed process's would
    survivor = _inbox(queue)
    try:
        back = survivor.take(10, wait_s=5)
        assert [d.raw for d in back] == [b"[7]"]
        survivor.ack(back)
    finally:
        survivor.close()
