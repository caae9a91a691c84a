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

Also, corral alone: the cost per routed item with 0, 10⁴ and 10⁶ finished items and 10⁴
items in flight already in the database (``--what scale``), and two scheduler processes
against one, every item on one pool (``--what schedulers``).

Usage: python -m bench.routing [--items N] [--rounds R] [--what anchor|scale|schedulers|all]
[--loops L] [--smoke]
(Redis and PostgreSQL on 127.0.0.1)
"""

from __future__ import annotations

import argparse
import json
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
from bench.harness import add_smoke_flag, say_smoke, until
from corral.shared.store.db import Database, make_engine
from tests.acceptance.stack import Stack, delete_broker_keys

SHAPES = ("drain", "steady")
# PostgreSQL (15+) reports an idle backend's pending statistics after 10 s.
IDLE_STATS_S = 11
# (finished items, items in flight) already in the database, for --what scale.
SCALE_SIZES = ((0, 0), (10_000, 0), (1_000_000, 0), (0, 10_000), (1_000_000, 10_000))
DONE_TIMEOUT_S = 600  # for every item of a run to be done


@dataclass(frozen=True)
class Plan:
    """What one invocation measures: its sizes, its rounds, and how long it lets PostgreSQL
    report its statistics before reading them."""

    items: int
    rounds: int
    scale_sizes: tuple[tuple[int, int], ...] = SCALE_SIZES
    settle_s: float = IDLE_STATS_S

    @classmethod
    def smoke(cls) -> Plan:
        """Tiny sizes, one round, no wait for statistics (read, not trusted)."""
        return cls(items=20, rounds=1, scale_sizes=((10, 10),), settle_s=0)


@dataclass
class Run:
    seconds: float
    items: int
    per_item: dict[str, float]

    @property
    def rate(self) -> float:
        return self.items / self.seconds


def publisher_for(prefix: str) -> Celery:
    app = Celery("bench-publisher", broker=REDIS, set_as_current=False)
    app.conf.broker_transport_options = {"global_keyprefix": prefix}
    return app


def _measure(
    publisher: Celery,
    *,
    task: str,
    queue: str,
    items: int,
    shape: str,
    workers: list[str],
    done: Callable[[], bool],
) -> float:
    send = [("org-0", number) for number in range(items)]
    if shape == "drain":
        publisher.control.cancel_consumer(queue, destination=workers, reply=True)
        for org, number in send:
            publisher.send_task(task, args=[message(org, number)], queue=queue)
        started = time.perf_counter()
        publisher.control.add_consumer(queue, destination=workers, reply=True)
    else:
        started = time.perf_counter()
        for org, number in send:
            publisher.send_task(task, args=[message(org, number)], queue=queue)
    until(done, f"{items} {task} messages consumed from {queue} ({shape})", DONE_TIMEOUT_S)
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


def corral_run(
    items: int,
    shape: str,
    *,
    schedulers: int = 1,
    pools_per_org: int = 5,
    prepare: Callable[[Database], None] | None = None,
    env: dict[str, str] | None = None,
    loops: int | None = None,
    settle_s: float = IDLE_STATS_S,
) -> Run:
    """``items`` routed by ``schedulers`` scheduler processes; ``prepare`` fills the
    database first (history, work in flight)."""
    with fresh_database() as url:
        db = Database(make_engine(url))
        seed(db, orgs=1, pools_per_org=pools_per_org)
        if prepare is not None:
            prepare(db)
        # A backend reports its statistics when it ends (an idle one may wait 10 s): the
        # set-up's before the first reading, the schedulers' before the second.
        db.dispose()
        name = url.rsplit("/", 1)[1]
        names = ["scheduler"] + [f"scheduler-{n}" for n in range(2, schedulers + 1)]
        stack = Stack(
            database_url=url, broker_url=REDIS, extra_env=env or {}, scheduler_loops=loops
        )
        stack.start_only(names)
        time.sleep(settle_s)  # the schedulers' start-up reads reported, not counted
        before = _pg_stats(name)
        publisher = publisher_for(stack.key_prefix)
        client = redis.Redis.from_url(REDIS)
        provisions = f"{stack.key_prefix}provision.local"

        def routed() -> bool:  # each routed item's provision task waits on its queue
            return int(client.llen(provisions)) >= items

        try:
            seconds = _measure(
                publisher,
                task="corral.dispatch",
                queue="dispatch",
                items=items,
                shape=shape,
                workers=[f"{n}@{socket.gethostname()}" for n in names],
                done=routed,
            )
        finally:
            client.close()
            publisher.close()
            stack.stop()
        after = _pg_stats(name)
    return Run(seconds, items, {k: (after[k] - before[k]) / items for k in after})


def anchor_worker(
    prefix: str, done_key: str, queues: str, *, extra_env: dict[str, str] | None = None
) -> tuple[subprocess.Popen[bytes], str]:
    """A plain Celery worker (bench/raw_celery.py: threads, concurrency 4) on ``queues``
    under key prefix ``prefix``, and its node name."""
    host = f"anchor-{uuid.uuid4().hex[:6]}@{socket.gethostname()}"
    env = {
        **os.environ,
        "BENCH_BROKER_URL": REDIS,
        "BENCH_KEY_PREFIX": prefix,
        "BENCH_DONE_KEY": done_key,
        **(extra_env or {}),
    }
    command = [
        "-m",
        "celery",
        "-A",
        "bench.raw_celery",
        "worker",
        "--pool=threads",
        "--concurrency=4",
        "-Q",
        queues,
        f"--hostname={host}",
        "--loglevel=WARNING",
        "--without-gossip",
        "--without-mingle",
    ]
    worker = subprocess.Popen(
        [sys.executable, *command],
        env=env,
        start_new_session=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    return worker, host


def anchor_run(items: int, shape: str) -> Run:
    prefix = f"bench-anchor-{uuid.uuid4().hex[:8]}:"
    done_key = f"{prefix}done"
    worker, host = anchor_worker(prefix, done_key, "anchor")
    client = redis.Redis.from_url(REDIS)
    publisher = publisher_for(prefix)
    try:
        until(
            lambda: bool(publisher.control.ping(destination=[host], timeout=0.5)),
            f"the anchor worker {host} to answer a ping",
            60,
        )
        seconds = _measure(
            publisher,
            task="anchor.noop",
            queue="anchor",
            items=items,
            shape=shape,
            workers=[host],
            done=lambda: int(client.get(done_key) or 0) >= items,
        )
    finally:
        publisher.close()
        os.killpg(worker.pid, signal.SIGTERM)
        worker.wait(timeout=30)
        client.close()
        delete_broker_keys(REDIS, prefix)
    return Run(seconds, items, {})


def fill(finished: int, in_flight: int) -> Callable[[Database], None]:
    """A database preparation: ``finished`` items of history (succeeded, with keys and a
    payload like a real one) and ``in_flight`` items running on the first pool (its slot
    counter says so), written by PostgreSQL itself in one statement each."""

    def prepare(db: Database) -> None:
        payload = json.dumps(message("org-0", 0))
        with db.engine.begin() as connection:
            pool = connection.execute(text("SELECT id FROM pools WHERE name = 'pool-0'")).scalar()
            kinds = (("succeeded", finished, "wi-h-"), ("running", in_flight, "wi-f-"))
            for state, count, prefix in kinds:
                ended = "now()" if state == "succeeded" else "NULL"
                connection.execute(
                    # The interpolated values are this function's own constants.
                    text(
                        "INSERT INTO work_items (id, org_id, project_id, idempotency_key, "  # noqa: S608
                        "profile, payload, state, pool_id, queue, attempts, created_at, "
                        f"updated_at, routed_at, finished_at) SELECT '{prefix}' || g, 'org-0', "
                        f"'bench', '{prefix}' || g, 'default', CAST(:payload AS json), "
                        f"'{state}', :pool, 'provision.local', 1, now(), now(), now(), {ended} "
                        "FROM generate_series(1, :count) AS g"
                    ),
                    {"payload": payload, "pool": pool, "count": count},
                )
            connection.execute(
                text("UPDATE pools SET slots_in_use = :n WHERE id = :pool"),
                {"n": in_flight, "pool": pool},
            )
        with db.engine.connect().execution_options(isolation_level="AUTOCOMMIT") as connection:
            connection.execute(text("VACUUM ANALYZE work_items"))

    return prepare


def scale(plan: Plan) -> None:
    """Cost per routed item against the history and the work in flight (drain shape)."""
    for finished, in_flight in plan.scale_sizes:
        prepare = fill(finished, in_flight)
        runs = [
            corral_run(plan.items, "drain", prepare=prepare, settle_s=plan.settle_s)
            for _ in range(plan.rounds)
        ]
        per_item = {k: statistics.median(r.per_item[k] for r in runs) for k in runs[0].per_item}
        rate = statistics.median(r.rate for r in runs)
        print(
            f"finished={finished:>9,} in_flight={in_flight:>6,}: {rate:5.0f}/s {_format(per_item)}",
            flush=True,
        )


def two_schedulers(plan: Plan, loops: int | None = None) -> None:
    """One pool shared by every item (twice the plan's): two scheduler processes against
    one (drain), each with ``loops`` intake loops (the command's default when None)."""
    rates: dict[int, list[float]] = {1: [], 2: []}
    each = "default" if loops is None else str(loops)
    rounds = plan.rounds
    for _ in range(rounds):
        for count in (1, 2):
            run = corral_run(
                plan.items * 2,
                "drain",
                schedulers=count,
                pools_per_org=1,
                loops=loops,
                settle_s=plan.settle_s,
            )
            rates[count].append(run.rate)
            print(f"{count} scheduler(s), {each} loop(s) each: {run.rate:5.0f}/s", flush=True)
    one, two = (statistics.median(rates[n]) for n in (1, 2))
    print(f"two schedulers / one ({each} loops each): {two / one:.2f} (medians of {rounds})")


def task_events(plan: Plan) -> None:
    """What the intake's task events cost (drain): with them (the default) and without."""
    rates: dict[str, list[float]] = {"on": [], "off": []}
    rounds = plan.rounds
    for _ in range(rounds):
        for setting in ("on", "off"):
            env = {"CORRAL_TASK_EVENTS": "true" if setting == "on" else "false"}
            run = corral_run(plan.items, "drain", env=env, settle_s=plan.settle_s)
            rates[setting].append(run.rate)
            print(f"task events {setting:3}: {run.rate:5.0f}/s", flush=True)
    on, off = (statistics.median(rates[k]) for k in ("on", "off"))
    print(f"with task events / without: {on / off:.2f} (medians of {rounds})")


def anchor_ratio(plan: Plan) -> None:
    """corral's routing rate as a ratio of raw Celery's, interleaved A/B/A/B."""
    results: dict[tuple[str, str], list[Run]] = {}
    rounds = plan.rounds
    sides: tuple[tuple[str, Callable[[int, str], Run]], ...] = (
        ("celery", anchor_run),
        ("corral", lambda items, shape: corral_run(items, shape, settle_s=plan.settle_s)),
    )
    for _ in range(rounds):
        for shape in SHAPES:
            for who, run in sides:
                result = run(plan.items, shape)
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
            f"{ours / anchor:.2f} (medians of {rounds}); per routed item: "
            f"{_format(per_item)}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--items", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument(
        "--what",
        choices=["anchor", "scale", "schedulers", "events", "all"],
        default="all",
        help="the ratio to raw Celery, the cost against history and work in flight, "
        "two schedulers on one pool, the cost of task events, or all",
    )
    parser.add_argument(
        "--loops",
        type=int,
        default=None,
        help="intake loops in each scheduler process for --what schedulers (default: the "
        "command's own)",
    )
    add_smoke_flag(parser)
    args = parser.parse_args()
    plan = Plan.smoke() if args.smoke else Plan(items=args.items, rounds=args.rounds)
    say_smoke(args.smoke)
    if args.what in ("anchor", "all"):
        anchor_ratio(plan)
    if args.what in ("scale", "all"):
        scale(plan)
    if args.what in ("schedulers", "all"):
        two_schedulers(plan, args.loops)
    if args.what in ("events", "all"):
        task_events(plan)


def _format(values: dict[str, Any]) -> str:
    return " ".join(f"{k}={v:.1f}" for k, v in values.items())


if __name__ == "__main__":
    main()
