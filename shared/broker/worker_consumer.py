"""corral's Celery worker consumer: no message stops a worker, none is redelivered forever.

Celery's consumer hands each message to the task's strategy inside a handler that catches
only ``InvalidTaskError``, ``ContentDisallowed`` and ``DecodeError``; anything else a bad
message provokes (a ``TypeError`` from a body of the wrong shape, a ``ValueError`` from a
``timelimit`` that is no pair of numbers, ...) escapes into the event loop and stops the
worker, and since the message was never acknowledged it comes back to the next worker.
And where Celery does catch, it logs "The full contents of the message body was: ...",
which would put a dispatch's env values in the logs.

:class:`GuardedConsumer` (Celery's ``worker_consumer`` setting) therefore

- reads every message within bounds before Celery does
(:func:`corral.shared.broker.envelope.read_task`,
  :func:`corral.shared.broker.task_calls.check_celery_message`) and checks its arguments against the
  task's signature (:class:`corral.shared.broker.task_calls.TaskSignatures`);
- sets aside whatever fails, and whatever Celery's strategy still raises on: a dead letter
  (:func:`corral.shared.broker.deadletters.dead_letter`: counted, logged without the body, stored)
  and an
  acknowledgement, so it is gone for good;
- overrides Celery's handlers for unknown, invalid and undecodable messages to do the same,
  without quoting the body.

A message that passes goes to Celery's own handler unchanged (acks late, events, rate
limits, ETAs). Connection and channel errors, and anything raised while the worker shuts
down, still propagate: those are about the broker or the worker, not the message, and the
message is then restored as usual.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from celery import signals
from celery.worker import state
from celery.worker.consumer import Consumer

from corral.shared import runtime
from corral.shared.broker.deadletters import dead_letter
from corral.shared.broker.envelope import Envelope, MalformedMessageError, TaskCall, read_task
from corral.shared.broker.redis_transport import DELIVERED_FROM
from corral.shared.broker.task_calls import TaskSignatures, check_celery_message
from corral.shared.runtime import message_limits

log = logging.getLogger(__name__)

UNKNOWN_QUEUE = "unknown"


def body_bytes(message: Any) -> bytes:
    """The message body as bytes (kombu gives bytes, or text on some transports)."""
    body = message.body
    if isinstance(body, bytes):
        return body
    if isinstance(body, str):
        return body.encode("utf-8", errors="surrogatepass")
    if isinstance(body, bytearray | memoryview):
        return bytes(body)
    return b""


def read_task_message(message: Any, signatures: TaskSignatures) -> TaskCall:
    """The task call in kombu ``message``, once it is known a Celery worker can take it.

    Raises:
        MalformedMessageError: it cannot.
    """
    headers = message.headers
    if isinstance(headers, dict):
        # kombu inflated a compressed body when it built the message.
        headers = {key: value for key, value in headers.items() if key != "compression"}
    envelope = Envelope(
        body=body_bytes(message),
        headers=headers,
        content_type=message.content_type,
        content_encoding=message.content_encoding,
    )
    call = read_task(envelope, message_limits())
    try:
        body = message.decode()  # kombu's decoding, cached: what Celery's strategy reads
    except Exception as exc:
        raise MalformedMessageError(
            "decode_error", "kombu cannot decode the body", task_name=call.name, task_id=call.id
        ) from exc
    check_celery_message(call, message.headers, body)
    signatures.check(call)
    return call


def _named(message: Any) -> dict[str, str | None]:
    headers = message.headers if isinstance(message.headers, dict) else {}
    name, ident = headers.get("task"), headers.get("id")
    return {
        "task_name": name if isinstance(name, str) else None,
        "task_id": ident if isinstance(ident, str) else None,
    }


def _forget_request(message: Any) -> None:
    """Drop the request Celery's strategy reserved for ``message`` before it raised, so its
    slot (prefetch is disabled: a reserved request holds one) is free again."""
    for request in list(state.reserved_requests) + list(state.scheduled_requests):
        if getattr(request, "message", None) is message:
            state.task_ready(request)


class GuardedConsumer(Consumer):  # type: ignore[misc]  # celery ships no types
    """Celery's worker consumer, setting aside what cannot be a task for this worker."""

    def create_task_handler(self, *args: Any, **kwargs: Any) -> Callable[[Any], Any]:
        stock = super().create_task_handler(*args, **kwargs)
        signatures = TaskSignatures(self.app.tasks)

        def on_task_received(message: Any) -> Any:
            try:
                read_task_message(message, signatures)
            except MalformedMessageError as exc:
                return self.set_aside(message, exc)
            try:
                return stock(message)
            except Exception as exc:
                if self._propagates(exc):
                    raise
                _forget_request(message)
                refused = MalformedMessageError(
                    "task_refused",
                    f"Celery's worker could not take the task ({type(exc).__name__})",
                    **_named(message),
                )
                return self.set_aside(message, refused)

        return on_task_received

    def _propagates(self, exc: Exception) -> bool:
        broker_errors = (*self.connection_errors, *self.channel_errors)
        return isinstance(exc, broker_errors) or bool(state.should_stop or state.should_terminate)

    def set_aside(self, message: Any, exc: MalformedMessageError) -> None:
        """Dead-letter ``message`` for ``exc`` and acknowledge it."""
        queue, raw = self.queue_of(message), body_bytes(message)
        dead_letter(exc, queue=queue, raw=raw, database=lambda: runtime.current().db)
        if not message.acknowledged:
            message.ack_log_error(log, self.connection_errors)
        signals.task_rejected.send(sender=self, message=message, exc=exc)

    def queue_of(self, message: Any) -> str:
        """The queue ``message`` was consumed from.

        On Redis, corral's transport writes it in the delivery info; on AMQP, the consumer
        tag names it. A routing key is believed only if it is a queue this worker consumes
        (a sender may claim any): what is not known is ``unknown``.
        """
        info = message.delivery_info if isinstance(message.delivery_info, dict) else {}
        delivered_from = info.get(DELIVERED_FROM)
        if isinstance(delivered_from, str):
            return delivered_from
        tags = getattr(self.task_consumer, "_active_tags", None) or {}
        for queue, tag in tags.items():
            if tag == info.get("consumer_tag"):
                return str(queue)
        consumed = list(self.app.amqp.queues.consume_from)
        if info.get("routing_key") in consumed:
            return str(info["routing_key"])
        return str(consumed[0]) if len(consumed) == 1 else UNKNOWN_QUEUE

    # Celery's own handlers for what its handler does catch: the same, without the body.

    def on_unknown_message(self, body: Any, message: Any) -> None:
        refused = MalformedMessageError(
            "unknown_message", "the message names no task", **_named(message)
        )
        self.set_aside(message, refused)

    def on_unknown_task(self, body: Any, message: Any, exc: Exception) -> None:
        refused = MalformedMessageError(
            "unknown_task", "no task of that name is registered in this worker", **_named(message)
        )
        self.set_aside(message, refused)

    def on_invalid_task(self, body: Any, message: Any, exc: Exception) -> None:
        refused = MalformedMessageError(
            "invalid_task", f"Celery refused the task ({type(exc).__name__})", **_named(message)
        )
        self.set_aside(message, refused)

    def on_decode_error(self, message: Any, exc: Exception) -> None:
        refused = MalformedMessageError(
            "decode_error", f"the body does not decode ({type(exc).__name__})", **_named(message)
        )
        self.set_aside(message, refused)
