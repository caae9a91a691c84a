"""The queues' waiting messages as the api's metrics read them from the broker: on Redis,
kombu's lists (each priority's) under the deployment's key prefix; on RabbitMQ, the broker's
count. A queue never written (or never declared) holds none."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest
from celery import Celery

from corral.scheduler.publish import send_provision
from corral.shared.broker import celery_app
from corral.shared.broker.depths import queue_depths
from corral.shared.settings import CoreSettings
from tests.acceptance.rabbitmq import private_vhost
from tests.acceptance.stack import delete_broker_keys


@pytest.fixture
def app(redis_url: str) -> Iterator[Celery]:
    prefix = f"corral-test-{uuid.uuid4().hex[:10]}:"
    yield celery_app.configure(CoreSettings(broker_url=redis_url, broker_key_prefix=prefix))
    delete_broker_keys(redis_url, prefix)
    celery_app.configure(CoreSettings(broker_url="memory://"))


def test_waiting_messages_are_counted_per_queue_under_the_key_prefix(app: Celery) -> None:
    for number in range(3):
        send_provision(f"wi-{number}", "provision.local")
    app.send_task("corral.provision", args=["wi-urgent"], queue="provision.local", priority=9)

    depths = queue_depths(app, ["provision.local", "provision.local.gpu", "dispatch"])

    assert depths == {"provision.local": 4, "provision.local.gpu": 0, "dispatch": 0}


def test_an_unreachable_broker_raises_for_the_collector_to_report() -> None:
    app = celery_app.configure(CoreSettings(broker_url="redis://127.0.0.1:1/0"))
    try:
        with pytest.raises(Exception):  # noqa: B017 - kombu's or the socket's error
            queue_depths(app, ["dispatch"])
    finally:
        celery_app.configure(CoreSettings(broker_url="memory://"))


def test_rabbitmq_counts_the_waiting_messages_and_an_undeclared_queue_holds_none() -> None:
    with private_vhost() as broker_url:
        app = celery_app.configure(CoreSettings(broker_url=broker_url))
        try:
            for number in range(2):
                send_provision(f"wi-{number}", "provision.local")
            depths = queue_depths(app, ["provision.local", "provision.nosuch", "dispatch"])
        finally:
            celery_app.configure(CoreSettings(broker_url="memory://"))
    assert depths == {"provision.local": 2, "provision.nosuch": 0, "dispatch": 0}
