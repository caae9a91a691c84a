"""Benchmarks of the dispatch spine on Redis + PostgreSQL, with real processes.

1. Routing throughput: dispatch messages sent over Celery to a running `corral scheduler`
   (validate, persist, route, enqueue), in items per second, for an org among few and
   among many orgs and pools — routing reads only the dispatching org's pools.
2. Dispatch → provision() latency: from the work item's row being written to the local
   provider being called for it (the sandbox row is written just before the call), p50
   and p99, plus how many provisions one worker process had in flight at once.

Usage: python -m bench.dispatch [--items N]   (needs Redis and PostgreSQL on 127.0.0.1)
"""

from __future__ import annotations

import argparse
import statistics
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from sqlalchemy import create_engine, func, select, text

from corral.scheduler.admin.pools import PoolCreate, ProfileCreate, create_pool, create_profile
from corral.shared.broker import celery_app
from corral.shared.settings import CoreSettings
from corral.shared.store.db import Database, make_engine
from corral.shared.store.migrate import upgrade
from corral.shared.store.models import AuthMode, Sandbox, WorkItem
from tests.acceptance.stack import Stack

POSTGRES = "postgresql+psycopg://postgres@127.0.0.1:5432/test"
REDIS = "redis://127.0.0.1:6379/0"


@contextmanager
def fresh_database() -> Iterator[str]:
    name = f"corral_bench_{uuid.uuid4().hex[:8]}"
    admin = create_engine(POSTGRES, isolation_level="AUTOCOMMIT")
    with admin.connect() as connection:
        connection.execute(text(f'CREATE DATABASE "{name}"'))
    url = POSTGRES.rsplit("/", 1)[0] + f"/{name}"
    engine = make_engine(url)
    upgrade(engine)
    engine.dispose()
    try:
        yield url
    finally:
        with admin.connect() as connection:
            connection.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()


def seed(db: Database, *, orgs: int, pools_per_org: int) -> None:
    create_profile(db, ProfileCreate(name="default", model="m", auth_mode=AuthMode.BYOK))
    for org in range(orgs):
        for number in range(pools_per_org):
            create_pool(
                db,
                PoolCreate(
                    org_id=f"org-{org}",
                    name=f"pool-{number}",
                    provider_id="local",
                    priority=number,
                    max_concurrent=100_000,
                ),
            )


def message(org: str, number: int) -> dict[str, Any]:
    return {
        "org": org,
        "project": "bench",
        "profile": "default",
        "work": {"kind": "shell", "command": f"echo {number}"},
    }


def routing_throughput(items: int, *, orgs: int, pools_per_org: int) -> dict[str, float]:
    """Items/s through a scheduler process; no provider worker runs, so routing is alone."""
    with fresh_database() as url:
        db = Database(make_engine(url))
        seed(db, orgs=orgs, pools_per_org=pools_per_org)
        stack = Stack(database_url=url, broker_url=REDIS)
        stack.start_only(["scheduler"])
        try:
            sender = celery_app.configure(
                CoreSettings(broker_url=REDIS, broker_key_prefix=stack.key_prefix)
            )
            started = time.perf_counter()
            for number in range(items):
                sender.send_task("corral.dispatch", args=[message(f"org-{number % orgs}", number)])
            sent = time.perf_counter() - started
            while _count(db, "routed") < items:
                time.sleep(0.05)
            elapsed = time.perf_counter() - started
        finally:
            stack.stop()
            db.dispose()
    return {
        "items": items,
        "seconds": elapsed,
        "items_per_s": items / elapsed,
        "send_s": sent,
        "pools": orgs * pools_per_org,
    }


def _count(db: Database, state: str) -> int:
    with db.session() as session:
        return session.scalar(select(func.count()).where(WorkItem.state == state)) or 0


def provision_latency(items: int, *, rate_per_s: float | None = None) -> dict[str, float]:
    """Full stack with the local provider; ``items`` over HTTP, at once or at a steady rate."""
    with fresh_database() as url:
        db = Database(make_engine(url))
        seed(db, orgs=1, pools_per_org=1)
        stack = Stack(database_url=url, broker_url=REDIS, worker_concurrency=32)
        stack.start()
        try:
            ids = []
            for number in range(items):
                ids.append(stack.request("POST", "/v1/dispatch", message("org-0", number))[1]["id"])
                if rate_per_s:
                    time.sleep(1 / rate_per_s)
            views = stack.wait_final(ids, timeout_s=600)
        finally:
            stack.stop()
        with db.session() as session:
            rows = session.execute(
                select(WorkItem.created_at, Sandbox.created_at, Sandbox.started_at).join(
                    Sandbox, Sandbox.work_item_id == WorkItem.id
                )
            ).all()
        db.dispose()
    latencies = sorted((sandbox - item).total_seconds() for item, sandbox, _ in rows)
    succeeded = sum(v["state"] == "succeeded" for v in views)
    return {
        "items": items,
        "succeeded": succeeded,
        "p50_ms": 1000 * statistics.median(latencies),
        "p99_ms": 1000 * latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))],
        "max_in_flight": _max_overlap([(start, end) for _, start, end in rows if end]),
    }


def _max_overlap(intervals: list[tuple[Any, Any]]) -> int:
    """Most provide calls running at once: [sandbox row written, handle stored]."""
    edges = sorted([(s, 1) for s, _ in intervals] + [(e, -1) for _, e in intervals])
    best = current = 0
    for _, step in edges:
        current += step
        best = max(best, current)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--items", type=int, default=2000, help="items per routing run")
    parser.add_argument("--provision-items", type=int, default=200, help="items in the burst")
    parser.add_argument("--skip-routing", action="store_true")
    args = parser.parse_args()
    for orgs, pools in () if args.skip_routing else ((1, 5), (1000, 5)):
        result = routing_throughput(args.items, orgs=orgs, pools_per_org=pools)
        print(
            f"routing: {orgs} org(s) x {pools} pools = {result['pools']} pools: "
            f"{result['items']} items in {result['seconds']:.2f} s = "
            f"{result['items_per_s']:.0f} items/s"
        )
    for rate in (5.0, None):
        latency = provision_latency(args.provision_items if rate is None else 60, rate_per_s=rate)
        mode = "a burst" if rate is None else f"{rate:.0f} items/s"
        print(
            f"dispatch -> provision(), {mode}: {latency['items']} items "
            f"({latency['succeeded']} succeeded), p50 {latency['p50_ms']:.0f} ms, "
            f"p99 {latency['p99_ms']:.0f} ms, most provisions in flight in one worker "
            f"process: {latency['max_in_flight']}"
        )


if __name__ == "__main__":
    main()
