"""A batch's provision tasks on Redis: the tasks in one pipelined write, then their
``task-sent`` events (which Flower reads a task's queue from) as one message after them."""

from __future__ import annotations

import base64
import json
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import redis
from celery import Celery
from celery.utils.saferepr import saferepr

from corral.scheduler.intake import RouteOutcome
from corral.scheduler.publish import enqueue_all
from corral.shared.broker import celery_app
from corral.shared.settings import CoreSettings
from corral.shared.store.models import ItemState
from tests.acceptance.stack import delete_broker_keys
from tests.event_listening import listening

QUEUE = "provision.local"


@pytest.fixture
def prefixed(redis_url: str) -> Iterator[tuple[Celery, str]]:
    prefix = f"corral-publish-{uuid.uuid4().hex[:8]}:"
    yield celery_app.configure(CoreSettings(broker_url=redis_url, broker_key_prefix=prefix)), prefix
    delete_broker_keys(redis_url, prefix)


def test_a_batchs_tasks_go_out_with_their_task_sent_events(
    prefixed: tuple[Celery, str], redis_url: str
) -> None:
    app, prefix = prefixed
    with listening(app) as seen:
        outcomes = [RouteOutcome(f"wi-{n}", ItemState.ROUTED, queue=QUEUE) for n in range(3)]
        outcomes.append(RouteOutcome("wi-waiting", ItemState.WAITING_CAPACITY))
        assert enqueue_all(outcomes) == 3
        deadline = time.monotonic() + 30
        while len([e for e in seen if e["type"] == "task-sent"]) < 3:
            assert time.monotonic() < deadline, f"task-sent events missing: {seen}"
            time.sleep(0.05)
    messages = [
        json.loads(raw) for raw in redis.Redis.from_url(redis_url).lrange(prefix + QUEUE, 0, -1)
    ]
    assert sorted(m["headers"]["argsrepr"] for m in messages) == [
        "['wi-0']",
        "['wi-1']",
        "['wi-2']",
    ]
    assert all(set(m["properties"]) >= {"correlation_id", "delivery_info"} for m in messages)
    assert not [m for m in messages if "event_dispatcher" in json.dumps(m)]
    sent = [e for e in seen if e["type"] == "task-sent"]
    assert sorted(e["uuid"] for e in sent) == sorted(m["headers"]["id"] for m in messages)
    for event in sent:
        assert (event["name"], event["queue"], event["routing_key"]) == (
            "corral.provision",
            QUEUE,
            QUEUE,
        )


def test_a_batchs_messages_are_what_send_task_makes_of_each_alone(
    prefixed: tuple[Celery, str], redis_url: str
) -> None:
    """A batch leaves out steps of Celery's that would give each task the same (its queue
    declared once, its arguments' repr made directly): each message is what a plain
    ``send_task`` of it makes, but for what is its own (its ids, its item)."""
    app, prefix = prefixed
    items = ["wi-0", "wi-1", "wi-2"]
    assert enqueue_all([RouteOutcome(item, ItemState.ROUTED, queue=QUEUE) for item in items]) == 3
    app.send_task("corral.provision", args=["wi-plain"], queue=QUEUE)
    raw = redis.Redis.from_url(redis_url).lrange(prefix + QUEUE, 0, -1)
    messages = [json.loads(one) for one in raw]
    assert len(messages) == 4

    def own(message: dict[str, Any]) -> tuple[str, dict[str, Any]]:
        """The message's item, and the rest of it without what is its own."""
        args, kwargs, embed = json.loads(base64.b64decode(message["body"]))
        headers = dict(message["headers"])
        assert headers.pop("argsrepr") == saferepr(args)
        for name in ("id", "root_id"):
            assert headers.pop(name) is not None
        properties = dict(message["properties"])
        for name in ("correlation_id", "delivery_tag"):
            assert properties.pop(name)
        rest = {**message, "headers": headers, "properties": properties, "body": [kwargs, embed]}
        return args[0], rest

    found = dict(own(message) for message in messages)
    assert sorted(found) == sorted([*items, "wi-plain"])
    plain = found.pop("wi-plain")
    for message in found.values():
        assert message == plain
