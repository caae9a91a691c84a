"""Celery remote control for the intake, so ``celery inspect`` and Flower see the scheduler.

The intake is not a Celery worker, but it listens on Celery's broadcast mailbox under its
hostname and answers the commands an operator and Flower use: ``ping``, ``stats``,
``active_queues``, ``registered``, ``conf``, ``active``/``reserved``/``scheduled``/
``revoked`` (always empty: a dispatch message is never held back), and
``cancel_consumer``/``add_consumer`` for the ``dispatch`` queue (pausing and resuming
intake, e.g. to drain a deployment). Anything else answers an error naming what is
supported.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from celery import Celery

from corral.shared.broker.queues import DISPATCH_QUEUE

log = logging.getLogger(__name__)
INTAKE_TASKS = ("corral.dispatch", "corral.route")


@dataclass
class IntakeState:
    """What the intake loops share with the control node."""

    loops: int
    batch: int
    consuming: threading.Event = field(default_factory=threading.Event)
    started: float = field(default_factory=time.monotonic)
    totals: Counter[str] = field(default_factory=Counter)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def __post_init__(self) -> None:
        self.consuming.set()

    def count(self, task: str) -> None:
        with self._lock:
            self.totals[task] += 1


def _handlers(app: Celery, state: IntakeState) -> dict[str, Any]:
    queue = app.amqp.queues[DISPATCH_QUEUE]

    def stats(_: Any, **__: Any) -> dict[str, Any]:
        with state._lock:
            totals = dict(state.totals)
        return {
            "pid": os.getpid(),
            "uptime": int(time.monotonic() - state.started),
            "total": totals,
            "prefetch_count": state.batch,
            "pool": {
                "implementation": "corral.intake",
                "max-concurrency": state.loops,
                "processes": [],
                "timeouts": [0, 0],
            },
            "broker": {"transport": app.connection_for_read().transport_cls},
            "clock": "0",
            "rusage": {},
        }

    def consumer_control(resume: bool) -> Any:
        def control(_: Any, queue: str = "", **__: Any) -> dict[str, str]:
            if queue != DISPATCH_QUEUE:
                return {"error": f"the intake consumes {DISPATCH_QUEUE} only"}
            (state.consuming.set if resume else state.consuming.clear)()
            verb = "consuming from" if resume else "no longer consuming from"
            return {"ok": f"{verb} {DISPATCH_QUEUE}"}

        return control

    empty: Any = lambda *_, **__: []  # noqa: E731 - several commands share it
    return {
        "ping": lambda *_, **__: {"ok": "pong"},
        "stats": stats,
        "active_queues": lambda *_, **__: [queue.as_dict(recurse=True)],
        "registered": lambda *_, **__: list(INTAKE_TASKS),
        "conf": lambda *_, **__: {"worker": "corral intake"},
        "active": empty,
        "reserved": empty,
        "scheduled": empty,
        "revoked": empty,
        # Its task events are always on; Flower asks for them anyway.
        "enable_events": lambda *_, **__: {"ok": "task events already enabled"},
        "cancel_consumer": consumer_control(resume=False),
        "add_consumer": consumer_control(resume=True),
    }


class _Handlers(dict[str, Any]):
    def __missing__(self, method: str) -> Any:
        supported = ", ".join(sorted(self))
        return lambda *_, **__: {
            "error": f"the intake does not support {method}; it answers {supported}"
        }


def serve_control(
    app: Celery, hostname: str, state: IntakeState, stop: threading.Event
) -> threading.Thread:
    """Answer remote control commands for ``hostname`` on a daemon thread until ``stop``."""
    thread = threading.Thread(
        target=_listen, args=(app, hostname, state, stop), name="intake-control", daemon=True
    )
    thread.start()
    return thread


def _listen(app: Celery, hostname: str, state: IntakeState, stop: threading.Event) -> None:
    handlers = _Handlers(_handlers(app, state))
    while not stop.is_set():
        try:
            with app.connection_for_read() as connection:
                node = app.control.mailbox.Node(
                    hostname, state=state, handlers=handlers, channel=connection.default_channel
                )
                node.listen()
                while not stop.is_set():
                    try:
                        connection.drain_events(timeout=1)
                    except TimeoutError:
                        continue
        except Exception as exc:
            log.warning(
                "intake control: the broker went away (%s); listening again",
                str(exc).strip() or type(exc).__name__,
            )
            stop.wait(2)
