"""Benchmark of the reaper's sweep on PostgreSQL: its cost follows the stale sandboxes.

A database is filled with N healthy live sandboxes (running, heartbeating, deadline ahead)
plus as many ended ones (history), then S stale ones spread over the five rules. One sweep
(rules only; it ends the stale ones in batches of corral.worker.termination.BATCH) is timed and
its SQL statements counted; then, separately, one reconciliation
pass against an in-memory provider that holds every live sandbox (that pass lists them
all, so it costs what the provider holds, and runs every ``reconcile_interval_s``).

The pass's statements do not grow with N (tests/integration/test_reconcile_statements.py
holds it to that, with this module's rows): one read of the live set, one lookup of what
the provider lists and the set lacks, and the ends of what differs.

Usage: python -m bench.reaper [--healthy 1000,10000,100000] [--stale 10,100,1000] [--smoke]
(needs PostgreSQL on 127.0.0.1)
"""

from __future__ import annotations

import argparse
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

from pydantic import SecretStr
from sqlalchemy import event, insert, text

from bench.dispatch import fresh_database
from bench.harness import add_smoke_flag, say_smoke
from corral.providers.base import ManagedSandbox, SandboxSpec
from corral.providers.testing import InMemoryProvider
from corral.shared.runtime import Runtime
from corral.shared.settings import CoreSettings
from corral.shared.store.db import Database, make_engine, utcnow
from corral.shared.store.models import ItemState, Pool, Sandbox, WorkItem
from corral.worker.reaper import SweepReport, reconcile, sweep
from corral.worker.sweep_lock import LocalSweepLock

PAYLOAD = {
    "org": "acme",
    "project": "web",
    "profile": "default",
    "work": {"kind": "shell", "command": "true"},
}
RULES = ("finished", "deadline", "heartbeat_lost", "never_claimed", "provision_stuck")
BATCH = 5_000
BENCH_TOKEN = SecretStr("crt_" + "0" * 43)  # never redeemed: these runners do not exist


class TimedListing(InMemoryProvider):
    """The in-memory provider, timing its own listing: what a pass spends in the provider
    (a remote call, for a real one) apart from corral's part."""

    def __init__(self) -> None:
        super().__init__()
        self.listing_s: list[float] = []

    def list_managed(self) -> list[ManagedSandbox]:
        started = time.perf_counter()
        try:
            return super().list_managed()
        finally:
            self.listing_s.append(time.perf_counter() - started)


class NoReconcile(LocalSweepLock):
    """The sweep's rules alone: reconciliation is measured on its own."""

    def due(self, phase: str, interval_s: float) -> bool:
        return False


@contextmanager
def counted(db: Database) -> Iterator[list[str]]:
    statements: list[str] = []

    def count(*args: Any) -> None:
        statements.append(args[2])

    event.listen(db.engine, "before_cursor_execute", count)
    try:
        yield statements
    finally:
        event.remove(db.engine, "before_cursor_execute", count)


def add_pool(db: Database) -> None:
    """Org acme's pool ``pool-mem`` of the in-memory provider, which every row here is in."""
    with db.session() as session:
        session.add(
            Pool(
                id="pool-mem",
                org_id="acme",
                name="mem",
                provider_id="in-memory",
                max_concurrent=1_000_000,
                sandbox_config={},
                billing_model="wall-clock",
                rate_micros=10,
            )
        )


Rows = list[tuple[dict[str, Any], dict[str, Any]]]  # (work item, its sandbox) per number


def healthy_rows(numbers: range) -> Rows:
    """A running item and its live sandbox for each of ``numbers``: heartbeating, its
    deadline an hour ahead."""
    now = utcnow()
    return [
        _rows(
            number,
            "running",
            ItemState.RUNNING,
            started=now - timedelta(minutes=5),
            heartbeat=now,
            deadline=now + timedelta(hours=1),
        )
        for number in numbers
    ]


def insert_rows(db: Database, rows: Rows) -> None:
    """Write ``rows`` straight into the tables, by multi-row inserts."""
    for start in range(0, len(rows), BATCH):
        chunk = rows[start : start + BATCH]
        with db.session() as session:
            session.execute(insert(WorkItem), [item for item, _ in chunk])
            session.execute(insert(Sandbox), [sandbox for _, sandbox in chunk])


def seed(db: Database, *, healthy: int, ended: int, stale: int) -> list[SandboxSpec]:
    """Rows straight into the tables (bulk inserts); returns the specs of live sandboxes,
    for the in-memory provider to hold."""
    now = utcnow()
    add_pool(db)
    rows = healthy_rows(range(healthy))
    for number in range(healthy, healthy + ended):
        rows.append(
            _rows(
                number,
                "terminated",
                ItemState.SUCCEEDED,
                started=now - timedelta(days=2),
                terminated=now - timedelta(days=1),
            )
        )
    base = healthy + ended
    for index in range(stale):
        rows.append(_stale_rows(base + index, RULES[index % len(RULES)], now))
    insert_rows(db, rows)
    with db.engine.connect() as connection:
        connection.execute(text("ANALYZE"))
        connection.commit()
    return [spec_of(sandbox) for _, sandbox in rows if sandbox["terminated_at"] is None]


