"""corral's Redis transport: kombu's, with every popped list entry checked before delivery.

kombu's Redis channel pops an entry off a queue list (``BRPOP`` in a worker, ``RPOP`` for
``basic_get``), decodes it and builds a message from it with no error handling: an entry
that is not JSON, not an object, lacks ``properties``/``delivery_tag``/``delivery_info`` or
has a body that is not base64 raises into the worker's event loop, which stops the worker.
Anything may be LPUSHed onto a Redis list, so here each entry is read within bounds first
(:func:`corral.shared.broker.envelope.parse_redis_entry`) and checked for what kombu's message, its
ack
emulation and Celery rely on (:func:`kombu_payload`). An entry that fails is a dead letter:
counted, logged without its body, stored, and gone from the list (it would fail the same
way on every delivery). Fan-out messages (Redis pub/sub: remote control, events) get the
same checks before kombu decodes them.

Each message delivered carries the queue it was popped from in its delivery info
(:data:`DELIVERED_FROM`), so a message set aside later, by the worker consumer, is recorded
against the queue it really came from, not the routing key its sender claimed.
"""

from __future__ import annotations

import base64
import binascii
import logging
from collections.abc import Iterator
from contextlib import contextmanager
from queue import Empty
from typing import Any

from kombu.transport import redis as kombu_redis
from kombu.utils.encoding import bytes_to_str
from kombu.utils.json import loads as kombu_loads

from corral.shared import runtime
from corral.shared.broker.deadletters import dead_letter
from corral.shared.broker.envelope import MalformedMessageError, decode_body, parse_redis_entry
from corral.shared.runtime import message_limits

DELIVERED_FROM = "corral_queue"
"""The delivery-info key holding the queue a message was popped from."""

MAX_PRIORITY = 255


log = logging.getLogger(__name__)


def kombu_payload(raw: bytes) -> dict[str, Any]:
    """The list entry ``raw``, decoded the way kombu decodes it, once it is known to be a
    message kombu can deliver and acknowledge.

    Raises:
        MalformedMessageError: anything else (over a limit, not JSON, not such a message).
    """
    limits = message_limits()
    envelope = parse_redis_entry(raw, limits)
    if envelope.headers.get("compression") is not None:
        # kombu inflates a compressed body when it builds the message, without a bound:
        # inflate it here first, within the limit.
        decode_body(envelope, limits)
    try:
        payload = kombu_loads(bytes_to_str(raw))
    except Exception as exc:  # kombu's typed values (`__type__`) may raise anything
        raise MalformedMessageError("not_json", "the message is not JSON kombu reads") from exc
    check_kombu_message(payload)
    return payload  # type: ignore[no-any-return]  # checked to be a dict just above


def check_kombu_message(payload: Any) -> None:
    """Check ``payload`` has what kombu's message and Redis ack emulation read from it.

    Raises:
        MalformedMessageError: it does not.
    """
    properties = payload.get("properties") if isinstance(payload, dict) else None
    if not isinstance(properties, dict):
        raise MalformedMessageError(
            "not_an_envelope", "the message is not a kombu envelope (an object with properties)"
        )
    tag, info = properties.get("delivery_tag"), properties.get("delivery_info")
    if not isinstance(tag, str) or not tag:
        raise MalformedMessageError("not_an_envelope", "the delivery tag is not a string")
    if not isinstance(info, dict) or not all(
        isinstance(info.get(key), str) for key in ("exchange", "routing_key")
    ):
        raise MalformedMessageError(
            "not_an_envelope", "the delivery info does not name an exchange and routing key"
        )
    priority = properties.get("priority")
    if priority is not None and (type(priority) is not int or not 0 <= priority <= MAX_PRIORITY):
        raise MalformedMessageError("not_an_envelope", "the priority is not a number 0-255")
    for key in ("content-type", "content-encoding"):
        if payload.get(key) is not None and not isinstance(payload[key], str):
            raise MalformedMessageError("not_an_envelope", f"the {key} is not a string")
    if payload.get("headers") is not None and not isinstance(payload["headers"], dict):
        raise MalformedMessageError("bad_headers", "the message headers are not an object")
    _check_body(payload.get("body"), properties.get("body_encoding"))


def _check_body(body: Any, encoding: Any) -> None:
    if body is None or body == "":
        return
    if not isinstance(body, str):
        raise MalformedMessageError("not_an_envelope", "the envelope's body is not a string")
    if encoding == "base64":
        try:
            base64.b64decode(body, validate=True)
        except (binascii.Error, ValueError) as exc:
            raise MalformedMessageError(
                "bad_body_encoding", "the body is not valid base64"
            ) from exc
    elif encoding is not None:
        raise MalformedMessageError("bad_body_encoding", "the body encoding is not base64")


class ClosedSafeQoS(kombu_redis.QoS):  # type: ignore[misc]  # kombu ships no types
    """kombu's Redis QoS, whose restore survives a connection that is already gone.

    When Redis goes away with messages unacknowledged, Celery closes the connection and
    kombu then restores those messages through it; with the connection closed, kombu cannot
    build a client (``AttributeError: 'NoneType' object has no attribute 'hostname'`` in
    ``_connparams``), and that error stopped the whole worker. The messages are still in
    Redis's unacknowledged set (if Redis kept them): kombu's visibility-timeout restore
    brings them back, and the database re-drive re-sends what Redis lost.
    """

    def restore_unacked(self, client: Any = None) -> None:
        try:
            super().restore_unacked(client)
        except AttributeError:
            if not self._connection_gone():
                raise
            log.warning(
                "could not restore %d unacknowledged messages: the broker connection is "
                "closed; they come back after the visibility timeout",
                len(self._delivered),
            )
            self._delivered.clear()

    def ack(self, delivery_tag: Any) -> None:
        # The same for a task that finishes after its connection was closed: its message
        # stays unacknowledged in Redis and may run again (every corral task may).
        try:
            super().ack(delivery_tag)
        except AttributeError:
            if not self._connection_gone():
                raise
            log.warning("an acknowledgement was lost with the broker connection")
            self._delivered.pop(delivery_tag, None)

    def _connection_gone(self) -> bool:
        connection = getattr(self.channel, "connection", None)
        return connection is None or getattr(connection, "client", None) is None


