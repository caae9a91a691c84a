"""corral's Celery app for Celery's own tools: ``celery -A corral <command>``.

Configured from the environment like every corral process (``CORRAL_BROKER_URL``,
``CORRAL_BROKER_KEY_PREFIX``, …), so the standard commands see the deployment's broker,
key prefix and queues::

    celery -A corral inspect ping
    celery -A corral status
    celery -A corral events
    celery -A corral purge -Q provision.local
    celery -A corral worker -Q provision.local --pool threads --concurrency 32

A worker or beat started this way logs as corral's own processes do (JSON lines or text,
``CORRAL_LOG_FORMAT``, with secrets redacted): the handlers are installed through Celery's
``setup_logging`` signal, which also keeps Celery from installing its own (a line per task
received, succeeded or sent is a DEBUG line, as in corral's processes). A worker checks
the database schema before it consumes, as ``corral worker`` does.
"""

from __future__ import annotations

import logging
from typing import Any

from celery import signals

from corral.cli.processes import ensure_schema, routine_lines_at_debug
from corral.shared import logs, runtime
from corral.shared.broker import celery_app
from corral.shared.settings import CoreSettings

app = celery_app.configure(CoreSettings())


def corral_logging(loglevel: Any = None, **_: Any) -> None:
    """corral's logging for a worker or beat started by ``celery``."""
    level = logging.getLevelName(loglevel) if isinstance(loglevel, int) else loglevel
    logs.configure(str(level or "INFO").upper(), fmt=CoreSettings().log_format)
    routine_lines_at_debug()  # a task received, succeeded or sent: DEBUG lines


def check_schema(**_: Any) -> None:
    """Refuse to consume against a database whose schema is not current."""
    ensure_schema(runtime.current().db)


signals.setup_logging.connect(corral_logging)
signals.worker_init.connect(check_schema)
