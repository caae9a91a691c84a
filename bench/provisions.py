"""Provisions in flight in one provider worker process, against a provider that takes 0.5 s.

One real ``corral worker --provider slow`` process (``bench/slow_provider.py``: corral's
command line with the in-memory provider slowed down; threads pool, concurrency 256 by
default) on a database and Redis key prefix of its own. N items are written and routed by
the scheduler's own batch path (``corral.scheduler.batch.accept_batch``) and their provision tasks
published as the scheduler does (``enqueue_all``); the clock runs from the first publish to
the last item awaiting its runner. Reported:

- provisions in flight in the process, most and mean (counted inside the provider; the mean
  is over the time from the first provision() to the last);
- CPU seconds of the worker process per provision (``/proc/<pid>/stat``, user + system);
- SQL statements per provision (counted in the worker, SQLAlchemy's cursor events) and
  PostgreSQL transactions per provision (``pg_stat_database``);
- the most database connections the process held (``pg_stat_activity`` by its
  ``application_name``, sampled every 20 ms), beside its pool size;
- the process's RSS growth from idle to its peak, per provision in flight at the peak.

With ``--celery-only`` the worker's provision task calls the provider and nothing else:
the anchor, what one Celery task costs this worker (BENCH_CELERY_ONLY in
``bench/slow_provider.py``). The worker's environment is this process's, so settings such
as ``CORRAL_TASK_EVENTS=false`` reach it.

Usage: python -m bench.provisions [--items N] [--concurrency C] [--delay S] [--pool-size P]
[--celery-only] [--smoke]   (Redis and PostgreSQL on 127.0.0.1)
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from sqlalchemy import create_engine, func, select, text

from bench.dispatch import POSTGRES, REDIS, fresh_database, message
from bench.harness import add_smoke_flag, say_smoke, until
from corral.scheduler.admin.pools import ProfileCreate, create_profile
from corral.scheduler.batch import accept_batch
from corral.scheduler.publish import enqueue_all
from corral.shared.broker import celery_app
from corral.shared.messages import DispatchRequest
from corral.shared.settings import CoreSettings
from corral.shared.store.db import Database, make_engine
from corral.shared.store.models import AuthMode, Pool, WorkItem
from tests.acceptance.stack import REPO, delete_broker_keys

APPLICATION = "corral-bench-provisions"
TICK = os.sysconf("SC_CLK_TCK")
PAGE = os.sysconf("SC_PAGE_SIZE")


@dataclass
class Result:
    items: int
    seconds: float
    most_in_flight: int
    mean_in_flight: float
    cpu_ms: float  # per provision
    system_cpu_ms: float  # of which in the kernel
    statements: float  # per provision
    transactions: float  # per provision
    peak_connections: int
    pool_size: str
    rss_idle_mb: float
    rss_peak_mb: float

    @property
    def rss_kib_per_in_flight(self) -> float:
        return (self.rss_peak_mb - self.rss_idle_mb) * 1024 / max(self.most_in_flight, 1)

    def lines(self) -> list[str]:
        return [
            f"{self.items} provisions in {self.seconds:.1f} s = {self.items / self.seconds:.0f}/s",
            f"in flight in the process: most {self.most_in_flight}, mean {self.mean_in_flight:.1f}",
            f"worker CPU per provision: {self.cpu_ms:.2f} ms "
            f"(of which system {self.system_cpu_ms:.2f} ms)",
            f"per provision: {self.statements:.1f} SQL statements, "
            f"{self.transactions:.2f} PostgreSQL transactions",
            f"database connections of the process: peak {self.peak_connections} "
            f"(pool size {self.pool_size})",
            f"RSS: idle {self.rss_idle_mb:.1f} MiB, peak {self.rss_peak_mb:.1f} MiB, "
            f"{self.rss_kib_per_in_flight:.0f} KiB per provision in flight",
        ]


def cpu_seconds(pid: int) -> tuple[float, float]:
    """User and system CPU seconds of process ``pid``, all its threads."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[11]) / TICK, int(fields[12]) / TICK  # utime, stime: fields 14, 15


def rss_mb(pid: int) -> float:
    pages = int(Path(f"/proc/{pid}/statm").read_text().split()[1])
    return pages * PAGE / 2**20


