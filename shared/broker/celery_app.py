"""corral's Celery application and its configuration (docs/architecture.md §2).

JSON only; tasks are acknowledged after they ran (``acks_late``, and
``reject_on_worker_lost`` for pools with child processes). On Redis, a message whose worker
died unacknowledged is delivered again after the visibility timeout, which is set to twice
the provision lease. Every task tolerates a second delivery: dispatch by its idempotency
key, provision by its sandbox row and lease, terminate and re-drive by their state checks.
corral's tasks store no result: state lives in the database; a result backend the deployment
names receives only each dispatch message's final record. Task events are on for Flower.
Every task name starts with ``corral.``.

Exchanges and routing: every queue is bound to the direct exchange ``corral`` with its own
name as routing key (:func:`corral_queue`), and every task is sent to that exchange with its
queue's name as routing key (:func:`route_task`), so one publish lands in one queue.

Broker messages that cannot be a task are dead letters, never a stopped worker: on Redis,
corral's transport (:mod:`corral.shared.broker.redis_transport`, chosen by
:class:`CorralConnection` for
``redis://`` and ``rediss://`` URLs) sets aside list entries that are no kombu message;
on every broker, corral's worker consumer (:mod:`corral.shared.broker.worker_consumer`) sets aside
messages that are no task call this worker can run.
"""

from __future__ import annotations

import logging
from typing import Any

from celery import Celery
from celery.app.amqp import AMQP
from kombu import Connection, Exchange, Queue
from kombu.connection import ConnectionPool, PooledConnection
from kombu.utils.collections import HashedSeq

from corral.providers.registry import default_registry
from corral.shared.broker.queues import (
    DISPATCH_QUEUE,
    EXCHANGE,
    LEGACY_EXCHANGE,
    MAINTENANCE_QUEUE,
    provider_queues,
)
from corral.shared.broker.redis_transport import GuardedRedisTransport
from corral.shared.settings import CoreSettings

log = logging.getLogger(__name__)

TASK_MODULES = ("corral.scheduler.tasks", "corral.worker.tasks")
CORRAL_EXCHANGE = Exchange(EXCHANGE, type="direct", durable=True)

# The queue of each task that always travels on the same one; corral.provision names its
# queue when it is sent (provision.<provider>[.gpu]).
TASK_QUEUES = {
    "corral.dispatch": DISPATCH_QUEUE,
    "corral.route": DISPATCH_QUEUE,
    "corral.terminate": MAINTENANCE_QUEUE,
    "corral.terminate_many": MAINTENANCE_QUEUE,
    "corral.redrive": MAINTENANCE_QUEUE,
    "corral.reaper.sweep": MAINTENANCE_QUEUE,
    "corral.warm.tick": MAINTENANCE_QUEUE,
    "corral.outcomes.deliver": MAINTENANCE_QUEUE,
}


def corral_queue(name: str) -> Queue:
    """Queue ``name``, bound to the ``corral`` exchange with routing key ``name``."""
    return Queue(name, exchange=CORRAL_EXCHANGE, routing_key=name)


def route_task(
    name: str, args: Any, kwargs: Any, options: dict[str, Any], task: Any = None, **_: Any
) -> dict[str, str]:
    """Celery router: the task's queue, published to the broker's default exchange with the
    queue's name as routing key, which reaches that queue and no other.

    Not through the ``corral`` exchange: on Redis that route depends on kombu's binding
    table, which a Redis restarted empty no longer holds (a publish then lands in kombu's
    undeliverable list until some consumer declares its queue again); the default exchange
    needs no binding, on Redis as on RabbitMQ. The queues are still bound to ``corral``,
    each with its own routing key, for senders that publish there.
    """
    queue = options.get("queue")
    if isinstance(queue, Queue):
        queue = queue.name
    queue_name = queue if isinstance(queue, str) else TASK_QUEUES.get(name, DISPATCH_QUEUE)
    return {"queue": queue_name, "exchange": "", "routing_key": queue_name}


