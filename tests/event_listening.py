"""Hearing a Celery app's events as Flower does: a receiver on its own thread, subscribed
before the test sends anything (Redis PUBLISH keeps nothing for late subscribers)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from celery import Celery


@contextmanager
def listening(app: Celery) -> Iterator[list[dict[str, Any]]]:
    """The events ``app``'s receiver hears, appended as they come; subscribed (it has heard
    a probe) when the block starts, stopped when it ends."""
    seen: list[dict[str, Any]] = []
    with app.connection_for_read() as connection:
        receiver = app.events.Receiver(connection, handlers={"*": seen.append})
        listener = threading.Thread(target=receiver.capture, kwargs={"limit": None}, daemon=True)
        listener.start()
        with app.events.default_dispatcher(hostname="probe@test") as probe:
            deadline = time.monotonic() + 30
            while not any(e["type"] == "probe-hello" for e in seen):
                assert time.monotonic() < deadline, "the event receiver never subscribed"
                probe.send("probe-hello")
                time.sleep(0.05)
        try:
            yield seen
        finally:
            receiver.should_stop = True
            listener.join(timeout=10)