def seed(db: Database) -> None:
    create_profile(db, ProfileCreate(name="default", model="m", auth_mode=AuthMode.BYOK))
    with db.session() as session:  # straight in: the registry of this process has no `slow`
        session.add(
            Pool(
                id="pool-slow",
                org_id="bench",
                name="slow",
                provider_id="slow",
                max_concurrent=1_000_000,
                sandbox_config={},
            )
        )


def route_items(db: Database, items: int) -> list[Any]:
    """``items`` routed items, written and routed as the scheduler's intake does."""
    outcomes = []
    for start in range(0, items, 100):
        requests = [
            DispatchRequest.model_validate(message("bench", number))
            for number in range(start, min(items, start + 100))
        ]
        taken = accept_batch(db, requests, actor="bench", settings=CoreSettings())
        outcomes += [one.outcome for one in taken]
    assert all(outcome.queue == "provision.slow" for outcome in outcomes), outcomes[:1]
    return outcomes


class Sampler(threading.Thread):
    """The process's connections and RSS, every 20 ms, until stopped."""

    def __init__(self, pid: int) -> None:
        super().__init__(daemon=True)
        self.pid = pid
        self.peak_connections = 0
        self.peak_rss = 0.0
        self.stop = threading.Event()
        self.engine = create_engine(POSTGRES, pool_size=1)

    def run(self) -> None:
        query = text("SELECT count(*) FROM pg_stat_activity WHERE application_name = :name")
        with self.engine.connect() as connection:
            while not self.stop.is_set():
                count = connection.execute(query, {"name": APPLICATION}).scalar_one()
                connection.rollback()
                self.peak_connections = max(self.peak_connections, count)
                self.peak_rss = max(self.peak_rss, rss_mb(self.pid))
                self.stop.wait(0.02)
        self.engine.dispose()


def transactions(database: str) -> int:
    admin = create_engine(POSTGRES)
    try:
        with admin.connect() as connection:
            return int(
                connection.execute(
                    text(
                        "SELECT xact_commit + xact_rollback FROM pg_stat_database "
                        "WHERE datname = :name"
                    ),
                    {"name": database},
                ).scalar_one()
            )
    finally:
        admin.dispose()


def _wait(done: Callable[[], bool], what: str, timeout_s: float, worker: Any) -> None:
    """Until ``done()``, while the worker lives."""

    def alive() -> None:
        if worker.poll() is not None:
            raise RuntimeError(f"the worker exited with {worker.returncode} before {what}")

    until(done, what, timeout_s, check=alive)


def run(
    items: int, *, concurrency: int, delay_s: float, pool_size: int | None, celery_only: bool
) -> Result:
    state = Path(tempfile.mkdtemp(prefix="corral-bench-"))
    stats_path = state / "stats.json"
    prefix = f"corral-bench-{uuid.uuid4().hex[:10]}:"
    with fresh_database() as url:
        db = Database(make_engine(url))
        seed(db)
        env = {
            **os.environ,
            "PYTHONPATH": str(REPO),
            "CORRAL_STATE_DIR": str(state),
            "CORRAL_DATABASE_URL": f"{url}?application_name={APPLICATION}",
            "CORRAL_BROKER_URL": REDIS,
            "CORRAL_BROKER_KEY_PREFIX": prefix,
            "CORRAL_PROVIDER_CONFIG": json.dumps(
                {"slow": {"delay_s": delay_s, "stats_path": str(stats_path)}}
            ),
            **({"CORRAL_DB_POOL_SIZE": str(pool_size)} if pool_size else {}),
            **({"BENCH_CELERY_ONLY": "1"} if celery_only else {}),
        }
        log_path = state / "worker.log"
        with log_path.open("wb") as log:
            worker = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "bench.slow_provider",
                    "worker",
                    "--provider",
                    "slow",
                    "--concurrency",
                    str(concurrency),
                ],
                env=env,
                cwd=state,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        try:
            _wait(lambda: b"ready." in log_path.read_bytes(), "the worker to be ready", 60, worker)
            result = _measure(db, url, items, worker, stats_path, prefix, celery_only)
            return replace(result, pool_size=str(pool_size or "default"))
        except Exception:
            print(log_path.read_text(errors="replace")[-4000:], file=sys.stderr)
            raise
        finally:
            os.killpg(worker.pid, signal.SIGTERM)
            worker.wait(timeout=60)
            db.dispose()
            delete_broker_keys(REDIS, prefix)
            shutil.rmtree(state, ignore_errors=True)