class GuardedRedisChannel(kombu_redis.Channel):  # type: ignore[misc]  # kombu ships no types
    """kombu's Redis channel; what it pops is delivered only if it can be a message."""

    QoS = ClosedSafeQoS
    _shared_client: Any = None

    @contextmanager
    def conn_or_acquire(self, client: Any = None) -> Iterator[Any]:
        """kombu's, but one Redis client per channel instead of a new one for every publish,
        event, ack and unacked-index write (building one costs more than the command). A
        client takes a connection from the channel's pool per command, so threads share it;
        when the channel makes a new pool (after a fork, say) it gets a new client too."""
        if client:
            yield client
            return
        pool = self.pool
        shared = self._shared_client
        if shared is None or shared.connection_pool is not pool:
            shared = self._shared_client = self._create_client()
        yield shared

    def _brpop_read(self, **options: Any) -> bool:
        # kombu's _brpop_read, with the entry checked between the pop and the delivery.
        try:
            try:
                popped = self.client.parse_response(self.client.connection, "BRPOP", **options)
            except self.connection_errors:
                # as kombu: disconnect, so the next poll reconnects
                self.client.connection.disconnect()
                raise
            if not popped:
                raise Empty()
            dest, item = popped
            queue = bytes_to_str(dest).rsplit(self.sep, 1)[0]
            self._queue_cycle.rotate(queue)
            payload = self._payload_or_dead_letter(item, queue)
            if payload is None:
                raise Empty()
            self.connection._deliver(payload, queue)
            return True
        finally:
            self._in_poll = None
            flush = getattr(self, "_flush_brpop_reauth", None)  # kombu >= 5.7
            if flush is not None:
                flush()

    def _get(self, queue: str) -> dict[str, Any]:
        # kombu's _get (basic_get), with the entry checked before it is returned.
        with self.conn_or_acquire() as client:
            for priority in self.priority_steps:
                item = client.rpop(self._q_for_pri(queue, priority))
                if item:
                    self._maybe_update_queues_expire(client, queue)
                    payload = self._payload_or_dead_letter(item, queue)
                    if payload is None:
                        raise Empty()
                    return payload
            self._maybe_update_queues_expire(client, queue)
            raise Empty()

    def _handle_message(self, client: Any, response: Any) -> dict[str, Any]:
        # kombu decodes a pub/sub message in _receive_one, logs up to 4 KB of it when it is
        # not JSON, and builds a message from it unchecked otherwise. Check it here, before:
        # what cannot be a message is a dead letter and reaches kombu without data, which
        # kombu skips.
        payload: dict[str, Any] = super()._handle_message(client, response)
        if bytes_to_str(payload["type"]).endswith("message") and payload["data"]:
            data = payload["data"]
            raw = data if isinstance(data, bytes) else str(data).encode()
            if self._payload_or_dead_letter(raw, self._fanout_queue(payload["channel"])) is None:
                payload["data"] = None
        return payload

    def _fanout_queue(self, channel: Any) -> str:
        """The fan-out queue a pub/sub channel delivers to (as kombu's _receive_one finds it)."""
        name = bytes_to_str(channel)
        if name.startswith("/"):
            name = name.partition(".")[2]
        return str(self._fanout_to_queue.get(name.split("/", 1)[0], "unknown"))

    def _payload_or_dead_letter(self, raw: bytes, queue: str) -> dict[str, Any] | None:
        try:
            payload = kombu_payload(raw)
        except MalformedMessageError as exc:
            dead_letter(exc, queue=queue, raw=raw, database=lambda: runtime.current().db)
            return None
        payload["properties"]["delivery_info"][DELIVERED_FROM] = queue
        return payload

    def queue_unbind(
        self,
        queue: str,
        exchange: str | None = None,
        routing_key: str = "",
        arguments: Any = None,
        **kwargs: Any,
    ) -> None:
        # kombu's virtual channel forgets the binding in this channel's state only; the
        # binding set in Redis, which every publisher reads, keeps it. Remove it there too.
        super().queue_unbind(queue, exchange, routing_key, arguments, **kwargs)
        if not exchange:
            return
        _, pattern, _ = self.typeof(exchange).prepare_bind(queue, exchange, routing_key, arguments)
        member = self.sep.join([routing_key or "", pattern or "", queue])
        with self.conn_or_acquire() as client, client.pipeline() as pipe:
            pipe.srem(self.keyprefix_queue % (exchange,), member)
            pipe.srem(self.keyprefix_binding_permanent % (exchange,), member)
            pipe.execute()


class GuardedRedisTransport(kombu_redis.Transport):  # type: ignore[misc]  # kombu ships no types
    """kombu's Redis transport with :class:`GuardedRedisChannel`."""

    Channel = GuardedRedisChannel
