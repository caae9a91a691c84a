"""The intake's Celery events, so Flower shows the scheduler and its tasks like any worker's.

The intake is not a Celery worker, but it speaks the same event protocol: ``worker-online``
and a ``worker-heartbeat`` every two seconds, and per message ``task-received`` then
``task-succeeded`` or ``task-failed`` (those wait in a buffer and go out as one message per
batch). A ``corral.dispatch`` task's arguments are the id
summary (:func:`corral.scheduler.tasks.dispatch_summary`), never the message. Events are best
effort: one that cannot be sent is dropped, it never holds up the intake.
"""

from __future__ import annotations

import logging
import os
import platform
import time
from typing import Any

from celery import Celery
from celery.events.dispatcher import EventDispatcher

from corral.shared.broker.envelope import TaskCall

log = logging.getLogger(__name__)
HEARTBEAT_S = 2.0
BUFFER_LIMIT = 10_000  # a batch flushes its events long before
_SOFTWARE = {"sw_ident": "corral-intake", "sw_ver": "1", "sw_sys": platform.system()}


class IntakeEvents:
    """Task and worker events of one intake loop, under its own hostname."""

    def __init__(self, app: Celery, hostname: str, *, task_events: bool = True) -> None:
        """``task_events=False``: worker heartbeats only (Flower lists the scheduler, but
        not each dispatch message as a task)."""
        self._task_events = task_events
        self._connection = app.connection_for_write()
        # Task events wait in a buffer and go out as one message per batch (flush), which
        # Celery's event receivers (Flower's among them) read as a list of events.
        self._dispatcher = EventDispatcher(
            self._connection,
            hostname=hostname,
            app=app,
            buffer_while_offline=False,
            buffer_group={"task"},
            buffer_limit=BUFFER_LIMIT,
        )
        self._processed = 0
        self._next_heartbeat = 0.0
        self._online = False

    def heartbeat(self) -> None:
        now = time.monotonic()
        if now < self._next_heartbeat:
            return
        self._next_heartbeat = now + HEARTBEAT_S
        kind = "worker-heartbeat" if self._online else "worker-online"
        self._online = (
            self._send(
                kind,
                freq=HEARTBEAT_S,
                active=0,
                processed=self._processed,
                loadavg=_load(),
                **_SOFTWARE,
            )
            or self._online
        )

    def received(self, call: TaskCall, summary: str) -> None:
        if not self._task_events:
            return
        self._send(
            "task-received",
            uuid=call.id or "",
            name=call.name,
            args=summary,
            kwargs="{}",
            retries=0,
            eta=None,
            root_id=call.id,
            parent_id=None,
        )

    def succeeded(self, call: TaskCall, result: str, runtime_s: float) -> None:
        self._processed += 1
        if self._task_events:
            self._send("task-succeeded", uuid=call.id or "", result=repr(result), runtime=runtime_s)

    def failed(self, call: TaskCall, error: str) -> None:
        self._processed += 1
        if self._task_events:
            self._send("task-failed", uuid=call.id or "", exception=error, traceback="")

    def flush(self) -> None:
        """Send the buffered task events (once per batch)."""
        try:
            self._dispatcher.flush(errors=False)
        except Exception:
            log.debug("intake events: flush failed", exc_info=True)

    def close(self) -> None:
        self.flush()
        self._send("worker-offline", **_SOFTWARE)
        try:
            self._dispatcher.close()
            self._connection.release()
        except Exception:
            log.debug("intake events: close failed", exc_info=True)

    def _send(self, kind: str, **fields: Any) -> bool:
        try:
            self._dispatcher.send(kind, **fields)
        except Exception:
            log.debug("intake events: %s not sent", kind, exc_info=True)
            return False
        return True


def _load() -> tuple[float, float, float]:
    try:
        one, five, fifteen = os.getloadavg()
    except OSError:
        return (0.0, 0.0, 0.0)
    return (round(one, 2), round(five, 2), round(fifteen, 2))