def _rows(
    number: int,
    status: str,
    state: ItemState,
    *,
    started: Any = None,
    heartbeat: Any = None,
    deadline: Any = None,
    terminated: Any = None,
    end_requested: Any = None,
    created: Any = None,
) -> tuple[dict[str, Any], dict[str, Any]]:
    item_id = f"wi-{number:08d}"
    now = utcnow()
    item = {
        "id": item_id,
        "org_id": "acme",
        "project_id": "web",
        "payload": PAYLOAD,
        "state": state.value,
        "pool_id": "pool-mem",
        "attempts": 1,
        "created_at": now,
        "updated_at": now,
    }
    sandbox = {
        "id": f"sb-{number:08d}-1",
        "work_item_id": item_id,
        "attempt": 1,
        "org_id": "acme",
        "pool_id": "pool-mem",
        "provider_id": "in-memory",
        "external_id": None if status == "provisioning" else f"sb-{number:08d}-1",
        "handle_metadata": {"org_id": "acme"},
        "status": status,
        "created_at": created or started or now,
        "started_at": started,
        "deadline_at": deadline,
        "last_heartbeat_at": heartbeat,
        "terminated_at": terminated,
        "end_requested_at": end_requested,
        "termination_reason": "finished" if terminated else None,
    }
    return item, sandbox


def _stale_rows(number: int, rule: str, now: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    hour_ago = now - timedelta(hours=1)
    if rule == "finished":
        return _rows(
            number,
            "running",
            ItemState.SUCCEEDED,
            started=hour_ago,
            heartbeat=now,
            end_requested=hour_ago,
        )
    if rule == "deadline":
        return _rows(
            number,
            "running",
            ItemState.RUNNING,
            started=hour_ago,
            heartbeat=now,
            deadline=now - timedelta(minutes=1),
        )
    if rule == "heartbeat_lost":
        return _rows(number, "running", ItemState.RUNNING, started=hour_ago, heartbeat=hour_ago)
    if rule == "never_claimed":
        return _rows(number, "ready", ItemState.AWAITING_CLAIM, started=hour_ago)
    return _rows(number, "provisioning", ItemState.PROVISIONING, created=hour_ago)


def spec_of(sandbox: dict[str, Any]) -> SandboxSpec:
    """What the in-memory provider holds for a live sandbox row."""
    return SandboxSpec(
        work_item_id=sandbox["work_item_id"],
        sandbox_id=sandbox["id"],
        org_id="acme",
        project_id="web",
        registration_token=BENCH_TOKEN,
        control_url="http://127.0.0.1:9",
    )


def measure(healthy: int, stale: int) -> dict[str, Any]:
    with fresh_database() as url:
        db = Database(make_engine(url))
        try:
            specs = seed(db, healthy=healthy, ended=healthy, stale=stale)
            provider = TimedListing()
            for spec in specs:
                provider.adopt(spec)
            settings = CoreSettings(
                database_url=url,
                reaper_batch=max(stale, 500),
                provision_timeout_s=900,
                token_ttl_s=900,
                # Longer than seeding takes (minutes at 100,000 on a busy machine): the
                # healthy sandboxes' heartbeats stay fresh; the stale ones' are an hour old.
                heartbeat_timeout_s=900,
            )
            rt = Runtime(settings=settings, db=db)
            rt.use_provider(provider)
            with counted(db) as statements:
                started = time.perf_counter()
                report = sweep(rt, NoReconcile(60))
                sweep_s = time.perf_counter() - started
            reconcile_s, reconcile_statements = _reconcile(rt, db)
            listing_s = provider.listing_s[-1]
        finally:
            db.dispose()
    _check(report, stale)
    return {
        "healthy": healthy,
        "stale": stale,
        "sweep_ms": sweep_s * 1000,
        "statements": len(statements),
        "per_stale": len(statements) / max(stale, 1),
        "reconcile_ms": reconcile_s * 1000,
        "listing_ms": listing_s * 1000,
        "reconcile_statements": reconcile_statements,
    }


def _reconcile(rt: Runtime, db: Database) -> tuple[float, int]:
    with counted(db) as statements:
        started = time.perf_counter()
        found = reconcile(rt, SweepReport())
        elapsed = time.perf_counter() - started
    assert found == [], f"reconciliation found {len(found)} sandboxes to end; expected none"
    return elapsed, len(statements)


def _check(report: SweepReport, stale: int) -> None:
    ended = sum(report.ended.values())
    if ended != stale or report.errors:
        raise SystemExit(
            f"the sweep ended {ended} of {stale} stale sandboxes "
            f"({report.errors} errors): the benchmark is invalid"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--healthy", default="1000,10000,100000")
    parser.add_argument("--stale", default="10,100,1000", help="stale counts at the largest N")
    add_smoke_flag(parser)
    args = parser.parse_args()
    if args.smoke:
        args.healthy, args.stale = "10", "5"
    say_smoke(args.smoke)
    sizes = [int(n) for n in args.healthy.split(",")]
    stale_counts = [int(n) for n in args.stale.split(",")]
    runs = [(n, stale_counts[0]) for n in sizes]
    runs += [(sizes[-1], s) for s in stale_counts[1:]]
    print(f"run {uuid.uuid4().hex[:6]}: live healthy sandboxes N (plus N ended), S stale")
    print(
        "| N healthy | S stale | sweep (ms) | SQL statements | per stale | "
        "reconcile pass (ms) | of which the provider's listing (ms) | reconcile SQL |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    for healthy, stale in runs:
        row = measure(healthy, stale)
        print(
            f"| {row['healthy']:,} | {row['stale']:,} | {row['sweep_ms']:.0f} | "
            f"{row['statements']} | {row['per_stale']:.2f} | {row['reconcile_ms']:.0f} | "
            f"{row['listing_ms']:.0f} | "
            f"{row['reconcile_statements']} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