class CorralConnection(Connection):  # type: ignore[misc]  # kombu ships no types
    """kombu's connection, with corral's Redis transport for ``redis://`` and ``rediss://``.

    The URL keeps its scheme (so ``as_uri()``, Flower's broker view and kombu's ``rediss``
    TLS defaults see plain Redis); only the transport class it resolves to is corral's.
    """

    def get_transport_cls(self) -> Any:
        if self.transport_cls in ("redis", "rediss"):
            return GuardedRedisTransport
        return super().get_transport_cls()

    def __eqhash__(self) -> Any:
        # kombu's pool registry keys pools by this: never share one with a plain connection.
        return HashedSeq("corral", *super().__eqhash__())

    def Pool(self, limit: int | None = None, **kwargs: Any) -> ConnectionPool:  # noqa: N802
        """kombu's pool of this connection, whose connections are corral's too (kombu's own
        pool makes plain :class:`~kombu.connection.PooledConnection` objects, which would
        resolve ``redis://`` to kombu's transport: every publish through Celery's producer
        pool would lose :mod:`corral.shared.broker.redis_transport`)."""
        return _CorralConnectionPool(self, limit=limit, **kwargs)


class _PooledCorralConnection(PooledConnection, CorralConnection):  # type: ignore[misc]
    """A connection of :class:`_CorralConnectionPool`: kombu's pooled connection (closed on
    error, when the pool has a limit) with corral's transport."""


class _CorralConnectionPool(ConnectionPool):  # type: ignore[misc]  # kombu ships no types
    def new(self) -> _PooledCorralConnection:
        return _PooledCorralConnection(self, **dict(self.connection._info(resolve=False)))


class CorralAMQP(AMQP):  # type: ignore[misc]  # celery ships no types
    """Celery's broker glue for :data:`app`: corral's connection, and queues made on the fly
    (another provider's ``provision.<id>``) bound to the ``corral`` exchange like the rest."""

    Connection = CorralConnection

    def autoexchange(self, name: str) -> Exchange:
        return CORRAL_EXCHANGE


app = Celery("corral", amqp=CorralAMQP)


def celery_config(settings: CoreSettings) -> dict[str, Any]:
    names = [DISPATCH_QUEUE, MAINTENANCE_QUEUE]
    for provider_id in default_registry.known_ids():  # no queue for a provider corral lacks
        names += provider_queues(provider_id)
    queues = [corral_queue(name) for name in names]
    transport_options: dict[str, Any] = {"visibility_timeout": 2 * settings.provision_lease_s}
    if settings.broker_key_prefix:
        transport_options["global_keyprefix"] = settings.broker_key_prefix
    return {
        "broker_url": settings.broker_url,
        "broker_transport_options": transport_options,
        "broker_connection_retry_on_startup": True,
        "task_serializer": "json",
        "accept_content": ["json"],
        "event_serializer": "json",
        "task_acks_late": True,
        "task_reject_on_worker_lost": True,
        # corral's tasks store no result; CORRAL_RESULT_BACKEND gets the dispatches' records
        # (corral.worker.outcome_sinks.celery_result), as JSON.
        "task_ignore_result": True,
        "result_backend": None,
        "result_serializer": "json",
        "result_accept_content": ["json"],
        "task_track_started": False,
        "worker_prefetch_multiplier": 1,
        # On Redis, a worker takes a message only when it has a free slot to run it: what
        # waits is on the queue list, so its length is the real backlog autoscaling reads.
        "worker_disable_prefetch": settings.broker_url.startswith(("redis://", "rediss://")),
        "worker_send_task_events": settings.task_events,
        "task_send_sent_event": True,
        "worker_hijack_root_logger": False,
        "task_queues": queues,
        "task_default_queue": DISPATCH_QUEUE,
        "task_default_exchange": EXCHANGE,
        "task_default_exchange_type": "direct",
        "task_default_routing_key": DISPATCH_QUEUE,
        "task_routes": ("corral.shared.broker.celery_app:route_task",),
        # Malformed messages are dead letters, never a stopped worker
        # (corral.shared.broker.worker_consumer).
        "worker_consumer": "corral.shared.broker.worker_consumer:GuardedConsumer",
        "beat_schedule": beat_schedule(settings),
        "imports": TASK_MODULES,
    }


