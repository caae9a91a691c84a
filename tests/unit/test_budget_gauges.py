"""On SQLite (``corral dev``): a budget's thresholds are warned of once per period through
the guarded update, and the api's collector exports what the alert rules read: each budget's
spend ratio (its org label only with ``CORRAL_METRICS_ORG_LABELS``), the reaper's last sweep,
the intake's last progress, and each queue's consumers and waiting messages."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import timedelta

import pytest
from prometheus_client.core import Metric
from sqlalchemy.orm import Session

from corral.scheduler.api.metrics import DatabaseCollector
from corral.shared import runtime
from corral.shared.broker import celery_app
from corral.shared.settings import CoreSettings
from corral.shared.store import liveness
from corral.shared.store.budgets import every_state
from corral.shared.store.db import Database, utcnow
from corral.shared.store.lifecycle import warn_budget
from corral.shared.store.models import Budget, LifecycleEvent, Pool, QueueConsumer


def _budgets(db: Database) -> None:
    with db.session() as session:
        session.add(
            Pool(id="pool-a", org_id="acme", name="a", provider_id="local", max_concurrent=2)
        )
        session.add(
            Pool(id="pool-b", org_id="beta", name="b", provider_id="local", max_concurrent=2)
        )
        session.flush()
        for budget_id, org, pool, cap in (
            ("budget-1", "acme", None, 100),  # nothing spent: 0
            ("budget-2", "beta", None, 0),  # a cap of 0 is spent from the start: 1
            ("budget-3", "acme", "pool-a", 50),
        ):
            session.add(
                Budget(id=budget_id, org_id=org, pool_id=pool, period="month", cap_micros=cap)
            )


def collected(db: Database, **settings: object) -> dict[str, Metric]:
    celery_app.configure(CoreSettings(broker_url="memory://"))
    runtime.install(runtime.Runtime(settings=CoreSettings(**settings), db=db))  # type: ignore[arg-type]
    try:
        return {metric.name: metric for metric in DatabaseCollector().collect()}
    finally:
        runtime.reset()


def samples(metric: Metric) -> dict[tuple[str, ...], float]:
    return {tuple(s.labels.values()): s.value for s in metric.samples}


@pytest.fixture
def budgeted(sqlite_db: Database) -> Iterator[Database]:
    _budgets(sqlite_db)
    yield sqlite_db


def test_the_spend_ratio_is_per_budget_with_org_labels_and_the_highest_without(
    budgeted: Database,
) -> None:
    with_orgs = samples(collected(budgeted, metrics_org_labels=True)["corral_budget_spend_ratio"])
    assert with_orgs == {
        ("acme", "", "month", "deployment"): 0.0,
        ("beta", "", "month", "deployment"): 1.0,
        ("acme", "pool-a", "month", "deployment"): 0.0,
    }
    without = samples(collected(budgeted)["corral_budget_spend_ratio"])
    assert without == {  # the org budgets of a period and owner: one series, the highest
        ("", "", "month", "deployment"): 1.0,
        ("", "pool-a", "month", "deployment"): 0.0,
    }


def test_a_threshold_is_warned_of_once_and_a_stale_read_writes_nothing(budgeted: Database) -> None:
    with budgeted.session() as session:
        state = next(s for s in every_state(session) if s.budget.id == "budget-2")
    assert state.unwarned() == [50, 80, 100]  # a cap of 0: every threshold at once

    def warned(session: Session, actor: str) -> bool:
        return warn_budget(
            session,
            state.budget,
            since=state.since,
            reached=[50, 80, 100],
            spent_micros=state.spend.total,
            actor=actor,
            detail="x",
        )

    with budgeted.session() as session:
        assert warned(session, "a")
    with budgeted.session() as session:  # the same read, by a second reaper: nothing
        assert not warned(session, "b")
        rows = session.query(LifecycleEvent.from_state, LifecycleEvent.to_state).all()
        fresh = next(s for s in every_state(session) if s.budget.id == "budget-2")
    assert [tuple(r) for r in rows] == [(None, "50%"), ("50%", "80%"), ("80%", "100%")]
    assert fresh.unwarned() == [] and fresh.budget.warned_pct == 100


def test_the_reaper_intake_and_queues_are_seen_from_the_database(sqlite_db: Database) -> None:
    metrics = collected(sqlite_db)
    assert samples(metrics["corral_reaper_last_sweep_timestamp_seconds"]) == {(): 0}  # never
    assert samples(metrics["corral_intake_last_progress_timestamp_seconds"]) == {(): 0}
    swept = utcnow() - timedelta(seconds=30)
    liveness.record_phase(sqlite_db, liveness.SWEEP_DONE, swept)
    liveness.record_phase(sqlite_db, liveness.SWEEP_DONE, swept + timedelta(seconds=1))
    intake = liveness.ConsumerBeat(sqlite_db, ["dispatch"], "scheduler@h:1", on_progress=True)
    intake.beat()  # no round finished yet: nothing said
    intake.progressed()
    intake.beat()
    liveness.ConsumerBeat(sqlite_db, ["provision.local"], "worker@h:2").beat()
    with sqlite_db.session() as session:  # a consumer that stopped saying so two minutes ago
        session.add(
            QueueConsumer(
                queue="maintenance", consumer_id="gone", seen_at=utcnow() - timedelta(minutes=2)
            )
        )

    metrics = collected(sqlite_db)
    assert samples(metrics["corral_reaper_last_sweep_timestamp_seconds"]) == {
        (): (swept + timedelta(seconds=1)).timestamp()
    }
    (progress,) = samples(metrics["corral_intake_last_progress_timestamp_seconds"]).values()
    assert abs(progress - utcnow().timestamp()) < 10
    consumers = samples(metrics["corral_queue_consumers"])
    assert consumers[("dispatch",)] == 1 and consumers[("provision.local",)] == 1
    assert consumers[("maintenance",)] == 0
    # The in-memory broker is the process's: other tests may have left messages on it.
    with celery_app.app.connection_for_write() as connection:
        connection.default_channel.queue_purge("dispatch")
        connection.default_channel.basic_publish(
            connection.default_channel.prepare_message("{}"), exchange="", routing_key="dispatch"
        )
    metrics = collected(sqlite_db)
    assert samples(metrics["corral_queue_messages"])[("dispatch",)] == 1
    assert samples(metrics["corral_metrics_broker_up"]) == {(): 1}
