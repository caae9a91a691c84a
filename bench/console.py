"""Benchmark of the web console's pages on PostgreSQL with 100,000 work items.

A scratch database is filled straight through multi-row INSERTs: N work items over the last
week (a twentieth of them in the last hour; every state, failures with error codes), one
sandbox each (those of unfinished items live), three lifecycle events each, a cost event
for each ended sandbox, and twenty log lines for every tenth item; 20 orgs with 2 local
pools each. Every page is then requested R times through the api's ASGI app (its
middleware included, a logged-in session cookie) and its p50/p95 reported; the run fails
when a page answers anything but 200 or its p95 passes the budget.

Usage: python -m bench.console [--items 100000] [--requests 20] [--budget-ms 300] [--smoke]
(needs PostgreSQL on 127.0.0.1; a smoke run holds no page to the budget)
"""

from __future__ import annotations

import argparse
import random
import re
import statistics
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

from fastapi.testclient import TestClient
from pydantic import SecretStr
from sqlalchemy import insert

from bench.dispatch import fresh_database
from bench.harness import add_smoke_flag, say_smoke
from corral.scheduler.api.app import create_app
from corral.shared import runtime
from corral.shared.broker import celery_app
from corral.shared.settings import CoreSettings
from corral.shared.store.db import Database, make_engine, utcnow
from corral.shared.store.models import (
    CostEvent,
    ItemState,
    LifecycleEvent,
    Pool,
    Sandbox,
    WorkItem,
    WorkItemLog,
)

ORGS, POOLS_PER_ORG, BATCH = 20, 2, 5_000
ADMIN = "bench-console-admin-token"
STATES = [
    (ItemState.SUCCEEDED, 70),
    (ItemState.FAILED, 12),
    (ItemState.CANCELLED, 5),
    (ItemState.DISPATCH_ERROR, 3),
    (ItemState.RUNNING, 6),
    (ItemState.PROVISIONING, 2),
    (ItemState.RECEIVED, 2),
]
CODES = ("work_failed", "provision_failed", "heartbeat_lost", "timeout")


def _pools() -> list[dict[str, Any]]:
    return [
        {
            "id": f"pool-{org}-{n}",
            "org_id": f"org-{org}",
            "name": f"pool-{n}",
            "provider_id": "local",
            "priority": n,
            "max_concurrent": 1000,
            "sandbox_config": {},
            "rate_micros": 100,
        }
        for org in range(ORGS)
        for n in range(POOLS_PER_ORG)
    ]


def _item_rows(number: int, pools: list[dict[str, Any]], rng: random.Random) -> dict[str, Any]:
    now = utcnow()
    states = [state for state, _ in STATES]
    weights = [weight for _, weight in STATES]
    pool = pools[number % len(pools)]
    recent = number % 20 == 0
    created = now - timedelta(seconds=rng.uniform(0, 3600 if recent else 7 * 86400))
    state = rng.choices(states, weights)[0]
    final = state.is_final
    item_id = f"wi-bench-{number:08d}"
    failed = state in (ItemState.FAILED, ItemState.DISPATCH_ERROR)
    ended = created + timedelta(seconds=rng.uniform(5, 300))
    item = {
        "id": item_id,
        "org_id": pool["org_id"],
        "project_id": f"proj-{number % 7}",
        "payload": {"org": pool["org_id"], "work": {"kind": "shell", "command": "true"}},
        "state": state.value,
        "pool_id": pool["id"],
        "attempts": 1,
        "error_code": rng.choice(CODES) if failed else None,
        "created_at": created,
        "updated_at": ended if final else created,
        "finished_at": ended if final else None,
    }
    sandbox = {
        "id": f"sb-bench-{number:08d}",
        "work_item_id": item_id,
        "attempt": 1,
        "org_id": pool["org_id"],
        "pool_id": pool["id"],
        "provider_id": "local",
        "handle_metadata": {},
        "status": "terminated" if final else state.value.replace("received", "provisioning"),
        "created_at": created,
        "started_at": created,
        "terminated_at": ended if final else None,
    }
    return {"item": item, "sandbox": sandbox, "ended": ended, "final": final}


def _history(row: dict[str, Any]) -> dict[str, list[dict[str, Any]]]:
    item, sandbox = row["item"], row["sandbox"]
    events = [
        {
            "entity": "work_item",
            "entity_id": item["id"],
            "work_item_id": item["id"],
            "from_state": before,
            "to_state": after,
            "actor": "bench",
            "created_at": item["created_at"],
        }
        for before, after in ((None, "received"), ("received", "routed"), ("routed", item["state"]))
    ]
    costs = []
    if row["final"]:
        seconds = (row["ended"] - item["created_at"]).total_seconds()
        costs.append(
            {
                "sandbox_id": sandbox["id"],
                "work_item_id": item["id"],
                "org_id": item["org_id"],
                "project_id": item["project_id"],
                "pool_id": item["pool_id"],
                "provider_id": "local",
                "billing_model": "wall-clock",
                "started_at": item["created_at"],
                "ended_at": row["ended"],
                "seconds": seconds,
                "rate_micros": 100,
                "amount_micros": int(seconds * 100),
            }
        )
    logs = []
    if item["id"].endswith("0"):
        logs = [
            {"work_item_id": item["id"], "stream": "stdout", "line": f"line {n}"} for n in range(20)
        ]
    return {"events": events, "costs": costs, "logs": logs}


