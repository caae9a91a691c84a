"""The scheduler's intake: takes dispatch messages in batches, survives any bytes it is given.

``corral scheduler`` runs one :class:`Intake` loop per ``--concurrency``. Each loop takes up
to ``intake_batch`` messages from its :class:`~corral.scheduler.inbox.Inbox` (without waiting for
a batch to fill), reads each as a Celery task call (:mod:`corral.shared.broker.envelope`, within
bounds),
and handles it:

- ``corral.dispatch``: validate, write the work item, route it, publish its provision task;
- ``corral.route``: route an item the api or a worker already wrote;
- anything else, or bytes that are no task call at all: a dead letter
  (:mod:`corral.shared.broker.deadletters`). A ``corral.dispatch`` whose arguments cannot be read
  becomes
  a work item in ``dispatch_error`` with code ``invalid_message``.

A message is acknowledged only after its item is committed and its provision task
published; so a process killed anywhere in between has its messages delivered again, and
the idempotency key (the Celery task id for a message without one) makes the second
delivery find the first item instead of writing another. While the database is
unreachable the batch goes back to the queue and the loop backs off. No message can stop
the loop: whatever one message raises is recorded against it and the next is served.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kombu.utils.url import sanitize_url
from sqlalchemy.exc import DBAPIError, InterfaceError, OperationalError
from sqlalchemy.exc import TimeoutError as PoolTimeoutError

from corral.scheduler.batch import accept_batch, owed
from corral.scheduler.control import IntakeState
from corral.scheduler.events import IntakeEvents
from corral.scheduler.inbox import Delivery, Inbox
from corral.scheduler.intake import (
    Origin,
    message_of,
    origin_of,
    read_request,
    record_invalid,
    route_item,
    take_dispatch,
    task_key,
)
from corral.scheduler.publish import ask_for_waiting, enqueue, enqueue_all
from corral.scheduler.tasks import dispatch_summary
from corral.shared.broker.deadletters import record_dead_letter, safe_identifier
from corral.shared.broker.envelope import (
    DEFAULT_LIMITS,
    Limits,
    MalformedMessageError,
    TaskCall,
    read_task,
)
from corral.shared.broker.queues import DISPATCH_QUEUE
from corral.shared.messages import DispatchRequest
from corral.shared.runtime import Runtime
from corral.shared.store.liveness import ConsumerBeat

log = logging.getLogger(__name__)
ACTOR = "scheduler"
DISPATCH_TASK = "corral.dispatch"
ROUTE_TASK = "corral.route"
RECOVER_EVERY_S = 5.0
STRAY_CHECK_EVERY_S = 60.0


class DatabaseUnavailableError(Exception):
    """The database did not answer; the batch's rest goes back to the queue."""


def is_transient(exc: BaseException) -> bool:
    """A database error that says nothing about the message: try again later."""
    if isinstance(exc, OperationalError | InterfaceError | PoolTimeoutError):
        return True
    return isinstance(exc, DBAPIError) and bool(exc.connection_invalidated)


@dataclass
class IntakeConfig:
    batch: int = 100
    wait_s: float = 1.0
    limits: Limits = DEFAULT_LIMITS
    backoff_max_s: float = 10.0


