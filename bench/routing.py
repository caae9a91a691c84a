"""Routing throughput beside its anchor, in the same run: corral's scheduler against plain
Celery on the same Redis (bench/raw_celery.py: a threads worker, a no-op task, JSON,
acks_late), interleaved A/B/A/B so that both see the same machine.

Two shapes, each for both:
- drain: the consumer is paused (remote control ``cancel_consumer``), N messages are sent,
  the consumer is resumed and the clock runs until the last one is done;
- steady: a publisher sends N messages as fast as it can (no task-sent events, for both)
  while the consumer runs; the clock runs from the first send to the last one done.

For corral "done" is the item routed (validated, written with its lifecycle events,
routed, its provision task published: the clock stops when the provision queue holds them
all); for the anchor, the no-op task run. Per corral run
the PostgreSQL work per item is read from ``pg_stat_database`` (tuples fetched and
returned, transactions).

Usage: python -m bench.routing [--items N] [--rounds R]   (Redis and PostgreSQL on 127.0.0.1)
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import redis
from celery import Celery
from sqlalchemy import create_engine, text

from bench.dispatch import POSTGRES, REDIS, fresh_database, message, seed
from shared.db import Database, make_engine
from tests.acceptance.stack import Stack, delete_broker_keys

SHAPES = ("drain", "steady")


@dataclass
class Run:
    seconds: float
    items: int
    per_item: dict[str, float]

    @property
    def rate(self) -> float:
        return self.items / self.seconds


def _publisher(prefix: str) -> Celery:
    app = Celery("bench-publisher", broker=REDIS, set_as_current=False)
    app.conf.broker_transport_options = {"global_keyprefix": prefix}
    return app


def _wait(done: Callable[[], bool], timeout_s: float = 600) -> None:
    deadline = time.monotonic() + timeout_s
    while not done():
        if time.monotonic() > deadline:
            raise TimeoutError("the consumer did not finish")
        time.sleep(0.02)


def _measure(
    publisher: Celery,
    *,
    task: str,
    queue: str,
    items: int,
    shape: str,
    worker: str,
    done: Callable[[], bool],
) -> float:
    send = [("org-0", number) for number in range(items)]
    if shape == "drain":
        publisher.control.cancel_consumer(queue, destination=[worker], reply=True)
        for org, number in send:
            publisher.send_task(task, args=[message(org, number)], queue=queue)
        started = time.perf_counter()
        publisher.control.add_consumer(queue, destination=[worker], reply=True)
    else:
        started = time.perf_counter()
        for org, number in send:
            publisher.send_task(task, args=[message(org, number)], queue=queue)
    _wait(done)
    return time.perf_counter() - started


def _pg_stats(database: str) -> dict[str, int]:
    admin = create_engine(POSTGRES)
    try:
        with admin.connect() as connection:
            row = connection.execute(
                text(
                    "SELECT tup_fetched, tup_returned, xact_commit + xact_rollback "
                    "FROM pg_stat_database WHERE datname = :name"
                ),
                {"name": database},
            ).one()
    finally:
        admin.dispose()
    return {"tuples_fetched": row[0], "tuples_returned": row[1], "transactions": row[2]}


def corral_run(items: int, shape: str) -> Run:
    with fresh_database() as url:
        db = Database(make_engine(url))
        seed(db, orgs=1, pools_per_org=5)
        stack = Stack(database_url=url, broker_url=REDIS).start_only(["scheduler"])
        publisher = _publisher(stack.key_prefix)
        name = url.rsplit("/", 1)[1]

        client = redis.Redis.from_url(REDIS)
        provisions = f"{stack.key_prefix}provision.local"

        def routed() -> bool:  # each routed item's provision task waits on its queue
            return int(client.llen(provisions)) >= items

        try:
            time.sleep(0.5)  # let pg_stat_database catch up with the set-up
            before = _pg_stats(name)
            seconds = _measure(
                publisher,
                task="corral.dispatch",
                queue="dispatch",
                items=items,
                shape=shape,
                worker=f"scheduler@{socket.gethostname()}",
                done=routed,
            )
            time.sleep(0.6)  # statistics are flushed about every 500 ms
            after = _pg_stats(name)
        finally:
            client.close()
            publisher.close()
            stack.stop()
            db.dispose()
    return Run(seconds, items, {k: (after[k] - before[k]) / items for k in after})


def anchor_run(items: int, shape: str) -> Run:
    prefix = f"bench-anchor-{uuid.uuid4().hex[:8]}:"
    done_key = f"{prefix}done"
    host = f"anchor-{uuid.uuid4().hex[:6]}@{socket.gethostname()}"
    env = {
        **os.environ,
        "BENCH_BROKER_URL": REDIS,
        "BENCH_KEY_PREFIX": prefix,
        "BENCH_DONE_KEY": done_key,
    }
    worker = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "celery",
            "-A",
            "bench.raw_celery",
            "worker",
            "--pool=threads",
            "--concurrency=4",
            "-Q",
            "anchor",
            f"--hostname={host}",
            "--loglevel=WARNING",
            "--without-gossip",
            "--without-mingle",
        ],
        env=env,
        start_new_session=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    client = redis.Redis.from_url(REDIS)
    publisher = _publisher(prefix)
    try:
        _wait(lambda: bool(publisher.control.ping(destination=[host], timeout=0.5)), 60)
        seconds = _measure(
            publisher,
            task="anchor.noop",
            queue="anchor",
            items=items,
            shape=shape,
            worker=host,
            done=lambda: int(client.get(done_key) or 0) >= items,
        )
    finally:
        publisher.close()
        os.killpg(worker.pid, signal.SIGTERM)
        worker.wait(timeout=30)
        client.close()
        delete_broker_keys(REDIS, prefix)
    return Run(seconds, items, {})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--items", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    results: dict[tuple[str, str], list[Run]] = {}
    for _ in range(args.rounds):
        for shape in SHAPES:
            for who, run in (("celery", anchor_run), ("corral", corral_run)):
                result = run(args.items, shape)
                results.setdefault((who, shape), []).append(result)
                print(
                    f"{who:7} {shape:7} {result.items} items in {result.seconds:6.2f} s = "
                    f"{result.rate:6.0f}/s {_format(result.per_item)}",
                    flush=True,
                )
    for shape in SHAPES:
        anchor = statistics.median(r.rate for r in results[("celery", shape)])
        ours = statistics.median(r.rate for r in results[("corral", shape)])
        per_item = {
            k: statistics.median(r.per_item[k] for r in results[("corral", shape)])
            for k in results[("corral", shape)][0].per_item
        }
        print(
            f"{shape}: corral {ours:.0f}/s, raw Celery {anchor:.0f}/s, ratio "
            f"{ours / anchor:.2f} (medians of {args.rounds}); per routed item: "
            f"{_format(per_item)}"
        )


def _format(values: dict[str, Any]) -> str:
    return " ".join(f"{k}={v:.1f}" for k, v in values.items())


if __name__ == "__main__":
    main()
