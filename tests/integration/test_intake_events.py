"""The intake's Celery events on Redis, as Flower receives them: with task events, each
dispatch message is a task-received and a task-succeeded; without, only the scheduler's
worker heartbeats go out (Flower still lists it)."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator

import pytest
from celery import Celery

from corral.scheduler.events import IntakeEvents
from corral.shared.broker import celery_app
from corral.shared.broker.envelope import TaskCall
from corral.shared.settings import CoreSettings
from tests.acceptance.stack import delete_broker_keys
from tests.event_listening import listening


@pytest.fixture
def app(redis_url: str) -> Iterator[Celery]:
    prefix = f"corral-events-{uuid.uuid4().hex[:8]}:"
    yield celery_app.configure(CoreSettings(broker_url=redis_url, broker_key_prefix=prefix))
    delete_broker_keys(redis_url, prefix)


def _events_of(app: Celery, task_events: bool) -> list[str]:
    """The event types one intake loop sends for one dispatch message and a heartbeat."""
    with listening(app) as seen:
        events = IntakeEvents(app, "scheduler@test", task_events=task_events)
        call = TaskCall(name="corral.dispatch", id="t-1", args=[], kwargs={}, protocol=2)
        events.heartbeat()
        events.received(call, "{'org': 'acme'}")
        events.succeeded(call, "wi-1", 0.0)
        events.close()  # flushes the buffered task events, then says worker-offline
        deadline = time.monotonic() + 30
        while not any(e["type"] == "worker-offline" for e in seen):
            assert time.monotonic() < deadline, "the intake's events never arrived"
            time.sleep(0.05)
    return [event["type"] for event in seen if event.get("hostname") == "scheduler@test"]


def test_task_events_go_out_per_message_with_the_heartbeats(app: Celery) -> None:
    types = _events_of(app, task_events=True)
    assert {"worker-online", "task-received", "task-succeeded"} <= set(types)


def test_without_task_events_only_the_worker_heartbeats_go_out(app: Celery) -> None:
    types = _events_of(app, task_events=False)
    assert "worker-online" in types
    assert not [t for t in types if t.startswith("task-")]
