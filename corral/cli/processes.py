"""Starting corral's long-running processes: api, scheduler, workers, beat.

How they fit together: docs/architecture.md §1.
"""

from __future__ import annotations

import logging
import signal
import threading

from celery.app import trace

from corral.providers.registry import get_provider_class
from corral.shared import logs, runtime
from corral.shared.broker import celery_app
from corral.shared.broker.queues import MAINTENANCE_QUEUE, provider_queues
from corral.shared.errors import ConfigurationError
from corral.shared.settings import CoreSettings
from corral.shared.store import outcomes
from corral.shared.store.db import Database
from corral.shared.store.liveness import ConsumerBeat, consumer_name
from corral.shared.store.migrate import is_current, upgrade

log = logging.getLogger(__name__)


def prepare(settings: CoreSettings | None = None, *, broker: bool = False) -> runtime.Runtime:
    """Install this process's runtime and Celery configuration; check the schema, and with
    ``broker`` (a long-running process) that the broker answers.

    The embedded SQLite database is migrated on the spot; a shared database must be
    migrated once, on purpose, with ``corral db upgrade`` (or by the process itself when
    ``CORRAL_DB_AUTO_UPGRADE`` is true).

    Raises:
        ConfigurationError: the shared database's schema is not the newest.
    """
    resolved = settings or CoreSettings()
    outcomes.configure(org_labels=resolved.metrics_org_labels)
    rt = runtime.install(runtime.Runtime.from_settings(resolved))
    ensure_schema(rt.db, auto_upgrade=resolved.db_auto_upgrade)
    celery_app.configure(resolved)
    if broker:
        celery_app.check_broker(resolved.broker_start_timeout_s)
    return rt


def ensure_schema(db: Database, *, auto_upgrade: bool = False) -> None:
    if auto_upgrade or db.engine.dialect.name == "sqlite":
        upgrade(db.engine)
    elif not is_current(db.engine):
        raise ConfigurationError(
            "the database schema is not current: run `corral db upgrade` once for this "
            "database (or start the processes with CORRAL_DB_AUTO_UPGRADE=true), then start "
            "the processes"
        )


def configure_logging(level: str | None = None) -> None:
    """JSON lines (or text, ``CORRAL_LOG_FORMAT``), redacted, on standard error, from
    ``level`` up (``CORRAL_LOG_LEVEL``, INFO, unless given)."""
    settings = CoreSettings()
    logs.configure(level or settings.log_level, fmt=settings.log_format)
    # Alembic's two lines at every start ("Context impl ...") say nothing an operator needs;
    # a migration it runs is still logged by `corral db upgrade`'s own line.
    logging.getLogger("alembic").setLevel(logging.WARNING)


def run_celery_worker(*, db: Database, queues: list[str], concurrency: int, name: str) -> None:
    """Run a Celery worker in this process with a threads pool (the work waits on I/O),
    its queues first unbound from the exchange they all shared before (no fan-out). While it
    runs, ``queue_consumers`` says it consumes them (the api's metrics count consumers).

    Raises:
        SystemExit: with the worker's own status when it is not 0 (Celery's ``worker_main``
            drops it, so a worker stopped by an unrecoverable error would exit 0 and a
            supervisor that restarts only failures would leave it down).
    """
    celery_app.drop_legacy_bindings(queues)
    stop = threading.Event()
    beat = ConsumerBeat(db, queues, consumer_name(name)).start(stop)
    try:
        run_celery(
            [
                "worker",
                "--pool=threads",
                f"--concurrency={concurrency}",
                f"--queues={','.join(queues)}",
                f"--hostname={name}@%h",
                f"--loglevel={CoreSettings().log_level}",
                "--without-gossip",
                "--without-mingle",
            ]
        )
    finally:
        stop.set()
        beat.join(timeout=10)


def run_scheduler(*, concurrency: int, name: str = "scheduler") -> None:
    """The intake (not a Celery worker: corral.scheduler.consumer) until SIGTERM or SIGINT.

    Raises:
        SystemExit: non-zero when an intake loop ended on its own.
    """
    from corral.scheduler.service import serve

    rt = prepare(broker=True)
    stop = threading.Event()
    for number in (signal.SIGTERM, signal.SIGINT):
        signal.signal(number, lambda *_: stop.set())
    status = serve(rt, concurrency=concurrency, stop=stop, name=name)
    log.info("intake stopped", extra={"status": status})
    if status:
        raise SystemExit(status)


