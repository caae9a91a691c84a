"""Benchmarks of the dispatch spine on Redis + PostgreSQL, with real processes.

1. Routing throughput: dispatch messages sent over Celery to a running `corral scheduler`
   (validate, persist, route, enqueue), in items per second, for an org among few and
   among many orgs and pools — routing reads only the dispatching org's pools.
2. Dispatch → provision() latency: from the work item's row being written to the local
   provider being called for it (the sandbox row is written just before the call), p50
   and p99, plus how many provisions one worker process had in flight at once.

Usage: python -m bench.dispatch [--items N] [--smoke]
(needs Redis and PostgreSQL on 127.0.0.1, and bubblewrap)
"""

from __future__ import annotations

import argparse
import hashlib
import statistics
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any

from sqlalchemy import Engine, create_engine, func, select, text
from sqlalchemy.exc import DBAPIError

from bench.harness import add_smoke_flag, say_smoke, until
from corral.scheduler.admin.pools import PoolCreate, ProfileCreate, create_pool, create_profile
from corral.shared.broker import celery_app
from corral.shared.settings import CoreSettings
from corral.shared.store import migrations
from corral.shared.store.db import Database, make_engine
from corral.shared.store.migrate import upgrade
from corral.shared.store.models import AuthMode, Sandbox, WorkItem
from tests.acceptance.stack import Stack

POSTGRES = "postgresql+psycopg://postgres@127.0.0.1:5432/test"
REDIS = "redis://127.0.0.1:6379/0"


# The schema every fresh database starts from, kept between runs: migrating takes a second
# or more, copying a template a fraction of that.
TEMPLATE_PREFIX = "corral_bench_tpl_"


@contextmanager
def fresh_database() -> Iterator[str]:
    """A database of the run's own at the newest schema (a copy of the template), dropped
    afterwards; its URL."""
    name = f"corral_bench_{uuid.uuid4().hex[:8]}"
    admin = create_engine(POSTGRES, isolation_level="AUTOCOMMIT")
    try:
        template = _template(admin)
        with admin.connect() as connection:
            connection.execute(text(f'CREATE DATABASE "{name}" TEMPLATE "{template}"'))
        yield POSTGRES.rsplit("/", 1)[0] + f"/{name}"
    finally:
        with admin.connect() as connection:
            connection.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()


def _template(admin: Engine) -> str:
    """The template database of these migrations (named by their digest), made by the first
    run that needs it, under a lock; the templates of other migrations are dropped then."""
    digest = hashlib.sha256()
    for path in sorted(Path(migrations.__file__).parent.rglob("*.py")):
        digest.update(path.read_bytes())
    name = TEMPLATE_PREFIX + digest.hexdigest()[:12]
    with admin.connect() as connection:
        lock = {"key": TEMPLATE_PREFIX}
        connection.execute(text("SELECT pg_advisory_lock(hashtext(:key))"), lock)
        try:
            found = set(
                connection.execute(
                    text("SELECT datname FROM pg_database WHERE starts_with(datname, :prefix)"),
                    {"prefix": TEMPLATE_PREFIX},
                ).scalars()
            )
            if name not in found:
                _make_template(admin, name)
                for other in found:  # an earlier schema's; in use by a run, it stays
                    with suppress(DBAPIError):
                        connection.execute(text(f'DROP DATABASE IF EXISTS "{other}"'))
        finally:
            connection.execute(text("SELECT pg_advisory_unlock(hashtext(:key))"), lock)
    return name


def _make_template(admin: Engine, name: str) -> None:
    """Migrate a new database, then give it ``name``: a template is never seen half made."""
    building = f"corral_bench_building_{uuid.uuid4().hex[:8]}"
    with admin.connect() as connection:
        connection.execute(text(f'CREATE DATABASE "{building}"'))
    try:
        engine = make_engine(POSTGRES.rsplit("/", 1)[0] + f"/{building}")
        upgrade(engine)
        engine.dispose()
        with admin.connect() as connection:
            connection.execute(text(f'ALTER DATABASE "{building}" RENAME TO "{name}"'))
    finally:
        with admin.connect() as connection:
            connection.execute(text(f'DROP DATABASE IF EXISTS "{building}" WITH (FORCE)'))


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
            until(
                lambda: _count(db, "routed") >= items,
                f"{items} items routed",
                600,
                poll_s=0.05,
                check=stack.check_alive,
            )
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
    add_smoke_flag(parser)
    args = parser.parse_args()
    # (orgs, pools each) for the routing runs; items at a steady 5/s for the latency.
    shapes, steady = ((1, 5), (1000, 5)), 60
    if args.smoke:
        args.items, args.provision_items, shapes, steady = 20, 3, ((1, 2), (3, 2)), 3
    say_smoke(args.smoke)
    for orgs, pools in () if args.skip_routing else shapes:
        result = routing_throughput(args.items, orgs=orgs, pools_per_org=pools)
        print(
            f"routing: {orgs} org(s) x {pools} pools = {result['pools']} pools: "
            f"{result['items']} items in {result['seconds']:.2f} s = "
            f"{result['items_per_s']:.0f} items/s"
        )
    for rate in (5.0, None):
        items = args.provision_items if rate is None else steady
        latency = provision_latency(items, rate_per_s=rate)
        mode = "a burst" if rate is None else f"{rate:.0f} items/s"
        print(
            f"dispatch -> provision(), {mode}: {latency['items']} items "
            f"({latency['succeeded']} succeeded), p50 {latency['p50_ms']:.0f} ms, "
            f"p99 {latency['p99_ms']:.0f} ms, most provisions in flight in one worker "
            f"process: {latency['max_in_flight']}"
        )


if __name__ == "__main__":
    main()
