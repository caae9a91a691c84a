"""Dead letters: broker messages no task can be read from, counted, logged and kept.

A message that cannot be decoded is acknowledged (it would fail the same way on every
delivery) and recorded here instead: a row in ``dead_letters`` with its queue, reason, size
and SHA-256, a log line with the same, and ``corral_dead_letters_total{queue,reason}``. The
body itself is never kept or logged: it may carry a dispatch's env values.
"""

from __future__ import annotations

import hashlib
import logging
import re
from collections.abc import Callable

from prometheus_client import Counter
from sqlalchemy.exc import SQLAlchemyError

from corral.shared.broker.envelope import MalformedMessageError
from corral.shared.store.db import Database
from corral.shared.store.models import DeadLetter

log = logging.getLogger(__name__)

DEAD_LETTERS = Counter(
    "corral_dead_letters",
    "Broker messages that could not be read as a task and were set aside, by queue and reason.",
    ["queue", "reason"],
)

_SAFE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:@-]{0,127}")


def safe_identifier(value: object) -> str | None:
    """``value`` if it is shaped like a task name or id, else None (never a secret's text)."""
    return value if isinstance(value, str) and _SAFE.fullmatch(value) else None


def record_dead_letter(
    db: Database | None,
    *,
    queue: str,
    reason: str,
    detail: str,
    raw: bytes,
    task_name: str | None = None,
    task_id: str | None = None,
) -> None:
    """Count, log and (when the database answers) store one dead letter. Never raises."""
    name, ident = safe_identifier(task_name), safe_identifier(task_id)
    digest = hashlib.sha256(raw).hexdigest()
    DEAD_LETTERS.labels(queue=queue, reason=reason).inc()
    log.warning(
        "dead letter: %s",
        detail,
        extra={
            "queue": queue,
            "reason": reason,
            "size_bytes": len(raw),
            "sha256": digest,
            "task_name": name,
            "task_id": ident,
        },
    )
    if db is None:
        return
    try:
        with db.session() as session:
            session.add(
                DeadLetter(
                    queue=queue[:255],
                    reason=reason[:64],
                    detail=detail[:2000],
                    size_bytes=len(raw),
                    sha256=digest,
                    task_name=name,
                    task_id=ident,
                )
            )
    except SQLAlchemyError:
        log.warning(
            "could not store a dead letter; it is counted and logged only",
            extra={"queue": queue, "sha256": digest},
            exc_info=True,
        )


def dead_letter(
    exc: MalformedMessageError, *, queue: str, raw: bytes, database: Callable[[], Database]
) -> None:
    """:func:`record_dead_letter` for ``exc``, in the database ``database()`` gives. Never
    raises: a database that cannot be had leaves the dead letter counted and logged.

    For the broker-facing code of long-running processes (corral's Redis transport and
    worker consumer), which Celery and kombu build: it hands the process's database.
    """
    try:
        db: Database | None = database()
    except Exception:  # no database to be had: the dead letter is counted and logged
        log.warning("no database for dead letters", extra={"queue": queue}, exc_info=True)
        db = None
    record_dead_letter(
        db,
        queue=queue,
        reason=exc.reason,
        detail=exc.message,
        raw=raw,
        task_name=exc.task_name,
        task_id=exc.task_id,
    )
