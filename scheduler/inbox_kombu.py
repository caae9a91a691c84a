"""The ``dispatch`` queue through kombu: RabbitMQ, and the in-process ``memory://`` broker.

On AMQP the broker itself keeps a delivered message until it is acknowledged (and hands it
to another consumer when the connection drops), so a plain consumer with manual
acknowledgements and a prefetch window of one batch is already reliable. Messages are taken
raw (``on_message``): kombu decodes nothing, so no body can raise inside kombu.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from typing import Any

from kombu import Connection, Consumer, Queue

from corral.scheduler.inbox import Delivery, Inbox
from corral.shared.broker.envelope import Envelope


class KombuInbox(Inbox):
    """A consumer of one kombu queue, with manual acknowledgement."""

    def __init__(self, connection: Connection, queue: Queue, *, prefetch: int) -> None:
        self._connection = connection
        self._errors = tuple(connection.connection_errors) + tuple(connection.channel_errors)
        try:
            self._channel = connection.channel()
            self._channel.basic_qos(0, prefetch, False)  # size, count, global
            self._pending: deque[Any] = deque()
            self._consumer = Consumer(
                self._channel, queues=[queue], on_message=self._pending.append, no_ack=False
            )
            self._consumer.consume()
        except self._errors as exc:
            raise ConnectionError(f"broker: {exc}") from exc

    def take(self, limit: int, *, wait_s: float) -> list[Delivery]:
        try:
            if not self._pending:
                self._drain(wait_s)
            while self._pending and len(self._pending) < limit and self._drain(0):
                pass
        except self._errors as exc:
            raise ConnectionError(f"broker: {exc}") from exc
        taken: list[Delivery] = []
        while self._pending and len(taken) < limit:
            taken.append(_delivery(self._pending.popleft()))
        return taken

    def _drain(self, timeout: float) -> bool:
        try:
            self._connection.drain_events(timeout=timeout)
        except TimeoutError:
            return False
        return True

    def ack(self, deliveries: Sequence[Delivery]) -> None:
        for delivery in deliveries:
            delivery.handle.ack()

    def release(self, deliveries: Sequence[Delivery]) -> None:
        for delivery in deliveries:
            delivery.handle.requeue()

    def close(self) -> None:
        for message in self._pending:
            message.requeue()
        self._pending.clear()
        try:
            self._consumer.cancel()
            self._channel.close()
        except self._errors:
            pass  # the connection is gone already: the broker takes the messages back
        self._connection.release()


def _delivery(message: Any) -> Delivery:
    body = message.body
    raw = body if isinstance(body, bytes) else str(body).encode("utf-8", "surrogatepass")
    headers = message.headers

    def read() -> Envelope:
        return Envelope(
            body=raw,
            headers=headers if headers is not None else {},
            content_type=message.content_type,
            content_encoding=message.content_encoding,
        )

    return Delivery(raw=raw, read=read, handle=message)
