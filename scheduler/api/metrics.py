"""The api's metrics, served on a listener of their own (``CORRAL_API_METRICS_PORT``): its
own counters and histograms, plus gauges read from the database, which see what every
process did.

The database gauges are read at most every ``CACHE_S`` seconds, whatever the scrape rate:

- ``corral_work_items{state}``: items in each non-final state (the pending work; an index on
  state keeps this a count of the pending rows, not of every item ever made);
- ``corral_pool_slots_in_use`` / ``corral_pool_max_concurrent`` and
  ``corral_pool_utilisation`` {pool, pool_name, org, provider}: active pools, slots taken /
  allowed (``pool`` is the id, ``pool_name`` and ``org`` what an operator knows it by);
- ``corral_provision_failures{provider, code}``: sandboxes that failed before they started,
  by the error code recorded on their item;
- ``corral_sandboxes_ended{reason}``: ended sandboxes by termination reason (what the
  reaper and the normal paths ended);
- ``corral_cost_micros{provider, billing_model}`` and ``corral_cost_events{...}``: ledger
  totals;
- ``corral_budget_spend_ratio{org, pool, period, set_by}``: each budget's spend in its period
  over its cap (``org`` empty unless ``CORRAL_METRICS_ORG_LABELS``: then the org budgets of a
  period and owner are one series, the highest ratio; ``pool`` is a pool budget's pool id);
- ``corral_reaper_last_sweep_timestamp_seconds`` and
  ``corral_intake_last_progress_timestamp_seconds``: when the reaper last finished a sweep
  and the intake last finished a round of a loop (0: never), from
  :mod:`corral.shared.store.liveness`;
- ``corral_queue_consumers{queue}``: processes that said in the last minute that they
  consume the queue; ``corral_queue_messages{queue}``: messages waiting on it, asked of the
  broker (``corral_metrics_broker_up`` says whether it answered);
- ``corral_unserved_queue_items{queue}``: items routed to a queue no process said in the
  last minute that it consumes (they fail as ``no_worker`` after their pool's routed TTL);
  a queue without such items has no series.

The ledger's, the ended sandboxes' and the provision failures' gauges aggregate all history,
so their cost grows with it; the cache bounds how often that is paid.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from wsgiref.simple_server import WSGIServer

from prometheus_client import REGISTRY, CollectorRegistry, generate_latest, start_http_server
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.registry import Collector
from sqlalchemy import func, select
from sqlalchemy.orm import Session

from corral.providers.base import SandboxState
from corral.scheduler.admin import overview
from corral.shared import runtime
from corral.shared.broker import celery_app
from corral.shared.broker.depths import queue_depths
from corral.shared.broker.queues import DISPATCH_QUEUE
from corral.shared.store import budgets, liveness
from corral.shared.store.db import Database
from corral.shared.store.models import (
    FINAL_ITEM_STATES,
    SLOT_HOLDING_STATES,
    CostEvent,
    ItemState,
    Pool,
    Sandbox,
    WorkItem,
)

log = logging.getLogger(__name__)

CACHE_S = 15.0


class DatabaseCollector(Collector):
    """Gauges computed from the database of the process's runtime, cached."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._cached: list[Metric] = []
        self._read_at = -CACHE_S
        self._ok = True

    def collect(self) -> Iterator[Metric]:
        # One scrape reads the database at a time; others meanwhile get the last values
        # rather than queueing behind it. A failed read keeps the last values and says so
        # in corral_metrics_database_up, so the api's own metrics are still served.
        if self._lock.acquire(blocking=False):
            try:
                if time.monotonic() - self._read_at >= CACHE_S:
                    self._refresh()
            finally:
                self._lock.release()
        up = GaugeMetricFamily(
            "corral_metrics_database_up", "1 when the last read of the database gauges worked."
        )
        up.add_metric([], 1 if self._ok else 0)
        yield up
        yield from self._cached

    def _refresh(self) -> None:
        try:
            self._cached = self._read()
            self._ok = True
        except Exception:
            log.warning("database gauges not read; serving the last values", exc_info=True)
            self._ok = False
        self._read_at = time.monotonic()

    def expire(self) -> None:
        """Read afresh at the next scrape (tests)."""
        with self._lock:
            self._read_at = -CACHE_S

    def _read(self) -> list[Metric]:
        rt = runtime.current()
        with rt.db.session() as session:
            read = [
                _work_items(session),
                *_pools(session),
                _provision_failures(session),
                _sandboxes_ended(session),
                *_costs(session),
                _budgets(session, org_labels=rt.settings.metrics_org_labels),
                *_liveness(session),
                _unserved(session),
            ]
            queues = overview.queue_names(session)
        return read + queue_gauges(rt.db, queues)