class Intake:
    """One intake loop: an inbox, the handlers, and the events Flower shows."""

    def __init__(
        self,
        rt: Runtime,
        open_inbox: Callable[[], Inbox],
        *,
        config: IntakeConfig,
        events: IntakeEvents | None = None,
        state: IntakeState | None = None,
        check_strays: bool = False,
        liveness: ConsumerBeat | None = None,
    ) -> None:
        self._rt, self._open_inbox, self._config = rt, open_inbox, config
        self._events = events
        self._liveness = liveness  # told after each round: the intake's progress
        self._state = state
        self._check_strays = check_strays
        self._handlers: dict[str, Callable[[TaskCall], str]] = {
            ROUTE_TASK: self._route,
        }

    # -- the loop --------------------------------------------------------------------------

    def run(self, stop: threading.Event) -> None:
        """Serve until ``stop`` is set; back off (never exit) while the broker or database
        is away."""
        failures = 0
        inbox: Inbox | None = None
        next_recover = next_stray = 0.0
        while not stop.is_set():
            try:
                if inbox is None:
                    inbox = self._open_inbox()
                now = time.monotonic()
                if now >= next_recover:
                    inbox.recover()
                    next_recover = now + RECOVER_EVERY_S
                if self._check_strays and now >= next_stray:
                    _warn_strays(inbox)
                    next_stray = now + STRAY_CHECK_EVERY_S
                if self._events is not None:
                    self._events.heartbeat()
                if self._state is not None and not self._state.consuming.is_set():
                    stop.wait(0.2)  # paused by remote control (cancel_consumer)
                    continue
                deliveries = inbox.take(self._config.batch, wait_s=self._config.wait_s)
                if self._state is not None and not self._state.consuming.is_set():
                    inbox.release(deliveries)  # paused while this loop waited
                    continue
                self.process(inbox, deliveries)
                failures = 0
                if self._liveness is not None:
                    self._liveness.progressed()
            except (ConnectionError, DatabaseUnavailableError) as exc:
                failures += 1
                delay = _backoff(failures, self._config.backoff_max_s)
                log.warning(
                    "intake: %s; retrying in %.1f s",
                    _kind(exc, broker=self._rt.settings.broker_url),
                    delay,
                )
                if isinstance(exc, ConnectionError) and inbox is not None:
                    _close_quietly(inbox)
                    inbox = None
                stop.wait(delay)
        if inbox is not None:
            _close_quietly(inbox)

    def process(self, inbox: Inbox, deliveries: Sequence[Delivery]) -> None:
        """Handle one batch: every ``corral.dispatch`` in it in one transaction, the rest
        one by one; acknowledge it all, or hand it all back when the database is away.

        Raises:
            DatabaseUnavailableError: after handing the batch back.
        """
        dispatches: list[tuple[Delivery, TaskCall]] = []
        others: list[tuple[Delivery, TaskCall | MalformedMessageError]] = []
        for delivery in deliveries:
            read = self._read(delivery)
            if isinstance(read, TaskCall) and read.name == DISPATCH_TASK:
                dispatches.append((delivery, read))
            else:
                others.append((delivery, read))
        try:
            self._guarded(lambda: self._dispatch_batch(dispatches), [c for _, c in dispatches])
            for delivery, read in others:
                self.handle(delivery, read)
        except DatabaseUnavailableError:
            inbox.release(deliveries)  # a second delivery of what did commit is harmless
            raise
        finally:
            if self._events is not None:
                self._events.flush()
        inbox.ack(deliveries)

    def _read(self, delivery: Delivery) -> TaskCall | MalformedMessageError:
        try:
            call = read_task(delivery.read(), self._config.limits)
        except MalformedMessageError as exc:
            return exc
        if self._events is not None:
            self._events.received(call, _summary(call))
        return call

    def _guarded(self, step: Callable[[], None], calls: Sequence[TaskCall]) -> None:
        """Run ``step``; a database outage escapes, anything else fails only ``calls``."""
        try:
            step()
        except Exception as exc:
            if is_transient(exc):
                raise DatabaseUnavailableError(_kind(exc)) from exc
            log.error(
                "intake: a batch could not be handled (%s); one by one instead",
                type(exc).__name__,
                exc_info=True,
            )
            for call in calls:  # each on its own, so one bad message fails alone
                self._one_by_one(call)

    def _one_by_one(self, call: TaskCall) -> None:
        try:
            self._finish(
                call,
                take_dispatch(
                    self._rt.db,
                    call.args,
                    call.kwargs,
                    task_id=call.id,
                    actor=ACTOR,
                    settings=self._rt.settings,
                    callbacks=call.callbacks,
                    errbacks=call.errbacks,
                ),
            )
        except Exception as exc:
            if is_transient(exc):
                raise DatabaseUnavailableError(_kind(exc)) from exc
            self._unexpected(None, call, exc)

    def _dispatch_batch(self, calls: Sequence[tuple[Delivery, TaskCall]]) -> None:
        valid: list[tuple[TaskCall, DispatchRequest, Origin]] = []
        for _, call in calls:
            read = self._validated(call)
            if read is not None:
                valid.append((call, *read))
        rt = self._rt
        taken = accept_batch(
            rt.db,
            [request for _, request, _ in valid],
            actor=ACTOR,
            settings=rt.settings,
            origins=[origin for _, _, origin in valid],
        )
        outcomes = owed(rt.db, taken, actor=ACTOR, settings=rt.settings)
        enqueue_all(outcomes)
        ask_for_waiting(outcomes)
        for (call, _, origin), one in zip(valid, taken, strict=True):
            if not one.created:  # an earlier message's item: it owes this one's reply too
                origin.owed_by(rt.db, one.item_id)
            self._finish(call, one.item_id)

    def _validated(self, call: TaskCall) -> tuple[DispatchRequest, Origin] | None:
        """The call's request and origin, or None after recording it as an invalid message
        (its arguments, or its callbacks, refused)."""
        key = task_key(call.id)
        origin, refused = origin_of(call.id, call.callbacks, call.errbacks, self._rt.settings)
        ok, message = message_of(call.args, call.kwargs)
        request = read_request(ok, message, refused)
        if not isinstance(request, DispatchRequest):
            item_id = record_invalid(
                self._rt.db,
                message if ok else None,
                request,
                actor=ACTOR,
                idempotency_key=key,
                origin=origin,
            )
            log.warning("invalid dispatch message recorded", extra={"work_item_id": item_id})
            self._finish(call, item_id)
            return None
        if request.idempotency_key is None and key is not None:
            request = request.model_copy(update={"idempotency_key": key})
        return request, origin

    def _finish(self, call: TaskCall, result: str) -> None:
        if self._state is not None:
            self._state.count(call.name)
        if self._events is not None:
            self._events.succeeded(call, result, 0.0)

    # -- one message -------------------------------------------------------------------------

    def handle(self, delivery: Delivery, read: TaskCall | MalformedMessageError) -> None:
        """Handle one message that is no ``corral.dispatch`` batch member; only a database
        outage escapes."""
        if isinstance(read, MalformedMessageError):
            self._guarded_one(delivery, None, lambda: self._malformed(delivery, read))
            return
        handler = self._handlers.get(read.name)
        if handler is None:
            detail = "no corral intake task has this name"
            self._dead_letter(delivery, "unknown_task", detail, read.name, read.id)
            return
        self._guarded_one(delivery, read, lambda: self._finish(read, handler(read)))

    def _guarded_one(
        self, delivery: Delivery, call: TaskCall | None, step: Callable[[], None]
    ) -> None:
        try:
            step()
        except MalformedMessageError as exc:
            self._malformed(delivery, exc)
        except Exception as exc:
            if is_transient(exc):
                raise DatabaseUnavailableError(_kind(exc)) from exc
            self._unexpected(delivery, call, exc)

    def _malformed(self, delivery: Delivery, exc: MalformedMessageError) -> None:
        if exc.task_name == DISPATCH_TASK:
            # Its body unread (too large, say): its sender is still owed its result (and
            # its callbacks, when they could be read).
            settings = self._rt.settings
            origin, _ = origin_of(exc.task_id, exc.callbacks, exc.errbacks, settings)
            record_invalid(
                self._rt.db,
                None,
                exc.message,  # record_invalid says "invalid dispatch message: " before it
                actor=ACTOR,
                idempotency_key=task_key(exc.task_id),
                origin=origin,
            )
            return
        self._dead_letter(delivery, exc.reason, exc.message, exc.task_name, exc.task_id)

    def _unexpected(self, delivery: Delivery | None, call: TaskCall | None, exc: Exception) -> None:
        # A bug or a value the database refused: recorded against the message, never fatal.
        log.error("intake: a message could not be handled (%s)", type(exc).__name__, exc_info=True)
        if self._events is not None and call is not None:
            self._events.failed(call, type(exc).__name__)
        if call is not None and call.name == DISPATCH_TASK:
            try:
                settings = self._rt.settings
                origin, _ = origin_of(call.id, call.callbacks, call.errbacks, settings)
                record_invalid(
                    self._rt.db,
                    None,
                    "the dispatch message could not be stored",
                    actor=ACTOR,
                    idempotency_key=task_key(call.id),
                    origin=origin,
                )
                return
            except Exception:
                log.error("intake: could not record the message either", exc_info=True)
        name, ident = (call.name, call.id) if call is not None else (None, None)
        raw = delivery.raw if delivery is not None else b""
        record_dead_letter(
            self._rt.db,
            queue=DISPATCH_QUEUE,
            reason="unhandled",
            detail=type(exc).__name__,
            raw=raw,
            task_name=name,
            task_id=ident,
        )

    def _dead_letter(
        self, delivery: Delivery, reason: str, detail: str, name: str | None, ident: str | None
    ) -> None:
        record_dead_letter(
            self._rt.db,
            queue=DISPATCH_QUEUE,
            reason=reason,
            detail=detail,
            raw=delivery.raw,
            task_name=name,
            task_id=ident,
        )

    # -- the tasks ---------------------------------------------------------------------------

    def _route(self, call: TaskCall) -> str:
        if len(call.args) != 1 or call.kwargs or not isinstance(call.args[0], str):
            raise MalformedMessageError(
                "bad_call_shape",
                "corral.route takes one item id",
                task_name=call.name,
                task_id=call.id,
            )
        try:
            outcome = route_item(self._rt.db, call.args[0], actor=ACTOR, settings=self._rt.settings)
        except LookupError:
            log.warning("intake: corral.route for an item that does not exist")
            return "unknown item"
        enqueue(outcome)
        return outcome.state.value