def beat_schedule(settings: CoreSettings) -> dict[str, Any]:
    """What beat sends, and how often."""
    return {
        "redrive": {"task": "corral.redrive", "schedule": settings.redrive_interval_s},
        # A sweep that waited longer than one interval is dropped: the next one is due.
        "reaper": {
            "task": "corral.reaper.sweep",
            "schedule": settings.reaper_interval_s,
            "options": {"expires": settings.reaper_interval_s},
        },
        # Warm pools: end stale warm sandboxes, make the missing (docs/warm-pools.md).
        "warm": {
            "task": "corral.warm.tick",
            "schedule": settings.warm_interval_s,
            "options": {"expires": settings.warm_interval_s},
        },
        # The outcomes ended items owe: results stored, callbacks sent (docs/intake.md).
        "outcomes": {
            "task": "corral.outcomes.deliver",
            "schedule": settings.outcome_interval_s,
            "options": {"expires": settings.outcome_interval_s},
        },
    }


def configure(settings: CoreSettings | None = None) -> Celery:
    """Configure :data:`app` from ``settings`` (default: the environment) and load the tasks."""
    app.conf.update(celery_config(settings or CoreSettings()))
    _drop_connections()
    app.loader.import_default_modules()
    return app


def _drop_connections() -> None:
    # Connections made under an earlier configuration keep its broker and key prefix; a
    # reconfigured app (`corral dev`, tests, benchmarks) must not send through them.
    # kombu's pool registry keys pools by broker URL and transport options, so the new
    # settings get pools of their own once these cached references are gone.
    app._pool = None
    app.amqp._producer_pool = None
    # The task sender and its event dispatcher are cached too, with the old transport's
    # exchange type: their task-sent events would never reach Flower on the new broker.
    for cached in ("send_task_message", "_event_dispatcher"):
        app.amqp.__dict__.pop(cached, None)


def drop_legacy_bindings(queue_names: list[str]) -> None:
    """Unbind ``queue_names`` (but ``dispatch``) from the ``dispatch`` exchange.

    Before the ``corral`` exchange, every queue was bound to exchange ``dispatch`` with
    routing key ``dispatch``, so one publish there was copied into every queue. Bindings
    outlive the processes that made them (in RabbitMQ, and in Redis's binding sets), so a
    worker takes its own queues' old bindings away when it starts. Never raises: a broker
    without such bindings (or without that exchange) has nothing to take away.
    """
    with app.connection_for_write() as connection:
        for name in queue_names:
            if name == DISPATCH_QUEUE:
                continue  # a plain Celery sender's `dispatch` binding reaches `dispatch` only
            try:
                with connection.channel() as channel:
                    channel.queue_unbind(
                        queue=name, exchange=LEGACY_EXCHANGE, routing_key=LEGACY_EXCHANGE
                    )
            except connection.channel_errors:
                continue  # nothing to remove (RabbitMQ: no such exchange or queue)
            except connection.connection_errors:
                log.warning(
                    "broker not reachable: old dispatch bindings not checked until the next start"
                )
                return


def check_broker(timeout_s: float) -> None:
    """Connect to the configured broker once, retrying for up to ``timeout_s``: a process
    starts only once its broker answers and accepts its credentials.

    Raises:
        kombu.exceptions.OperationalError: the broker did not answer, or refused the
            connection (credentials, vhost), within ``timeout_s``.
    """
    if str(app.conf.broker_url).startswith("memory://"):
        return
    with app.connection_for_write() as connection:
        connection.ensure_connection(
            max_retries=None,
            interval_start=0.2,
            interval_step=0.5,
            interval_max=2.0,
            timeout=timeout_s,
        )