def seed(db: Database, items: int) -> None:
    rng = random.Random(20)  # noqa: S311 - the same rows every run, not a secret
    pools = _pools()
    with db.session() as session:
        session.execute(insert(Pool), pools)
    for start in range(0, items, BATCH):
        rows = [_item_rows(n, pools, rng) for n in range(start, min(items, start + BATCH))]
        history = [_history(row) for row in rows]
        with db.session() as session:
            session.execute(insert(WorkItem), [row["item"] for row in rows])
            session.execute(insert(Sandbox), [row["sandbox"] for row in rows])
            session.execute(insert(LifecycleEvent), [e for h in history for e in h["events"]])
            costs = [c for h in history for c in h["costs"]]
            if costs:
                session.execute(insert(CostEvent), costs)
            logs = [line for h in history for line in h["logs"]]
            if logs:
                session.execute(insert(WorkItemLog), logs)
    # What autovacuum does to a table in use: statistics, and the visibility map that lets
    # counts read their index alone.
    with db.engine.connect().execution_options(isolation_level="AUTOCOMMIT") as connection:
        connection.exec_driver_sql("VACUUM ANALYZE")


def pages(items: int) -> dict[str, str]:
    """Each page the benchmark requests, by name."""
    item = f"wi-bench-{(items // 2) // 10 * 10:08d}"  # one with log lines
    return {
        "overview": "/console/overview",
        "items": "/console/items",
        "items org": "/console/items?org=org-3",
        "items state=failed": "/console/items?state=failed",
        "items state=received": "/console/items?state=received",
        "items pool": "/console/items?pool=pool-5-1",
        "items org+state+since": "/console/items?org=org-4&state=running&since=7d",
        "items since=1h": "/console/items?since=1h",
        "items page 20": "",  # filled in by walking the pages
        "item": f"/console/items/{item}",
        "item logs": f"/console/items/{item}/logs?after=0",
        "pools": "/console/pools",
        "pool": "/console/pools/pool-7-0",
        "providers": "/console/providers",
        "provider local": "/console/providers/local",
        "costs 7d by org": "/console/costs?since=7d&by=org",
        "costs 24h by pool": "/console/costs?since=24h&by=pool",
        "costs 30d by provider": "/console/costs?since=30d&by=provider",
        "costs.csv 7d by pool": "/console/costs.csv?since=7d&by=pool",
    }


def _page_twenty(client: TestClient) -> str:
    path = "/console/items"
    for _ in range(19):
        html = client.get(path).text
        start = html.index('id="next-page" href="') + len('id="next-page" href="')
        path = html[start : html.index('"', start)].replace("&amp;", "&")
    return path


def measure(client: TestClient, path: str, requests: int) -> tuple[float, float]:
    timings = []
    for _ in range(requests):
        began = time.perf_counter()
        answer = client.get(path)
        timings.append((time.perf_counter() - began) * 1000)
        if answer.status_code != 200:
            raise SystemExit(f"{path}: {answer.status_code} {answer.text[:300]}")
    timings.sort()
    return statistics.median(timings), timings[max(0, round(len(timings) * 0.95) - 1)]


@contextmanager
def client_for(url: str) -> Iterator[TestClient]:
    settings = CoreSettings(database_url=url, admin_token=SecretStr(ADMIN), broker_url="memory://")
    celery_app.configure(settings)
    db = Database(make_engine(url))
    runtime.install(runtime.Runtime(settings=settings, db=db))
    # https, as a browser behind TLS: the console's cookies are Secure.
    with TestClient(create_app(), base_url="https://testserver") as client:
        form = re.search(r'name="csrf" value="([^"]+)"', client.get("/console/login").text)
        assert form is not None
        login = {"token": ADMIN, "csrf": form.group(1)}
        answer = client.post("/console/login", data=login, follow_redirects=False)
        assert answer.status_code == 303, answer.text
        yield client
    runtime.reset()
    db.dispose()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--items", type=int, default=100_000)
    parser.add_argument("--requests", type=int, default=20)
    parser.add_argument("--budget-ms", type=float, default=300.0)
    add_smoke_flag(parser)
    args = parser.parse_args()
    if args.smoke:  # page 20 needs a thousand items; no speed is asked of a smoke run
        args.items, args.requests, args.budget_ms = 1_000, 1, float("inf")
    say_smoke(args.smoke)
    over = []
    with fresh_database() as url:
        began = time.perf_counter()
        seeding = Database(make_engine(url))
        try:
            seed(seeding, args.items)
        finally:
            seeding.dispose()  # closed before the database is dropped, not left to the GC
        print(f"seeded {args.items:,} items in {time.perf_counter() - began:.1f} s")
        with client_for(url) as client:
            paths = pages(args.items)
            paths["items page 20"] = _page_twenty(client)
            print("| page | p50 | p95 |\n|---|---:|---:|")
            for name, path in paths.items():
                client.get(path)  # the first request compiles its statements
                p50, p95 = measure(client, path, args.requests)
                print(f"| {name} | {p50:.0f} ms | {p95:.0f} ms |", flush=True)
                if p95 > args.budget_ms:
                    over.append(name)
    if over:
        sys.exit(f"over the {args.budget_ms:.0f} ms budget: {', '.join(over)}")


if __name__ == "__main__":
    main()