def _await_provisions(
    db: Database,
    worker: Any,
    stats_path: Path,
    *,
    items: int,
    finished_before: int,
    celery_only: bool,
) -> int:
    """Wait until the worker has finished ``items`` more provisions and (unless
    ``celery_only``) no item is left routed or provisioning; return how many times the
    latter was polled (each poll is a transaction of this process's own)."""

    def finished() -> bool:
        return int(json.loads(stats_path.read_text())["finished"]) - finished_before >= items

    _wait(finished, f"the worker to finish {items} provisions", 600, worker)
    polls = 0  # this process's own transactions on the database, taken off the count

    def recorded() -> bool:
        nonlocal polls
        polls += 1
        with db.session() as session:
            return not session.scalar(
                select(func.count()).where(WorkItem.state.in_(("routed", "provisioning")))
            )

    if not celery_only:
        _wait(recorded, f"the {items} provisions' handles to be recorded", 60, worker)
    return polls


def _measure(  # noqa: PLR0917 - one run's parts
    db: Database,
    url: str,
    items: int,
    worker: Any,
    stats_path: Path,
    prefix: str,
    celery_only: bool,
) -> Result:
    outcomes = route_items(db, items)
    celery_app.configure(CoreSettings(broker_url=REDIS, broker_key_prefix=prefix))
    name = url.rsplit("/", 1)[1]
    time.sleep(0.6)  # pg_stat_database is flushed about every 500 ms
    sampler = Sampler(worker.pid)
    sampler.start()
    time.sleep(0.2)
    idle_rss, before_xact = rss_mb(worker.pid), transactions(name)
    before_cpu = cpu_seconds(worker.pid)
    before = json.loads(stats_path.read_text())
    started = time.perf_counter()
    enqueue_all(outcomes)
    polls = _await_provisions(
        db,
        worker,
        stats_path,
        items=items,
        finished_before=before["finished"],
        celery_only=celery_only,
    )
    seconds = time.perf_counter() - started
    user, system = (
        after - before for after, before in zip(cpu_seconds(worker.pid), before_cpu, strict=True)
    )
    sampler.stop.set()
    sampler.join()
    time.sleep(0.6)
    after_xact = transactions(name) - polls  # less this process's own
    stats = json.loads(stats_path.read_text())
    return Result(
        items=items,
        seconds=seconds,
        most_in_flight=stats["most"],
        mean_in_flight=stats["area"] / max(stats["busy_s"], 1e-9),
        cpu_ms=1000 * (user + system) / items,
        system_cpu_ms=1000 * system / items,
        statements=(stats["statements"] - before["statements"]) / items,
        transactions=(after_xact - before_xact) / items,
        peak_connections=sampler.peak_connections,
        pool_size="",
        rss_idle_mb=idle_rss,
        rss_peak_mb=sampler.peak_rss,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--items", type=int, default=2000)
    parser.add_argument("--concurrency", type=int, default=256)
    parser.add_argument("--delay", type=float, default=0.5, help="seconds per provision()")
    parser.add_argument("--pool-size", type=int, default=None, help="CORRAL_DB_POOL_SIZE")
    parser.add_argument("--celery-only", action="store_true", help="the anchor: no corral work")
    add_smoke_flag(parser)
    args = parser.parse_args()
    if args.smoke:
        args.items, args.concurrency, args.delay = 20, 8, 0.05
    say_smoke(args.smoke)
    print("load average at the start: {:.2f} {:.2f} {:.2f}".format(*os.getloadavg()))
    result = run(
        args.items,
        concurrency=args.concurrency,
        delay_s=args.delay,
        pool_size=args.pool_size,
        celery_only=args.celery_only,
    )
    print("\n".join(result.lines()))


if __name__ == "__main__":
    main()
