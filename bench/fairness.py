"""Admission under a backlog: utilisation, what a freed slot costs, and priority.

Real processes (api, scheduler, a local provider worker, the maintenance worker, beat) on
PostgreSQL and Redis; every item is a local sandbox running ``sleep D``.

- **Utilisation**: ``--items`` items (500) of D s (2) sent at once onto a pool of
  ``--slots`` (16): from the first item's intake to the last one's end, against the ideal
  ``items * D / slots`` (62.5 s); the ratio is the figure (target ≤ 1.1).
- **A freed slot's cost, and priority**: ``--backlog`` items (2,000) onto a pool of 8 slots;
  once they run, a ``high`` item and a ``normal`` one are sent. Over the next ``--window``
  items that end, the maintenance worker's CPU per item handed on (target < 5 ms), beside the
  provider worker's CPU per item in the same window (the anchor: a provision's own cost).
  The high item's wait for its sandbox, in item durations (target ≤ 2), beside the normal
  one's: first come first served, it waits behind every item before it (its place, read from
  its view, times D over the slots).
- **Pacing** (:mod:`bench.pacing`): 100 items at once onto the E2B stand-in refusing creates
  past 5 a second, paced by e2b's defaults beside the anchor without pacing (target: none
  fails or is retried for the quota, the last sandbox within 1.2x the ideal 20 s).

The stacks run with the deployment's default periodic intervals (re-drive 5 s, reaper 15 s,
reconcile 60 s, heartbeats 10 s), not the test stack's shortened ones: what a deployment pays.

Usage: python -m bench.fairness [--items 500] [--slots 16] [--backlog 2000] [--window 120]
[--duration 2] [--shared-slots 8] [--flood 1000] [--window-s 300]
[--only admission|shares|pacing] [--smoke]   (Redis and PostgreSQL on 127.0.0.1)
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass
from typing import Any

from sqlalchemy import func, select

from bench import fair_share, pacing
from bench.dispatch import REDIS, fresh_database
from bench.harness import add_smoke_flag, deployment_intervals, say_smoke, until
from bench.provisions import cpu_seconds
from corral.scheduler.admin.pools import PoolCreate, ProfileCreate, create_pool, create_profile
from corral.shared.store.db import Database, make_engine
from corral.shared.store.models import AuthMode, ItemState, WorkItem
from tests.acceptance.stack import Stack

ORG = "fair"


@dataclass(frozen=True)
class Plan:
    items: int
    slots: int
    backlog: int
    backlog_slots: int
    window: int
    duration_s: float


def _seed(db: Database, slots: int) -> None:
    create_profile(db, ProfileCreate(name="default", model="m", auth_mode=AuthMode.BYOK))
    create_pool(db, PoolCreate(org_id=ORG, name="pool", provider_id="local", max_concurrent=slots))


def _message(number: int, duration_s: float, priority: str = "normal") -> dict[str, Any]:
    return {
        "org": ORG,
        "project": f"p{number % 50}",
        "profile": "default",
        "priority": priority,
        "work": {"kind": "shell", "command": f"sleep {duration_s:g}"},
    }


def _send(stack: Stack, count: int, duration_s: float) -> list[str]:
    ids = []
    for number in range(count):
        status, body = stack.request("POST", "/v1/dispatch", _message(number, duration_s))
        if status != 202:
            raise RuntimeError(f"dispatch answered {status}: {body}")
        ids.append(body["id"])
    return ids


def _count(db: Database, *states: ItemState) -> int:
    with db.session() as session:
        query = select(func.count()).where(WorkItem.state.in_([s.value for s in states]))
        return int(session.scalar(query) or 0)


def _stack(url: str, plan: Plan, slots: int) -> Stack:
    return Stack(
        database_url=url,
        broker_url=REDIS,
        worker_concurrency=max(16, slots),
        local_max_concurrent=slots,
        extra_env=deployment_intervals(),
    )


def utilisation(plan: Plan) -> tuple[float, float]:
    """(seconds from the first intake to the last end, the ideal seconds)."""
    with fresh_database() as url:
        db = Database(make_engine(url))
        _seed(db, plan.slots)
        stack = _stack(url, plan, plan.slots).start()
        try:
            _send(stack, plan.items, plan.duration_s)
            ideal = plan.items * plan.duration_s / plan.slots
            until(
                lambda: _count(db, ItemState.SUCCEEDED, ItemState.FAILED) == plan.items,
                f"{plan.items} items ended",
                timeout_s=20 * ideal + 120,
                poll_s=0.5,
                check=stack.check_alive,
            )
            if _count(db, ItemState.FAILED):
                raise RuntimeError(f"items failed: {stack.logs()}")
            with db.session() as session:
                first, last = session.execute(
                    select(func.min(WorkItem.created_at), func.max(WorkItem.finished_at))
                ).one()
            assert first is not None and last is not None  # every item ended
        finally:
            stack.stop()
            db.dispose()
    return (last - first).total_seconds(), ideal


@dataclass(frozen=True)
class Backlog:
    maintenance_ms: float  # the maintenance worker's CPU per item handed on
    worker_ms: float  # the provider worker's CPU per item in the same window
    high_waits: float  # the high item's wait for its sandbox, in item durations
    fifo_waits: float  # a normal item's, sent with it: its place * D / slots, in durations
    ahead_of_normal: int


def backlog(plan: Plan, size: int) -> Backlog:
    with fresh_database() as url:
        db = Database(make_engine(url))
        _seed(db, plan.backlog_slots)
        stack = _stack(url, plan, plan.backlog_slots).start()
        try:
            return _backlog_run(stack, db, plan, size)
        finally:
            stack.stop()
            db.dispose()


def _backlog_run(stack: Stack, db: Database, plan: Plan, size: int) -> Backlog:
    _send(stack, size, plan.duration_s)
    until(
        lambda: _count(db, ItemState.RUNNING) >= plan.backlog_slots,
        "the pool's slots all running",
        timeout_s=300,
        poll_s=0.2,
        check=stack.check_alive,
    )
    ended_before = _count(db, ItemState.SUCCEEDED)
    cpu_before = _cpus(stack)
    sent = time.monotonic()
    high = _one(stack, plan, "high", size)
    normal = _one(stack, plan, "normal", size + 1)
    ahead = int(stack.request("GET", f"/v1/work-items/{normal}")[1]["waiting"]["ahead"])
    fair_share.wait_claimed(stack, high, "the high item", plan.duration_s)
    high_wait = time.monotonic() - sent
    until(
        lambda: _count(db, ItemState.SUCCEEDED) - ended_before >= plan.window,
        f"{plan.window} more items ended",
        timeout_s=20 * plan.window * plan.duration_s / plan.backlog_slots + 120,
        poll_s=0.5,
        check=stack.check_alive,
    )
    ended = _count(db, ItemState.SUCCEEDED) - ended_before
    cpu_after = _cpus(stack)
    return Backlog(
        maintenance_ms=1000 * (cpu_after[0] - cpu_before[0]) / ended,
        worker_ms=1000 * (cpu_after[1] - cpu_before[1]) / ended,
        high_waits=high_wait / plan.duration_s,
        fifo_waits=(ahead / plan.backlog_slots),
        ahead_of_normal=ahead,
    )


def _one(stack: Stack, plan: Plan, priority: str, number: int) -> str:
    status, body = stack.request(
        "POST", "/v1/dispatch", _message(number, plan.duration_s, priority)
    )
    if status != 202:
        raise RuntimeError(f"dispatch answered {status}: {body}")
    return str(body["id"])


def _cpus(stack: Stack) -> tuple[float, float]:
    return (
        sum(cpu_seconds(stack.processes["maintenance"].pid)),
        sum(cpu_seconds(stack.processes["worker-local"].pid)),
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--items", type=int, default=500, help="items of the utilisation run")
    parser.add_argument("--slots", type=int, default=16, help="the utilisation run's slots")
    parser.add_argument("--backlog", type=int, default=2000, help="items waiting on 8 slots")
    parser.add_argument("--window", type=int, default=120, help="items ended while measured")
    parser.add_argument("--duration", type=float, default=2.0, help="each item's seconds")
    parser.add_argument("--shared-slots", type=int, default=8, help="the shared capacity's slots")
    parser.add_argument("--flood", type=int, default=1000, help="org A's items (starvation)")
    parser.add_argument("--window-s", type=float, default=300.0, help="the weights' window")
    parser.add_argument(
        "--only", choices=("admission", "shares", "pacing"), help="run one part alone"
    )
    add_smoke_flag(parser)
    args = parser.parse_args()
    plan = Plan(args.items, args.slots, args.backlog, 8, args.window, args.duration)
    if args.smoke:
        plan = Plan(items=6, slots=2, backlog=8, backlog_slots=2, window=2, duration_s=1.0)
    say_smoke(args.smoke)
    if args.only in (None, "admission"):
        _admission(plan)
    if args.only in (None, "shares"):
        fair_share.report(
            smoke=args.smoke, slots=args.shared_slots, flood=args.flood, window_s=args.window_s
        )
    if args.only in (None, "pacing"):
        pacing.report(smoke=args.smoke)


def _admission(plan: Plan) -> None:
    took, ideal = utilisation(plan)
    print(
        f"utilisation: {plan.items} items of {plan.duration_s:g} s on {plan.slots} slots: "
        f"{took:.1f} s against the ideal {ideal:.1f} s: {took / ideal:.2f}x (target <= 1.1)",
        flush=True,
    )
    # A tenth of the backlog first: what a freed slot costs must not grow with it.
    for size in (max(plan.window + plan.backlog_slots, plan.backlog // 10), plan.backlog):
        found = backlog(plan, size)
        print(
            f"backlog: {size} items waiting on {plan.backlog_slots} slots: the "
            f"maintenance worker's CPU {found.maintenance_ms:.2f} ms per item handed on "
            f"(target < 5, and the same at either backlog), the provider worker's "
            f"{found.worker_ms:.2f} ms per item (anchor)\n"
            f"priority: a high item sent behind them started after {found.high_waits:.2f} "
            f"item durations (target <= 2); a normal one sent with it has "
            f"{found.ahead_of_normal} ahead of it: first come first served, "
            f"{found.fifo_waits:.0f} item durations",
            flush=True,
        )


if __name__ == "__main__":
    main()
