"""Dispatch → claimed with a warm pool against a cold one (issue 19), per provider.

One stack of corral's real processes (api, scheduler, the provider's worker, maintenance,
beat: ``tests/acceptance/stack.py``) on Redis and PostgreSQL, two orgs: one whose pool keeps
``--warm-min`` warm sandboxes, one whose pool keeps none. Rounds interleave warm and cold,
one item at a time, each dispatched over HTTP once the warm pool is full again and nothing
boots (so neither side shares the machine with a warm sandbox being made). An item's latency
is its ``claimed_at`` minus its ``created_at`` (both written by the control plane, one
clock): intake, routing, the provision task, then either a sandbox made and its runner
started (cold) or a bind and the hand-over down the waiting runner's channel (warm), the
registration and the claim.

Prints p50 / p90 / max per side, the warm hits (items whose sandbox was a warm one), the
commit and the date, as a table row for docs/benchmarks.md.

Usage: python -m bench.warm [--provider local|docker] [--rounds 30] [--warm-min 2] [--smoke]
(Redis and PostgreSQL on 127.0.0.1; docker: a private dockerd, as the docker tests start)
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import subprocess
import time
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime
from typing import Any

import docker
from sqlalchemy import select

from bench.dispatch import REDIS, fresh_database
from bench.harness import add_smoke_flag, say_smoke
from corral.shared.store.db import Database, make_engine
from corral.shared.store.models import Sandbox, WarmSandbox, WorkItem
from tests.acceptance.stack import REPO, Stack
from tests.docker_engine import ensure_engine, ensure_sandbox_image


def _pool(stack: Stack, org: str, provider: str, warm_min: int) -> str:
    pool = {
        "org_id": org,
        "name": "bench",
        "provider_id": provider,
        "max_concurrent": 8,
        "warm_min": warm_min,
    }
    status, body = stack.request("POST", "/v1/admin/pools", pool)
    assert status == 201, body
    return str(body["id"])


def _full(db: Database, pool_id: str, warm_min: int) -> bool:
    """The pool has ``warm_min`` waiting warm sandboxes and none booting."""
    with db.session() as session:
        states = session.scalars(
            select(WarmSandbox.state).where(
                WarmSandbox.pool_id == pool_id, WarmSandbox.state.in_(["booting", "waiting"])
            )
        ).all()
    return list(states) == ["waiting"] * warm_min


def _one(stack: Stack, db: Database, org: str) -> tuple[float, bool]:
    """Dispatch one item to ``org``; its dispatch → claimed seconds, and whether it ran in a
    warm sandbox."""
    message = {
        "org": org,
        "project": "bench",
        "profile": "default",
        "work": {"kind": "shell", "command": "true"},
    }
    status, body = stack.request("POST", "/v1/dispatch", message)
    assert status == 202, body
    [view] = stack.wait_final([body["id"]], timeout_s=120)
    assert view["state"] == "succeeded", view
    with db.session() as session:
        item = session.get(WorkItem, body["id"])
        sandboxes = session.scalars(
            select(Sandbox).where(Sandbox.work_item_id == body["id"]).order_by(Sandbox.attempt)
        ).all()
        if len(sandboxes) != 1:  # an attempt was lost: say how, then measure the last
            events = stack.request("GET", f"/v1/work-items/{body['id']}/events")[1]
            print(f"{org}: {len(sandboxes)} sandboxes: {events}")
        sandbox = sandboxes[-1]
        assert item is not None and item.claimed_at is not None
        warm = (sandbox.external_id or "").startswith("wm-") or "wm-" in str(
            sandbox.handle_metadata
        )
        return (item.claimed_at - item.created_at).total_seconds(), warm


def _summary(name: str, seconds: list[float]) -> str:
    ordered = sorted(seconds)
    p90 = ordered[max(0, round(0.9 * len(ordered)) - 1)]
    return (
        f"{name}: p50 {statistics.median(ordered) * 1000:.0f} ms, "
        f"p90 {p90 * 1000:.0f} ms, max {ordered[-1] * 1000:.0f} ms (n={len(ordered)})"
    )


@contextlib.contextmanager
def _provider_config(provider: str) -> Iterator[dict[str, Any]]:
    if provider == "local":
        yield {}
        return
    engine = ensure_engine()
    client = docker.DockerClient(base_url=engine.url)
    try:
        image = ensure_sandbox_image(client)
        yield {"docker": {"base_url": engine.url, "image": image, "grace_period_s": 1}}
    finally:
        client.close()
        if engine.started_here:
            engine.stop()


def run(provider: str, rounds: int, warm_min: int) -> None:
    with _provider_config(provider) as config, fresh_database() as url:
        stack = Stack(
            database_url=url,
            broker_url=REDIS,
            provider_config=config,
            extra_env={"CORRAL_WARM_INTERVAL_S": "0.5"},
        )
        db = Database(make_engine(url))
        try:
            stack.start_only(["api", "scheduler", f"worker-{provider}", "maintenance", "beat"])
            profile = {"name": "default", "model": "m", "auth_mode": "byok"}
            assert stack.request("POST", "/v1/admin/profiles", profile)[0] == 201
            suffix = uuid.uuid4().hex[:6]
            warm_pool = _pool(stack, f"warm-{suffix}", provider, warm_min)
            _pool(stack, f"cold-{suffix}", provider, 0)
            timings: dict[str, list[float]] = {"warm": [], "cold": []}
            hits = 0
            for number in range(rounds + 1):  # the first round warms up both paths
                for side in ("warm", "cold"):
                    stack.until(
                        lambda: _full(db, warm_pool, warm_min), "warm pool full", timeout_s=120
                    )
                    seconds, warm = _one(stack, db, f"{side}-{suffix}")
                    if number:
                        timings[side].append(seconds)
                        hits += warm and side == "warm"
                    assert warm == (side == "warm"), (side, warm)
            _report(provider, rounds, warm_min, timings, hits)
        finally:
            db.dispose()
            stack.stop()


def _report(
    provider: str, rounds: int, warm_min: int, timings: dict[str, list[float]], hits: int
) -> None:
    commit = subprocess.run(
        ["git", "log", "-1", "--format=%h %s"],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=False,
    ).stdout.strip()
    print(f"provider {provider}, {rounds} rounds, warm_min {warm_min}")
    print(f"commit {commit}; {datetime.now(UTC):%Y-%m-%d %H:%M} UTC")
    print(_summary("warm", timings["warm"]), f"warm hits {hits}/{rounds}")
    print(_summary("cold", timings["cold"]))
    ratio = statistics.median(timings["cold"]) / statistics.median(timings["warm"])
    print(f"cold / warm (medians): {ratio:.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--provider", choices=["local", "docker"], default="local")
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--warm-min", type=int, default=2)
    add_smoke_flag(parser)
    args = parser.parse_args()
    if args.smoke:
        args.rounds, args.warm_min = 1, 1
    say_smoke(args.smoke)
    started = time.monotonic()
    run(args.provider, args.rounds, args.warm_min)
    print(f"took {time.monotonic() - started:.0f} s")


if __name__ == "__main__":
    main()
