"""Dispatch → ``provision()`` latency beside two raw Celery hops, in the same run.

corral: a paced publisher sends ``corral.dispatch`` messages (plain Celery, no task-sent
events) at ``--rate`` per second to one ``corral scheduler``; a provider worker
(``bench/slow_provider.py`` with a provider whose ``provision()`` returns at once, and writes
down when it was called) takes the provision tasks. The latency of an item is from its
message being sent to its ``provision()`` being called: intake, validation, the write of the
item and its events, routing, the provision task's publish, its consume, the worker's claim
of the sandbox row and the token.

The anchor: the same publisher at the same rate sends a no-op task to a plain Celery worker
(threads, JSON, acks_late, the same Redis) that sends a second task, whose run notes the
time: two publish→consume hops, what corral's path has at the least (dispatch → scheduler,
scheduler → provider worker). Clocks are this machine's wall clock, in every process.

A second anchor, the durable hops: the same two hops, where the first commits one row to
PostgreSQL (an INSERT on its own) before it sends the second, and the second commits a claim
of it (an UPDATE) before it notes the time. corral's path has those two commits too (the
item and its events before the provision task exists, the sandbox row and token before
``provision()``): what is left above this anchor is corral's own work.

Both sides first send ``--warmup`` messages, at the same rate and left out of the figures:
a process's first messages pay for its cold start (connections opened, statements compiled
and prepared), which is not the latency of a running system.

Usage: python -m bench.latency [--rate 100] [--items 2000] [--rounds 2] [--warmup 20] [--smoke]
(Redis and PostgreSQL on 127.0.0.1)
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import psycopg
import redis
from celery import Celery
from sqlalchemy import make_url, select

from bench.dispatch import REDIS, fresh_database
from bench.harness import add_smoke_flag, say_smoke, until
from bench.provisions import seed
from bench.routing import anchor_worker, publisher_for
from corral.shared.store.db import Database, make_engine
from corral.shared.store.models import Sandbox, WorkItem
from tests.acceptance.stack import Stack, delete_broker_keys

REPO = Path(__file__).resolve().parents[1]
DONE_TIMEOUT_S = 300  # for every message of a run to arrive


def _message(number: int) -> dict[str, object]:
    return {
        "org": "bench",
        "project": "bench",
        "profile": "default",
        "idempotency_key": f"lat-{number}",
        "work": {"kind": "shell", "command": f"echo {number}"},
    }


def _paced(publisher: Celery, task: str, queue: str, items: int, rate: float) -> list[float]:
    """Send ``items`` messages at ``rate`` per second; the wall-clock time each was sent."""
    sent = []
    start = time.monotonic()
    for number in range(items):
        delay = start + number / rate - time.monotonic()
        if delay > 0:
            time.sleep(delay)
        sent.append(time.time())
        publisher.send_task(task, args=[_message(number)], queue=queue)
    return sent


def _provider_worker(env: dict[str, str], state: Path, log: Any) -> subprocess.Popen[bytes]:
    """``corral worker --provider slow`` (bench/slow_provider.py), threads, concurrency 64."""
    command = ["-m", "bench.slow_provider", "worker", "--provider", "slow"]
    return subprocess.Popen(
        [sys.executable, *command, "--concurrency", "64"],
        env=env,
        cwd=state,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )


def _print_parts(
    rows: Any, sent_at: dict[str, float], claimed: dict[str, Any], called: dict[str, float]
) -> None:
    """Where the time went: to the item's write, to the sandbox row, to the call."""
    written = [routed.timestamp() - sent_at[item] for item, _, routed in rows if routed]
    to_claim = [
        claimed[item].timestamp() - routed.timestamp()
        for item, _, routed in rows
        if routed and item in claimed
    ]
    to_call = [
        called[item] - claimed[item].timestamp()
        for item in called
        if item in claimed and item in sent_at
    ]
    for part, values in (
        ("send → item written", written),
        ("written → sandbox row", to_claim),
        ("sandbox row → provision()", to_call),
    ):
        p50, p99 = _percentiles(values)
        print(f"  corral {part:22}: p50 {p50:6.1f} ms  p99 {p99:6.1f} ms", flush=True)


