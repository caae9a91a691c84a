"""corral's Celery app on real Redis: key prefixes, and the exchange layout (each publish
lands in one queue list)."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator

import pytest
import redis
from celery import Celery
from kombu import Exchange, Queue

from corral.scheduler.publish import send_provision
from corral.shared.broker.celery_app import (
    CorralConnection,
    celery_config,
    configure,
    drop_legacy_bindings,
)
from corral.shared.settings import CoreSettings
from tests.acceptance.stack import delete_broker_keys

NAMES = [queue.name for queue in celery_config(CoreSettings())["task_queues"]]


def test_reconfiguring_sends_through_the_new_broker_settings(redis_url: str) -> None:
    client = redis.Redis.from_url(redis_url)
    first, second = (f"corral-t-{uuid.uuid4().hex[:8]}:" for _ in range(2))
    try:
        configure(CoreSettings(broker_url=redis_url, broker_key_prefix=first)).send_task(
            "corral.redrive"
        )
        configure(CoreSettings(broker_url=redis_url, broker_key_prefix=second)).send_task(
            "corral.redrive"
        )
        assert client.llen(f"{first}maintenance") == 1
        assert client.llen(f"{second}maintenance") == 1
    finally:
        for prefix in (first, second):
            for key in client.scan_iter(f"{prefix}*"):
                client.delete(key)
        client.close()
        configure(CoreSettings(broker_url="memory://"))


@pytest.fixture
def prefix(redis_url: str) -> Iterator[str]:
    """A key prefix of this test's own, with corral's app sending under it."""
    key_prefix = f"corral-t-{uuid.uuid4().hex[:8]}:"
    configure(CoreSettings(broker_url=redis_url, broker_key_prefix=key_prefix))
    yield key_prefix
    configure(CoreSettings(broker_url="memory://"))
    delete_broker_keys(redis_url, key_prefix)


@pytest.fixture
def client(redis_url: str) -> Iterator[redis.Redis]:
    connection = redis.Redis.from_url(redis_url)
    yield connection
    connection.close()


def lengths(client: redis.Redis, prefix: str) -> dict[str, int]:
    """The corral queue lists that hold anything, and how much."""
    sizes = {name: client.llen(f"{prefix}{name}") for name in NAMES}
    return {name: size for name, size in sizes.items() if size}


def declare(redis_url: str, prefix: str, queues: list[Queue]) -> None:
    with CorralConnection(redis_url, transport_options={"global_keyprefix": prefix}) as conn:
        for queue in queues:
            queue(conn.default_channel).declare()


def publish(redis_url: str, prefix: str, exchange: str, routing_key: str) -> None:
    with CorralConnection(redis_url, transport_options={"global_keyprefix": prefix}) as conn:
        conn.Producer().publish(
            {"not": "a task"}, exchange=Exchange(exchange, "direct"), routing_key=routing_key
        )


def corral_queues() -> list[Queue]:
    return list(celery_config(CoreSettings())["task_queues"])


def test_each_task_is_sent_through_the_corral_exchange_to_its_own_list(
    redis_url: str, prefix: str, client: redis.Redis
) -> None:
    app = configure(CoreSettings(broker_url=redis_url, broker_key_prefix=prefix))
    sends = [
        (lambda: app.send_task("corral.redrive"), "maintenance"),
        (lambda: app.send_task("corral.terminate", args=["sb-1", "finished"]), "maintenance"),
        (lambda: app.send_task("corral.route", args=["wi-1"]), "dispatch"),
        (lambda: send_provision("wi-1", "provision.local"), "provision.local"),
        (lambda: send_provision("wi-2", "provision.docker.gpu"), "provision.docker.gpu"),
    ]
    for send, queue in sends:
        send()
        assert lengths(client, prefix) == {queue: 1}
        entry = json.loads(client.rpop(f"{prefix}{queue}") or b"")
        delivery = entry["properties"]["delivery_info"]
        assert (delivery["exchange"], delivery["routing_key"]) == ("", queue)


def test_a_plain_celery_sender_lands_in_the_dispatch_list_only(
    redis_url: str, prefix: str, client: redis.Redis
) -> None:
    declare(redis_url, prefix, corral_queues())  # as corral's running workers have
    upstream = Celery("upstream", broker=redis_url)
    upstream.conf.broker_transport_options = {"global_keyprefix": prefix}
    try:
        upstream.send_task("corral.dispatch", args=[{"org": "acme"}], queue="dispatch")
    finally:
        upstream.close()
    assert lengths(client, prefix) == {"dispatch": 1}


def test_one_publish_to_either_exchange_reaches_one_queue(
    redis_url: str, prefix: str, client: redis.Redis
) -> None:
    declare(redis_url, prefix, corral_queues())
    # what a plain Celery sender of `corral.dispatch` declares on its side
    declare(redis_url, prefix, [Queue("dispatch", Exchange("dispatch"), "dispatch")])
    for exchange, routing_key in [("dispatch", "dispatch"), ("corral", "dispatch")]:
        publish(redis_url, prefix, exchange, routing_key)
        assert lengths(client, prefix) == {"dispatch": 1}
        client.delete(f"{prefix}dispatch")
    publish(redis_url, prefix, "corral", "maintenance")
    assert lengths(client, prefix) == {"maintenance": 1}


def test_workers_take_away_the_old_bindings_that_copied_one_publish_into_every_queue(
    redis_url: str, prefix: str, client: redis.Redis
) -> None:
    legacy = Exchange("dispatch", "direct")
    declare(redis_url, prefix, [Queue(name, legacy, "dispatch") for name in NAMES])  # as before
    publish(redis_url, prefix, "dispatch", "dispatch")
    assert lengths(client, prefix) == dict.fromkeys(NAMES, 1)  # the fan-out, as it was
    for name in NAMES:
        client.delete(f"{prefix}{name}")

    drop_legacy_bindings(NAMES)  # every worker, for the queues it consumes
    publish(redis_url, prefix, "dispatch", "dispatch")
    assert lengths(client, prefix) == {"dispatch": 1}
