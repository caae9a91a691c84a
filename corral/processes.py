"""Starting corral's long-running processes: api, scheduler, workers, beat (DESIGN §1)."""

from __future__ import annotations

import logging

from providers.registry import get_provider_class
from shared import celery_app, logs, runtime
from shared.db import Database
from shared.errors import ConfigurationError
from shared.migrate import is_current, upgrade
from shared.queues import DISPATCH_QUEUE, MAINTENANCE_QUEUE, provider_queues
from shared.settings import CoreSettings

log = logging.getLogger(__name__)


def prepare(settings: CoreSettings | None = None) -> runtime.Runtime:
    """Install this process's runtime and Celery configuration; check the schema.

    The embedded SQLite database is migrated on the spot; a shared database must be
    migrated once, on purpose, with ``corral db upgrade``.

    Raises:
        ConfigurationError: the shared database's schema is not the newest.
    """
    resolved = settings or CoreSettings()
    rt = runtime.install(runtime.Runtime.from_settings(resolved))
    ensure_schema(rt.db)
    celery_app.configure(resolved)
    return rt


def ensure_schema(db: Database) -> None:
    if db.engine.dialect.name == "sqlite":
        upgrade(db.engine)
    elif not is_current(db.engine):
        raise ConfigurationError(
            "the database schema is not current: run `corral db upgrade` once for this "
            "database, then start the processes"
        )


def configure_logging(level: str = "INFO") -> None:
    """JSON lines (or text, ``CORRAL_LOG_FORMAT``), redacted, on standard error."""
    logs.configure(level, fmt=CoreSettings().log_format)


def run_celery_worker(*, queues: list[str], concurrency: int, name: str) -> None:
    """Run a Celery worker in this process with a threads pool (the work waits on I/O)."""
    celery_app.app.worker_main(
        argv=[
            "worker", "--pool=threads", f"--concurrency={concurrency}",
            f"--queues={','.join(queues)}", f"--hostname={name}@%h", "--loglevel=INFO",
            "--without-gossip", "--without-mingle",
        ]
    )  # fmt: skip


def run_scheduler(*, concurrency: int) -> None:
    prepare()
    run_celery_worker(queues=[DISPATCH_QUEUE], concurrency=concurrency, name="scheduler")


def run_provider_worker(provider_id: str, *, concurrency: int) -> None:
    """Consume ``provision.<provider_id>`` and ``provision.<provider_id>.gpu``.

    Raises:
        UnknownProviderError, ProviderDependencyError: checked before the worker starts.
    """
    get_provider_class(provider_id)
    rt = prepare()
    health = rt.provider(provider_id).health_check()
    log.info("provider %s: %s", provider_id, health.message)
    run_celery_worker(
        queues=provider_queues(provider_id), concurrency=concurrency, name=f"worker-{provider_id}"
    )


def run_maintenance_worker(*, concurrency: int) -> None:
    prepare()
    run_celery_worker(queues=[MAINTENANCE_QUEUE], concurrency=concurrency, name="maintenance")


def run_beat() -> None:
    settings = CoreSettings()
    prepare(settings)
    settings.state_dir.mkdir(parents=True, exist_ok=True)
    celery_app.app.start(
        argv=["beat", "--loglevel=INFO", f"--schedule={settings.state_dir / 'beat-schedule'}"]
    )


def run_api(*, unix: bool) -> None:
    from scheduler.server import serve

    settings = CoreSettings()
    prepare(settings)
    serve(settings, unix=unix)
