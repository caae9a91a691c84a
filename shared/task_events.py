"""A worker's task events, sent by a thread of their own.

Celery's worker sends ``task-received`` from its consumer before it hands a task to the pool,
and ``task-started`` from the pool's thread before the task runs: each a publish to the
broker (a round trip, and the work of building and encoding the event) in front of every
task, on a threads pool (corral's provider workers) one after the other. Flower needs them;
the task does not need to wait for them. :class:`BackgroundEvents` takes the place of the
event dispatcher's ``send`` for task events: the caller stamps the event and queues it, and
one thread sends them, in the order they came, through the dispatcher's own ``send`` (so
its buffering while the broker is away, its groups and its clock are Celery's). Other
events (the worker's heartbeats) are sent as before.

Each event keeps the time it happened (``timestamp``), not the time it was sent. What is
still queued when the worker stops is sent first, for up to :data:`DRAIN_S`.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from typing import Any

log = logging.getLogger(__name__)

DRAIN_S = 5.0
_STOP = object()


class BackgroundEvents:
    """Sends ``dispatcher``'s task events from a thread; installed with :meth:`install`."""

    def __init__(self, dispatcher: Any) -> None:
        self.dispatcher = dispatcher
        self._send = dispatcher.send  # the dispatcher's own
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="corral-task-events", daemon=True)

    @classmethod
    def install(cls, dispatcher: Any) -> BackgroundEvents:
        """Start sending ``dispatcher``'s task events in the background."""
        events = cls(dispatcher)
        events._thread.start()
        dispatcher.send = events.send
        return events

    def send(self, type: str, **fields: Any) -> Any:
        if not type.startswith("task-"):
            return self._send(type, **fields)
        fields.setdefault("timestamp", time.time())
        self._queue.put((type, fields))
        return None

    def stop(self, timeout_s: float = DRAIN_S) -> None:
        """Send what is queued (for up to ``timeout_s``), then stop; task events sent after
        this go out at once again."""
        if self.dispatcher.send == self.send:
            self.dispatcher.send = self._send
        self._queue.put(_STOP)
        self._thread.join(timeout_s)

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is _STOP:
                return
            type, fields = item
            try:
                self._send(type, **fields)
            except Exception:  # as Celery's own: an event never fails the work it reports
                log.warning("a task event could not be sent", exc_info=True)
