"""The anchors for the routing and latency benchmarks: plain Celery on the same Redis.

Run as a worker: ``celery -A bench.raw_celery worker --pool threads -c 4 -Q anchor``, with
``BENCH_BROKER_URL``, ``BENCH_KEY_PREFIX`` and ``BENCH_DONE_KEY`` in the environment. JSON,
``acks_late``, results ignored, like corral's own settings; each task adds one to a Redis
counter so the benchmark can tell when all are done (the same kind of write corral's
intake makes per batch, and far less).
"""

from __future__ import annotations

import json
import os
import threading
import time
from typing import Any

import psycopg
import redis
from celery import Celery

BROKER = os.environ.get("BENCH_BROKER_URL", "redis://127.0.0.1:6379/0")
PREFIX = os.environ.get("BENCH_KEY_PREFIX", "")
DONE_KEY = os.environ.get("BENCH_DONE_KEY", "bench:done")
DATABASE = os.environ.get("BENCH_DATABASE_URL", "")  # libpq form, for the durable hops

app = Celery("anchor", broker=BROKER)
app.conf.update(
    broker_transport_options={"global_keyprefix": PREFIX} if PREFIX else {},
    task_serializer="json",
    accept_content=["json"],
    task_acks_late=True,
    task_ignore_result=True,
    worker_prefetch_multiplier=1,
    worker_hijack_root_logger=False,
)
_counter = redis.Redis.from_url(BROKER)


@app.task(name="anchor.noop")
def noop(*_: Any, **__: Any) -> None:
    _counter.incr(DONE_KEY)


# The latency anchor (bench/latency.py): two publish→consume hops, the second noting when it
# ran, against the number the first message carries.
@app.task(name="anchor.hop1")
def hop1(message: dict[str, Any]) -> None:
    number = int(str(message["idempotency_key"]).removeprefix("lat-"))
    hop2.apply_async(args=[number], queue="anchor.hop2")


@app.task(name="anchor.hop2")
def hop2(number: int) -> None:
    _counter.rpush(DONE_KEY, json.dumps([number, time.time()]))


# The durable latency anchor: the same two hops, where the first writes its row (one INSERT,
# committed on its own) before it sends the second, and the second claims it (one UPDATE,
# committed) before it notes the time. The least a dispatcher pays that keeps an item before
# publishing it and claims it before acting on it: two commits on the path.
_connections = threading.local()


def _database() -> psycopg.Connection[Any]:
    connection = getattr(_connections, "connection", None)
    if connection is None:
        connection = psycopg.connect(DATABASE, autocommit=True)
        _connections.connection = connection
    return connection


@app.task(name="anchor.durable_hop1")
def durable_hop1(message: dict[str, Any]) -> None:
    number = int(str(message["idempotency_key"]).removeprefix("lat-"))
    _database().execute(
        "INSERT INTO bench_items (id, state, created_at) VALUES (%s, 'routed', now())", (number,)
    )
    durable_hop2.apply_async(args=[number], queue="anchor.durable_hop2")


@app.task(name="anchor.durable_hop2")
def durable_hop2(number: int) -> None:
    claimed = _database().execute(
        "UPDATE bench_items SET state = 'claimed' WHERE id = %s AND state = 'routed' RETURNING id",
        (number,),
    )
    if claimed.fetchone() is not None:
        _counter.rpush(DONE_KEY, json.dumps([number, time.time()]))
