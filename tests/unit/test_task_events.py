"""A worker's task events go out from a thread of their own, in order, stamped when they
happened; other events go out at once; stopping sends what is queued."""

from __future__ import annotations

import threading
import time
from typing import Any

from corral.shared.task_events import BackgroundEvents


class Dispatcher:
    """Celery's event dispatcher as the worker uses it: ``send(type, **fields)``."""

    def __init__(self) -> None:
        self.sent: list[tuple[str, dict[str, Any], str]] = []
        self.gate = threading.Event()
        self.gate.set()
        self.fail_next = False

    def send(self, type: str, **fields: Any) -> None:
        self.gate.wait(10)
        if self.fail_next:
            self.fail_next = False
            raise ConnectionError("the broker is away")
        self.sent.append((type, fields, threading.current_thread().name))


def _wait_for(dispatcher: Dispatcher, count: int) -> None:
    deadline = time.monotonic() + 10
    while len(dispatcher.sent) < count:
        assert time.monotonic() < deadline, dispatcher.sent
        time.sleep(0.005)


def test_task_events_are_sent_by_their_thread_in_order_with_the_time_they_happened() -> None:
    dispatcher = Dispatcher()
    events = BackgroundEvents.install(dispatcher)
    dispatcher.gate.clear()  # the broker is slow: the caller must not wait for it
    before = time.time()
    dispatcher.send("task-received", uuid="t1")
    dispatcher.send("task-started", uuid="t1")
    handed_over = time.time()
    time.sleep(0.05)
    assert dispatcher.sent == []  # nothing sent yet, and the caller went on
    dispatcher.gate.set()
    _wait_for(dispatcher, 2)
    assert [(kind, fields["uuid"]) for kind, fields, _ in dispatcher.sent] == [
        ("task-received", "t1"),
        ("task-started", "t1"),
    ]
    assert {thread for _, _, thread in dispatcher.sent} == {"corral-task-events"}
    assert all(before <= fields["timestamp"] <= handed_over for _, fields, _ in dispatcher.sent)
    events.stop()


def test_other_events_go_out_at_once_from_the_caller() -> None:
    dispatcher = Dispatcher()
    events = BackgroundEvents.install(dispatcher)
    dispatcher.send("worker-heartbeat", freq=2.0)
    assert dispatcher.sent == [("worker-heartbeat", {"freq": 2.0}, threading.current_thread().name)]
    events.stop()


def test_an_event_that_cannot_be_sent_does_not_stop_the_rest() -> None:
    dispatcher = Dispatcher()
    events = BackgroundEvents.install(dispatcher)
    dispatcher.fail_next = True
    dispatcher.send("task-failed", uuid="t1")
    dispatcher.send("task-succeeded", uuid="t2")
    _wait_for(dispatcher, 1)
    assert [fields["uuid"] for _, fields, _ in dispatcher.sent] == ["t2"]
    events.stop()


def test_stopping_sends_what_is_queued_and_sends_at_once_after() -> None:
    dispatcher = Dispatcher()
    events = BackgroundEvents.install(dispatcher)
    dispatcher.gate.clear()
    for number in range(3):
        dispatcher.send("task-succeeded", uuid=f"t{number}")
    releaser = threading.Timer(0.05, dispatcher.gate.set)
    releaser.start()
    events.stop()
    assert [fields["uuid"] for _, fields, _ in dispatcher.sent] == ["t0", "t1", "t2"]
    dispatcher.send("task-succeeded", uuid="t3")  # the dispatcher's own send again
    assert dispatcher.sent[-1][2] == threading.current_thread().name