def _work_items(session: Session) -> Metric:
    items = GaugeMetricFamily(
        "corral_work_items", "Work items in each pending state.", labels=["state"]
    )
    pending = [s.value for s in ItemState if s not in FINAL_ITEM_STATES]
    counted = dict(
        session.execute(
            select(WorkItem.state, func.count())
            .where(WorkItem.state.in_(pending))
            .group_by(WorkItem.state)
        ).all()
    )
    for state in pending:
        items.add_metric([state], counted.get(state, 0))
    return items


def _pools(session: Session) -> list[Metric]:
    pools = [
        GaugeMetricFamily(name, text, labels=["pool", "pool_name", "org", "provider"])
        for name, text in (
            ("corral_pool_slots_in_use", "Slots of an active pool held by items."),
            ("corral_pool_max_concurrent", "Slots an active pool allows."),
            ("corral_pool_utilisation", "Slots in use / slots allowed, per active pool."),
            (
                "corral_pool_breaker_open",
                "1 while an active pool's circuit breaker is open or half open, else 0.",
            ),
        )
    ]
    holding = [s.value for s in SLOT_HOLDING_STATES]
    in_use = dict(
        session.execute(
            select(WorkItem.pool_id, func.count())
            .where(WorkItem.state.in_(holding))
            .group_by(WorkItem.pool_id)
        ).all()
    )
    for pool in session.scalars(select(Pool).where(Pool.active.is_(True))):
        used = in_use.get(pool.id, 0)
        labels = [pool.id, pool.name, pool.org_id, pool.provider_id]
        pools[0].add_metric(labels, used)
        pools[1].add_metric(labels, pool.max_concurrent)
        pools[2].add_metric(labels, used / pool.max_concurrent if pool.max_concurrent else 0)
        pools[3].add_metric(labels, 0 if pool.breaker_state == "closed" else 1)
    return list(pools)


def _provision_failures(session: Session) -> Metric:
    failures = GaugeMetricFamily(
        "corral_provision_failures",
        "Sandboxes that failed before they started.",
        labels=["provider", "code"],
    )
    for provider, code, count in session.execute(
        select(Sandbox.provider_id, WorkItem.error_code, func.count())
        .join(WorkItem, WorkItem.id == Sandbox.work_item_id)
        .where(Sandbox.status == SandboxState.FAILED.value, Sandbox.started_at.is_(None))
        .group_by(Sandbox.provider_id, WorkItem.error_code)
    ):
        failures.add_metric([provider, code or "unknown"], count)
    return failures


def _sandboxes_ended(session: Session) -> Metric:
    ended = GaugeMetricFamily(
        "corral_sandboxes_ended", "Ended sandboxes by reason.", labels=["reason"]
    )
    for reason, count in session.execute(
        select(Sandbox.termination_reason, func.count())
        .where(Sandbox.terminated_at.is_not(None))
        .group_by(Sandbox.termination_reason)
    ):
        ended.add_metric([reason or "unknown"], count)
    return ended


def _costs(session: Session) -> list[Metric]:
    costs = [
        GaugeMetricFamily(name, text, labels=["provider", "billing_model"])
        for name, text in (
            ("corral_cost_micros", "Ledger total, micro-units."),
            ("corral_cost_events", "Cost events written."),
        )
    ]
    for provider, model, micros, events in session.execute(
        select(
            CostEvent.provider_id,
            CostEvent.billing_model,
            func.sum(CostEvent.amount_micros),
            func.count(),
        ).group_by(CostEvent.provider_id, CostEvent.billing_model)
    ):
        costs[0].add_metric([provider, model], int(micros or 0))
        costs[1].add_metric([provider, model], events)
    return list(costs)


def _budgets(session: Session, *, org_labels: bool) -> Metric:
    ratio = GaugeMetricFamily(
        "corral_budget_spend_ratio",
        "A budget's spend in its period over its cap (1: spent).",
        labels=["org", "pool", "period", "set_by"],
    )
    series: dict[tuple[str, str, str, str], float] = {}
    for state in budgets.every_state(session):
        budget = state.budget
        org = budget.org_id if org_labels else ""
        key = (org, budget.pool_id or "", budget.period, budget.set_by)
        series[key] = max(series.get(key, 0.0), state.ratio)
    for labels, value in sorted(series.items()):
        ratio.add_metric(list(labels), value)
    return ratio


