"""corral's Celery application and its configuration (DESIGN §8).

JSON only; tasks are acknowledged after they ran (``acks_late``, and
``reject_on_worker_lost`` for pools with child processes). On Redis, a message whose worker
died unacknowledged is delivered again after the visibility timeout, which is set to twice
the provision lease. Every task tolerates a second delivery: dispatch by its idempotency
key, provision by its sandbox row and lease, terminate and re-drive by their state checks.
Results are ignored: state lives in the database. Task events are on for Flower. Every task
name starts with ``corral.``.
"""

from __future__ import annotations

from typing import Any

from celery import Celery
from kombu import Queue

from providers.capabilities import CLASS_DEFAULT_CAPABILITIES
from shared.queues import DISPATCH_QUEUE, MAINTENANCE_QUEUE, provider_queues
from shared.settings import CoreSettings

TASK_MODULES = ("scheduler.tasks", "worker.tasks")

app = Celery("corral")


def celery_config(settings: CoreSettings) -> dict[str, Any]:
    queues = [Queue(DISPATCH_QUEUE), Queue(MAINTENANCE_QUEUE)]
    for provider_id in sorted({"local", *CLASS_DEFAULT_CAPABILITIES}):
        queues += [Queue(name) for name in provider_queues(provider_id)]
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
        "task_ignore_result": True,
        "result_backend": None,
        "task_track_started": False,
        "worker_prefetch_multiplier": 1,
        # On Redis, a worker takes a message only when it has a free slot to run it: what
        # waits is on the queue list, so its length is the real backlog autoscaling reads.
        "worker_disable_prefetch": settings.broker_url.startswith(("redis://", "rediss://")),
        "worker_send_task_events": True,
        "task_send_sent_event": True,
        "worker_hijack_root_logger": False,
        "task_queues": queues,
        "task_default_queue": DISPATCH_QUEUE,
        "task_routes": {
            "corral.dispatch": {"queue": DISPATCH_QUEUE},
            "corral.route": {"queue": DISPATCH_QUEUE},
            "corral.terminate": {"queue": MAINTENANCE_QUEUE},
            "corral.redrive": {"queue": MAINTENANCE_QUEUE},
            "corral.reaper.sweep": {"queue": MAINTENANCE_QUEUE},
        },
        "beat_schedule": {
            "redrive": {"task": "corral.redrive", "schedule": settings.redrive_interval_s},
            # A sweep that waited longer than one interval is dropped: the next one is due.
            "reaper": {
                "task": "corral.reaper.sweep",
                "schedule": settings.reaper_interval_s,
                "options": {"expires": settings.reaper_interval_s},
            },
        },
        "imports": TASK_MODULES,
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