def corral_run(items: int, rate: float, warmup: int = 0) -> list[float]:
    """Seconds from send to ``provision()`` for each item; prints where the time went (to
    the item's write, the scheduler's clock: ``routed_at``; from there to ``provision()``)."""
    state = Path(tempfile.mkdtemp(prefix="corral-bench-"))
    calls = state / "calls.txt"
    with fresh_database() as url:
        db = Database(make_engine(url))
        seed(db)
        stack = Stack(database_url=url, broker_url=REDIS).start_only(["scheduler"])
        env = {
            **stack.env,
            "PYTHONPATH": str(REPO),
            "CORRAL_PROVIDER_CONFIG": json.dumps(
                {"slow": {"delay_s": 0, "calls_path": str(calls)}}
            ),
        }
        log = (state / "worker.log").open("wb")
        worker = _provider_worker(env, state, log)
        publisher = publisher_for(stack.key_prefix)
        try:
            until(
                lambda: b"ready." in (state / "worker.log").read_bytes(),
                "the provider worker to be ready",
                60,
                check=stack.check_alive,
            )
            sent = _paced(publisher, "corral.dispatch", "dispatch", warmup + items, rate)
            until(
                lambda: calls.exists() and len(calls.read_text().splitlines()) >= warmup + items,
                f"provision() called for each of {warmup + items} items",
                DONE_TIMEOUT_S,
                poll_s=0.05,
                check=stack.check_alive,
            )
            with db.session() as session:
                rows = session.execute(
                    select(WorkItem.id, WorkItem.idempotency_key, WorkItem.routed_at)
                ).all()
                claimed = dict(
                    session.execute(select(Sandbox.work_item_id, Sandbox.created_at)).all()
                )
        finally:
            publisher.close()
            os.killpg(worker.pid, signal.SIGTERM)
            worker.wait(timeout=60)
            log.close()
            stack.stop()
            db.dispose()
    called: dict[str, float] = {}
    for line in calls.read_text().splitlines():
        item_id, at = line.split()
        called.setdefault(item_id, float(at))  # a second call (a retry) does not count
    number = {item: int(str(key).removeprefix("lat-")) for item, key, _ in rows}
    rows = [row for row in rows if number[row[0]] >= warmup]
    sent_at = {item: sent[number[item]] for item, _, _ in rows}
    _print_parts(rows, sent_at, claimed, called)
    return [called[item] - sent_at[item] for item in called if item in sent_at]


def anchor_run(items: int, rate: float, warmup: int = 0) -> list[float]:
    """Seconds from send to the second hop's run, for each message."""
    return _hops(items, rate, warmup, first="anchor.hop1", second="anchor.hop2")


def durable_anchor_run(items: int, rate: float, warmup: int = 0) -> list[float]:
    """:func:`anchor_run` with a commit in each hop (bench/raw_celery.py: the first inserts
    the message's row, the second claims it), in a database of its own."""
    with fresh_database() as url:
        plain = make_url(url).set(drivername="postgresql").render_as_string(hide_password=False)
        with psycopg.connect(plain, autocommit=True) as connection:
            connection.execute(
                "CREATE TABLE bench_items (id bigint PRIMARY KEY, state text NOT NULL, "
                "created_at timestamptz NOT NULL)"
            )
        return _hops(
            items,
            rate,
            warmup,
            first="anchor.durable_hop1",
            second="anchor.durable_hop2",
            env={"BENCH_DATABASE_URL": plain},
        )


def _hops(
    items: int,
    rate: float,
    warmup: int,
    *,
    first: str,
    second: str,
    env: dict[str, str] | None = None,
) -> list[float]:
    prefix = f"bench-hops-{uuid.uuid4().hex[:8]}:"
    done_key = f"{prefix}latencies"
    worker, host = anchor_worker(prefix, done_key, f"anchor,{second}", extra_env=env)
    client = redis.Redis.from_url(REDIS)
    publisher = publisher_for(prefix)
    try:
        until(
            lambda: bool(publisher.control.ping(destination=[host], timeout=0.5)),
            f"the anchor worker {host} to answer a ping",
            60,
        )
        sent = _paced(publisher, first, "anchor", warmup + items, rate)
        until(
            lambda: client.llen(done_key) >= warmup + items,
            f"{second} to run for each of {warmup + items} messages",
            DONE_TIMEOUT_S,
            poll_s=0.05,
        )
        arrived = [json.loads(raw) for raw in client.lrange(done_key, 0, -1)]
    finally:
        publisher.close()
        os.killpg(worker.pid, signal.SIGTERM)
        worker.wait(timeout=30)
        client.close()
        delete_broker_keys(REDIS, prefix)
    return [at - sent[number] for number, at in arrived if number >= warmup]


def _percentiles(seconds: list[float]) -> tuple[float, float]:
    cuts = statistics.quantiles(seconds, n=100)
    return cuts[49] * 1000, cuts[98] * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rate", type=float, default=100.0, help="messages per second")
    parser.add_argument("--items", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--warmup", type=int, default=20, help="messages sent first, not counted")
    add_smoke_flag(parser)
    args = parser.parse_args()
    if args.smoke:
        args.rate, args.items, args.rounds, args.warmup = 50.0, 10, 1, 2
    say_smoke(args.smoke)
    sides = (
        ("two Celery hops", anchor_run),
        ("two durable hops", durable_anchor_run),
        ("corral", corral_run),
    )
    results: dict[str, list[tuple[float, float]]] = {who: [] for who, _ in sides}
    for _ in range(args.rounds):
        for who, run in sides:
            p50, p99 = _percentiles(run(args.items, args.rate, args.warmup))
            results[who].append((p50, p99))
            print(
                f"{who:16} at {args.rate:.0f}/s: p50 {p50:6.1f} ms  p99 {p99:6.1f} ms", flush=True
            )
    anchor, durable = (
        statistics.median(p50 for p50, _ in results[who])
        for who in ("two Celery hops", "two durable hops")
    )
    ours, ours99 = (statistics.median(r[k] for r in results["corral"]) for k in (0, 1))
    print(
        f"corral p50 {ours:.1f} ms = two Celery hops ({anchor:.1f} ms) + {ours - anchor:.1f} ms "
        f"= two durable hops ({durable:.1f} ms) + {ours - durable:.1f} ms; "
        f"p99 {ours99:.1f} ms (medians of {args.rounds})"
    )


if __name__ == "__main__":
    main()