def _liveness(session: Session) -> list[Metric]:
    sweep = GaugeMetricFamily(
        "corral_reaper_last_sweep_timestamp_seconds",
        "When the reaper last finished a sweep (Unix time; 0: never).",
    )
    done = liveness.phase_time(session, liveness.SWEEP_DONE)
    sweep.add_metric([], done.timestamp() if done else 0)
    intake = GaugeMetricFamily(
        "corral_intake_last_progress_timestamp_seconds",
        "When a loop of the scheduler's intake last finished a round (Unix time; 0: never).",
    )
    progress = liveness.last_seen(session, DISPATCH_QUEUE)
    intake.add_metric([], progress.timestamp() if progress else 0)
    return [sweep, intake]


def _unserved(session: Session) -> Metric:
    unserved = GaugeMetricFamily(
        "corral_unserved_queue_items",
        "Items routed to a queue no process said in the last minute that it consumes.",
        labels=["queue"],
    )
    for one in liveness.unserved(session):
        unserved.add_metric([one.queue], one.items)
    return unserved


def queue_gauges(db: Database, queues: list[str]) -> list[Metric]:
    """Each queue's fresh consumers (from the database) and waiting messages (from the
    broker; left out, with ``corral_metrics_broker_up`` 0, when it does not answer)."""
    consumers = GaugeMetricFamily(
        "corral_queue_consumers",
        "Processes that said in the last minute that they consume the queue.",
        labels=["queue"],
    )
    with db.session() as session:
        counted = liveness.consumer_counts(session)
    for queue in queues:
        consumers.add_metric([queue], counted.get(queue, 0))
    messages = GaugeMetricFamily(
        "corral_queue_messages", "Messages waiting on the queue.", labels=["queue"]
    )
    up = GaugeMetricFamily(
        "corral_metrics_broker_up", "1 when the broker answered the last read of the queues."
    )
    try:
        depths = queue_depths(celery_app.app, queues)
    except Exception:  # the database's gauges are still worth serving
        log.warning("queue depths not read from the broker", exc_info=True)
        depths = None
    for queue, count in (depths or {}).items():
        messages.add_metric([queue], count)
    up.add_metric([], 0 if depths is None else 1)
    return [consumers, messages, up]


# A registry of its own, so that reading this process's counters elsewhere (tests, a
# worker's port) never queries the database.
COLLECTOR = DatabaseCollector()
DATABASE_REGISTRY = CollectorRegistry(auto_describe=False)
DATABASE_REGISTRY.register(COLLECTOR)


class _ApiExposition(Collector):
    """What the api's metrics listener serves: the api's own metrics (this process's, or
    its children's summed from ``multiprocess_dir``), then the database gauges."""

    def __init__(self, multiprocess_dir: Path | None = None) -> None:
        self._own: CollectorRegistry = REGISTRY
        if multiprocess_dir is not None:
            self._own = CollectorRegistry(auto_describe=False)
            # untyped in prometheus_client
            MultiProcessCollector(self._own, path=str(multiprocess_dir))  # type: ignore[no-untyped-call]

    def collect(self) -> Iterator[Metric]:
        yield from self._own.collect()
        yield from DATABASE_REGISTRY.collect()


def exposition_registry(multiprocess_dir: Path | None = None) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_ApiExposition(multiprocess_dir))
    return registry


EXPOSITION = exposition_registry()


def exposition() -> bytes:
    """The Prometheus text the listener serves."""
    return generate_latest(EXPOSITION)


def start_metrics_server(
    host: str, port: int, *, multiprocess_dir: Path | None = None
) -> WSGIServer:
    """Serve the api's metrics on ``host:port`` (0: a free port) from a daemon thread; with
    ``multiprocess_dir``, those the api's child processes write there, summed.

    A listener of its own, never the api's port or Unix socket: sandboxes reach those, and
    they have no business reading the deployment's metrics. Stop it with ``shutdown()``.
    """
    registry = EXPOSITION if multiprocess_dir is None else exposition_registry(multiprocess_dir)
    server, _ = start_http_server(port, addr=host, registry=registry)
    return server