def run_provider_worker(provider_id: str, *, concurrency: int) -> None:
    """Consume ``provision.<provider_id>`` and ``provision.<provider_id>.gpu``.

    Raises:
        UnknownProviderError, ProviderDependencyError: checked before the worker starts.
    """
    get_provider_class(provider_id)
    rt = prepare(broker=True)
    quiet_task_lines()
    health = rt.provider(provider_id).health_check()
    log.info("provider %s: %s", provider_id, health.message)
    run_celery_worker(
        db=rt.db,
        queues=provider_queues(provider_id),
        concurrency=concurrency,
        name=f"worker-{provider_id}",
    )


def quiet_task_lines() -> None:
    """No INFO line per task received, succeeded or retried: at hundreds of provisions a
    second, formatting and redacting them cost a provider worker more CPU than the
    database work of a provision. Failed tasks are still logged (Celery's errors), transient
    provider errors too (corral's warnings), and Flower still shows every task."""
    for name in ("celery.worker.strategy", "celery.app.trace"):
        logging.getLogger(name).setLevel(logging.WARNING)


# The INFO lines Celery writes for every periodic task that the maintenance worker and beat
# handle, by logger: routine, so written at DEBUG (a task's retry, failure or error stays).
ROUTINE_LINES = {
    "celery.worker.strategy": (trace.LOG_RECEIVED,),
    "celery.app.trace": (trace.LOG_SUCCESS,),
    "celery.beat": ("Scheduler: Sending due task %s (%s)",),
}


class RoutineAtDebug(logging.Filter):
    """Writes the routine lines of :data:`ROUTINE_LINES` at DEBUG: dropped unless the
    process logs at DEBUG, and then said to be DEBUG lines."""

    def __init__(self, formats: tuple[str, ...]) -> None:
        super().__init__()
        self.formats = formats

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno != logging.INFO or record.msg not in self.formats:
            return True
        record.levelno, record.levelname = logging.DEBUG, logging.getLevelName(logging.DEBUG)
        return logging.getLogger().isEnabledFor(logging.DEBUG)


def routine_lines_at_debug() -> None:
    """An idle maintenance worker handles a periodic task every second or so, and beat sends
    them: their receipts, successes and sends at DEBUG (some 170 and 90 lines a minute at
    INFO; docs/operations.md#logs)."""
    for name, formats in ROUTINE_LINES.items():
        logger = logging.getLogger(name)
        if not any(isinstance(f, RoutineAtDebug) for f in logger.filters):
            logger.addFilter(RoutineAtDebug(formats))


def run_maintenance_worker(*, concurrency: int) -> None:
    rt = prepare(broker=True)
    routine_lines_at_debug()
    run_celery_worker(
        db=rt.db, queues=[MAINTENANCE_QUEUE], concurrency=concurrency, name="maintenance"
    )


def run_beat() -> None:
    settings = CoreSettings()
    prepare(settings, broker=True)
    routine_lines_at_debug()
    # Beat sends the periodic tasks only, which Flower does not show (corral.worker.tasks).
    celery_app.app.conf.task_send_sent_event = False
    settings.state_dir.mkdir(parents=True, exist_ok=True)
    run_celery(
        [
            "beat",
            f"--loglevel={settings.log_level}",
            f"--schedule={settings.state_dir / 'beat-schedule'}",
        ]
    )


def run_celery(argv: list[str]) -> None:
    """Run a ``celery`` command on corral's app in this process.

    Raises:
        SystemExit: with the command's status when it is not 0. Celery's own ``app.start``
            and ``worker_main`` drop it (click returns it, they discard the return value),
            so a worker stopped by an unrecoverable error would exit 0, and a supervisor
            that restarts only failed processes would leave it down.
    """
    from celery.bin.celery import celery as command

    command.params[0].default = celery_app.app
    try:
        status = command.main(args=argv, standalone_mode=False)
    finally:
        command.params[0].default = None
    if status:
        log.critical("the Celery process stopped with status %s", status)
        raise SystemExit(status if isinstance(status, int) else 1)


def run_api(*, unix: bool, overrides: dict[str, object] | None = None) -> None:
    """Serve the api; ``overrides`` (settings by field name: the command's options) beat the
    environment's.

    Raises:
        ConfigurationError: the bundle store is misconfigured (checked before serving).
    """
    from corral.scheduler.api.server import serve
    from corral.shared.store.bundle_store import make_bundle_store

    settings = CoreSettings().model_copy(update=overrides or {})
    make_bundle_store(settings)  # an s3 store without a bucket or boto3 stops here, said why
    prepare(settings, broker=True)
    serve(settings, unix=unix)
