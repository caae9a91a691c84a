"""HTTP intake beside the Celery intake, in the same run, on the same api and scheduler.

One ``corral api`` (the production server: ``corral.scheduler.api.server``) and one
``corral scheduler`` run alone against a database of their own and a Redis key prefix of
their own, with 1 org of 5 pools and an org key of the dispatch scope.

- HTTP: ``--items`` ``POST /v1/dispatch`` from ``--clients`` concurrent clients, each
  request on a new connection (``Connection: close``) with the org key and an
  ``Idempotency-Key`` of its own; the rate (first request sent to last answer read) and
  each request's latency (connect to answer read), p50 and p99. Every answer must be 202.
- The anchor, Celery: the same messages sent as ``corral.dispatch`` tasks by a plain Celery
  publisher (no task-sent events) while the scheduler consumes them; the rate from the
  first send until all the items are written (counted in the database).

An item of either side is validated, written with its lifecycle events, routed and its
provision task published (no provider worker runs). Each side first sends ``--warmup``
dispatches, not counted: a process's first ones pay for its cold start. Rounds interleave
HTTP and Celery; each line gives the CPU the taking process (the api, the scheduler) spent
per dispatch, and the 1-minute load average at its start.

Usage: python -m bench.http_intake [--items 3000] [--clients 32] [--rounds 2] [--warmup 100]
[--api-processes 1]
[--smoke]
(Redis and PostgreSQL on 127.0.0.1)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

from sqlalchemy import func, select

from bench.dispatch import REDIS, fresh_database, message, seed
from bench.harness import add_smoke_flag, say_smoke, until
from bench.local_start import percentile
from bench.provisions import cpu_seconds
from bench.routing import publisher_for
from corral.shared.store.db import Database, make_engine
from corral.shared.store.models import WorkItem
from tests.acceptance.stack import Stack

ORG = "org-0"
DONE_TIMEOUT_S = 300  # for every dispatch of a run to be answered or written
REQUEST_TIMEOUT_S = 30  # for one HTTP request's answer


@dataclass(frozen=True)
class Plan:
    items: int
    clients: int
    rounds: int
    warmup: int
    api_processes: int = 1

    @classmethod
    def smoke(cls) -> Plan:
        return cls(items=30, clients=4, rounds=1, warmup=4)


@dataclass(frozen=True)
class Result:
    """One side's run: its rate, and each dispatch's latency (HTTP only)."""

    items: int
    seconds: float
    load: float
    cpu_s: float  # of the process that took the dispatches: the api, or the scheduler
    latencies: tuple[float, ...] = ()

    @property
    def rate(self) -> float:
        return self.items / self.seconds

    def describe(self) -> str:
        said = f"{self.items} in {self.seconds:.2f} s = {self.rate:,.0f}/s"
        if self.latencies:
            said += (
                f", p50 {1000 * percentile(list(self.latencies), 0.5):.1f} ms"
                f", p99 {1000 * percentile(list(self.latencies), 0.99):.1f} ms"
            )
        cpu = 1000 * self.cpu_s / self.items
        return f"{said}, {cpu:.2f} ms of CPU per dispatch (load {self.load:.2f})"


def load_average() -> float:
    with open("/proc/loadavg") as found:
        return float(found.read().split()[0])


def _request(port: int, key: str, project: str, number: int) -> bytes:
    body = json.dumps({**message(ORG, number), "project": project}).encode()
    head = (
        f"POST /v1/dispatch HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
        f"Authorization: Bearer {key}\r\nContent-Type: application/json\r\n"
        f"Idempotency-Key: {project}-{number}\r\nContent-Length: {len(body)}\r\n"
        "Connection: close\r\n\r\n"
    )
    return head.encode() + body


async def _post(port: int, request: bytes) -> tuple[int, float, bytes]:
    """One request on a connection of its own: its status, latency and answer."""
    started = time.perf_counter()
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(request)
        answer = await asyncio.wait_for(reader.read(), REQUEST_TIMEOUT_S)
    finally:
        writer.close()
    took = time.perf_counter() - started
    status = int(answer.split(b" ", 2)[1]) if answer.startswith(b"HTTP/1.1 ") else 0
    return status, took, answer


async def _post_all(port: int, requests: list[bytes], clients: int) -> list[float]:
    waiting = iter(requests)
    latencies: list[float] = []

    async def client() -> None:
        for request in waiting:  # one iterator: each request is taken by one client
            status, took, answer = await _post(port, request)
            if status != 202:
                raise RuntimeError(f"a dispatch was answered {status}: {answer[-400:]!r}")
            latencies.append(took)

    await asyncio.gather(*(client() for _ in range(clients)))
    return latencies


def http_run(stack: Stack, key: str, project: str, plan: Plan, items: int) -> Result:
    requests = [_request(stack.port, key, project, number) for number in range(items)]
    load, cpu = load_average(), _cpu(stack, "api")
    started = time.perf_counter()
    latencies = asyncio.run(
        asyncio.wait_for(_post_all(stack.port, requests, plan.clients), DONE_TIMEOUT_S)
    )
    seconds = time.perf_counter() - started
    return Result(items, seconds, load, _cpu(stack, "api") - cpu, tuple(latencies))


def celery_run(stack: Stack, db: Database, project: str, items: int) -> Result:
    publisher = publisher_for(stack.key_prefix)
    messages = [
        {**message(ORG, n), "project": project, "idempotency_key": f"{project}-{n}"}
        for n in range(items)
    ]
    count = select(func.count()).where(WorkItem.project_id == project)

    def written() -> bool:
        with db.session() as session:
            return (session.scalar(count) or 0) >= items

    load, cpu = load_average(), _cpu(stack, "scheduler")
    try:
        started = time.perf_counter()
        for one in messages:
            publisher.send_task("corral.dispatch", args=[one], queue="dispatch")
        until(
            written,
            f"{items} corral.dispatch messages written ({project})",
            DONE_TIMEOUT_S,
            check=stack.check_alive,
        )
        seconds = time.perf_counter() - started
    finally:
        publisher.close()
    return Result(items, seconds, load, _cpu(stack, "scheduler") - cpu)


def _cpu(stack: Stack, name: str) -> float:
    """The process's CPU seconds and its live children's (the api's processes)."""
    pid = stack.processes[name].pid
    children = [int(each) for each in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    return float(sum(sum(cpu_seconds(each)) for each in [pid, *children]))


def make_key(stack: Stack) -> str:
    status, body = stack.request(
        "POST", f"/v1/admin/orgs/{ORG}/keys", {"name": "bench", "scopes": ["dispatch"]}
    )
    if status != 201:
        raise RuntimeError(f"the org key was not made: {status} {body}")
    return str(body["key"])


def measure(plan: Plan) -> dict[str, list[Result]]:
    results: dict[str, list[Result]] = {"http": [], "celery": []}
    with fresh_database() as url:
        db = Database(make_engine(url))
        seed(db, orgs=1, pools_per_org=5)
        stack = Stack(
            database_url=url,
            broker_url=REDIS,
            extra_env={"CORRAL_API_PROCESSES": str(plan.api_processes)},
        )
        try:
            stack.start_only(["api", "scheduler"])
            key = make_key(stack)
            http_run(stack, key, "warmup-http", plan, plan.warmup)
            celery_run(stack, db, "warmup-celery", plan.warmup)
            for number in range(1, plan.rounds + 1):
                http = http_run(stack, key, f"http-{number}", plan, plan.items)
                print(f"http   round {number}: {http.describe()}", flush=True)
                celery = celery_run(stack, db, f"celery-{number}", plan.items)
                print(f"celery round {number}: {celery.describe()}", flush=True)
                results["http"].append(http)
                results["celery"].append(celery)
        finally:
            stack.stop()
            db.dispose()
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--items", type=int, default=3000, help="dispatches per side and round")
    parser.add_argument("--clients", type=int, default=32, help="concurrent HTTP clients")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--warmup", type=int, default=100, help="dispatches first, not counted")
    parser.add_argument(
        "--api-processes", type=int, default=1, help="the api's processes (CORRAL_API_PROCESSES)"
    )
    add_smoke_flag(parser)
    args = parser.parse_args()
    plan = (
        Plan.smoke()
        if args.smoke
        else Plan(
            items=args.items,
            clients=args.clients,
            rounds=args.rounds,
            warmup=args.warmup,
            api_processes=args.api_processes,
        )
    )
    say_smoke(args.smoke)
    results = measure(plan)
    http, celery = results["http"], results["celery"]
    latencies = [latency for run in http for latency in run.latencies]
    ours = statistics.median(run.rate for run in http)
    anchor = statistics.median(run.rate for run in celery)
    api_cpu = statistics.median(1000 * run.cpu_s / run.items for run in http)
    scheduler_cpu = statistics.median(1000 * run.cpu_s / run.items for run in celery)
    print(
        f"HTTP intake {ours:,.0f}/s (p50 {1000 * percentile(latencies, 0.5):.1f} ms, "
        f"p99 {1000 * percentile(latencies, 0.99):.1f} ms, {plan.clients} clients, a "
        f"connection each; {plan.api_processes} api process(es), their CPU {api_cpu:.2f} ms "
        f"per dispatch); Celery intake "
        f"{anchor:,.0f}/s (the scheduler's CPU {scheduler_cpu:.2f} ms); HTTP / Celery "
        f"{ours / anchor:.2f} (medians of {plan.rounds})"
    )


if __name__ == "__main__":
    main()