def _summary(call: TaskCall) -> str:
    if call.name == DISPATCH_TASK:
        return dispatch_summary(call.args, call.kwargs)
    return " ".join(filter(None, (safe_identifier(a) for a in call.args)))


def _warn_strays(inbox: Inbox) -> None:
    strays = inbox.stray_messages()
    if strays:
        log.warning(
            "intake: %d messages wait in the unprefixed queue 'dispatch', which no scheduler "
            "of this deployment reads: their sender does not use the broker key prefix "
            "(Celery: broker_transport_options={'global_keyprefix': ...})",
            strays,
        )


def _backoff(failures: int, cap: float) -> float:
    return random.uniform(0.5, min(cap, 0.5 * 2**failures))  # noqa: S311 - jitter


def _kind(exc: BaseException, *, broker: str | None = None) -> str:
    if isinstance(exc, DatabaseUnavailableError):
        return f"the database is unavailable ({exc})"
    if isinstance(exc, ConnectionError):
        where = f" at {sanitize_url(broker)} (CORRAL_BROKER_URL)" if broker else ""
        return f"the broker{where} is unavailable ({str(exc).strip() or type(exc).__name__})"
    return type(exc).__name__


def _close_quietly(inbox: Inbox) -> None:
    try:
        inbox.close()
    except Exception:
        log.warning("intake: could not close the inbox", exc_info=True)
