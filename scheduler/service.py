"""Running the intake: the inbox for the configured broker and one loop per concurrency slot.

Redis gets the reliable :class:`~corral.scheduler.inbox_redis.RedisInbox`; any other broker
(RabbitMQ, ``memory://`` in ``corral dev``) a kombu consumer with manual acknowledgements.
"""

from __future__ import annotations

import logging
import socket
import threading
from collections.abc import Callable

from kombu.exceptions import OperationalError as BrokerError

from corral.scheduler.consumer import Intake, IntakeConfig
from corral.scheduler.control import IntakeState, serve_control
from corral.scheduler.events import IntakeEvents
from corral.scheduler.inbox import Inbox
from corral.scheduler.inbox_kombu import KombuInbox
from corral.scheduler.inbox_redis import RedisInbox
from corral.shared.broker import celery_app
from corral.shared.broker.queues import DISPATCH_QUEUE
from corral.shared.runtime import Runtime
from corral.shared.settings import IntakeSettings
from corral.shared.store.liveness import ConsumerBeat, consumer_name

log = logging.getLogger(__name__)


def inbox_opener(settings: IntakeSettings) -> Callable[[], Inbox]:
    """How each loop opens its inbox (again, after the broker went away)."""
    limits = settings.message_limits()
    if settings.broker_url.startswith(("redis://", "rediss://")):

        def open_redis() -> Inbox:
            declare_dispatch_queue()
            return RedisInbox(
                settings.broker_url,
                queue=DISPATCH_QUEUE,
                prefix=settings.broker_key_prefix,
                lease_s=settings.intake_lease_s,
                limits=limits,
            )

        return open_redis

    def open_kombu() -> Inbox:
        app = celery_app.app
        return KombuInbox(
            app.connection_for_read(),
            app.amqp.queues[DISPATCH_QUEUE],
            prefetch=settings.intake_batch,
        )

    return open_kombu


def declare_dispatch_queue() -> None:
    """Declare ``dispatch`` and its binding to the ``corral`` exchange, as any consumer does
    (on Redis the binding is what routes a publish to the exchange into the list; it is
    declared again whenever the inbox reconnects, since a Redis restarted empty lost it).

    Raises:
        ConnectionError: the broker cannot be reached.
    """
    app = celery_app.app
    with app.connection_for_write() as connection:
        errors = (OSError, BrokerError, *connection.connection_errors, *connection.channel_errors)
        try:
            app.amqp.queues[DISPATCH_QUEUE].bind(connection.default_channel).declare()
        except errors as exc:
            raise ConnectionError(f"broker: {type(exc).__name__}") from exc


def start_intake(
    rt: Runtime, *, concurrency: int, stop: threading.Event, name: str = "scheduler"
) -> list[threading.Thread]:
    """Start ``concurrency`` intake loops on daemon threads; they end when ``stop`` is set."""
    settings = rt.settings
    config = IntakeConfig(batch=settings.intake_batch, limits=settings.message_limits())
    opener = inbox_opener(settings)
    hostname = f"{name}@{socket.gethostname()}"
    state = IntakeState(loops=concurrency, batch=settings.intake_batch)
    # The process's rows of queue_consumers, fresh while a loop makes rounds (the metrics'
    # intake progress and the dispatch queue's consumers).
    beat = ConsumerBeat(rt.db, [DISPATCH_QUEUE], consumer_name(name), on_progress=True)
    threads = [serve_control(celery_app.app, hostname, state, stop), beat.start(stop)]
    for number in range(concurrency):
        events = IntakeEvents(celery_app.app, hostname, task_events=settings.task_events)
        intake = Intake(
            rt,
            opener,
            config=config,
            events=events,
            state=state,
            check_strays=number == 0,
            liveness=beat,
        )
        thread = threading.Thread(
            target=_serve, args=(intake, events, stop), name=f"intake-{number}", daemon=True
        )
        thread.start()
        threads.append(thread)
    return threads


def _serve(intake: Intake, events: IntakeEvents, stop: threading.Event) -> None:
    try:
        intake.run(stop)
    except BaseException:
        log.critical("intake loop stopped on an unexpected error", exc_info=True)
        raise
    finally:
        events.close()


def serve(rt: Runtime, *, concurrency: int, stop: threading.Event, name: str = "scheduler") -> int:
    """Run the intake until ``stop`` is set; the process's exit status.

    Every loop catches what a message or an outage can raise; a loop that still ends on its
    own is a bug, and the process exits non-zero so that its supervisor restarts it.
    """
    threads = start_intake(rt, concurrency=concurrency, stop=stop, name=name)
    log.info("intake ready.", extra={"loops": concurrency, "queue": DISPATCH_QUEUE})
    while not stop.is_set():
        if not all(thread.is_alive() for thread in threads):
            stop.set()
            for thread in threads:
                thread.join(timeout=30)
            return 1
        stop.wait(0.5)
    for thread in threads:
        thread.join(timeout=30)
    return 0
