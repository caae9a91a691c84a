"""The anchor for the routing benchmark: plain Celery on the same Redis, a no-op task.

Run as a worker: ``celery -A bench.raw_celery worker --pool threads -c 4 -Q anchor``, with
``BENCH_BROKER_URL``, ``BENCH_KEY_PREFIX`` and ``BENCH_DONE_KEY`` in the environment. JSON,
``acks_late``, results ignored, like corral's own settings; each task adds one to a Redis
counter so the benchmark can tell when all are done (the same kind of write corral's
intake makes per batch, and far less).
"""

from __future__ import annotations

import os
from typing import Any

import redis
from celery import Celery

BROKER = os.environ.get("BENCH_BROKER_URL", "redis://127.0.0.1:6379/0")
PREFIX = os.environ.get("BENCH_KEY_PREFIX", "")
DONE_KEY = os.environ.get("BENCH_DONE_KEY", "bench:done")

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
