"""The webhook events besides item.final, each written where its change is recorded, once,
and delivered signed to a real loopback receiver: item.dispatch_error (a dispatch error
alone), sandbox.ended (with the cost event: its reason, duration and cost) and
budget.threshold (with the crossing's record: no work item)."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest
from sqlalchemy import select

from corral.shared.store.budgets import Period, period_start
from corral.shared.store.db import Database, utcnow
from corral.shared.store.ledger import record_costs
from corral.shared.store.lifecycle import warn_budget
from corral.shared.store.models import (
    Budget,
    ItemState,
    OutcomeOutbox,
    Pool,
    Sandbox,
    WorkItem,
)
from corral.worker.outcome_delivery import deliver_due
from corral.worker.outcome_sinks.webhook import WebhookSink
from tests.integration.test_webhook_delivery import ended_item, make_endpoint, webhook_settings
from tests.webhook_receivers import Receiver


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    found = Receiver()
    yield found
    found.stop()


def _deliver(db: Database, receiver: Receiver) -> list[int]:
    settings = webhook_settings(f"127.0.0.1:{receiver.port}")
    return deliver_due(db, {"webhook": WebhookSink(db, settings)}, settings).delivered


def _outbox(db: Database) -> list[OutcomeOutbox]:
    with db.session() as session:
        return list(session.scalars(select(OutcomeOutbox).order_by(OutcomeOutbox.id)))


def test_a_dispatch_error_alone_is_sent_to_an_endpoint_that_wants_only_those(
    sqlite_db: Database, receiver: Receiver
) -> None:
    secret = make_endpoint(sqlite_db, "acme", receiver.url, ("item.dispatch_error",))
    ended_item(sqlite_db, "acme", ItemState.FAILED)
    refused = ended_item(sqlite_db, "acme", ItemState.DISPATCH_ERROR)
    assert len(_deliver(sqlite_db, receiver)) == 1
    [event] = receiver.verified(secret)
    assert event["type"] == "item.dispatch_error"
    assert (event["data"]["id"], event["data"]["state"]) == (refused, "dispatch_error")


def _billable(db: Database, org: str, *, seconds: float) -> str:
    """A sandbox of a new item of ``org`` that ended ``seconds`` after it started, its cost
    owed, in a wall-clock pool at 1,000 micro-units a second: its id."""
    item_id, sandbox_id = f"wi-{uuid.uuid4().hex[:10]}", f"sb-{uuid.uuid4().hex[:10]}"
    ended = utcnow()
    with db.session() as session:
        pool = Pool(
            id=f"pool-{org}",
            org_id=org,
            name=org,
            provider_id="local",
            max_concurrent=9,
            billing_model="wall-clock",
            rate_micros=1000,
        )
        session.add(pool)
        session.add(WorkItem(id=item_id, org_id=org, project_id="web", payload={}, state="failed"))
        session.flush()
        session.add(
            Sandbox(
                id=sandbox_id,
                work_item_id=item_id,
                attempt=1,
                org_id=org,
                pool_id=pool.id,
                provider_id="local",
                status="terminated",
                started_at=ended - timedelta(seconds=seconds),
                terminated_at=ended,
                termination_reason="heartbeat_lost",
                cost_due_at=ended,
            )
        )
    return sandbox_id


def test_each_sandbox_end_is_sent_once_with_its_reason_duration_and_cost(
    sqlite_db: Database, receiver: Receiver
) -> None:
    secret = make_endpoint(sqlite_db, "acme", receiver.url, ("sandbox.ended",))
    sandbox_id = _billable(sqlite_db, "acme", seconds=12.5)
    [billed] = record_costs(sqlite_db, [sandbox_id])
    assert record_costs(sqlite_db, [sandbox_id]) == []  # billed once: owed once
    [row] = _outbox(sqlite_db)
    assert (row.org_id, row.work_item_id) == ("acme", billed.work_item_id)

    assert len(_deliver(sqlite_db, receiver)) == 1
    [event] = receiver.verified(secret)
    assert event["type"] == "sandbox.ended"
    data = event["data"]
    assert (data["sandbox_id"], data["work_item_id"], data["attempt"]) == (
        sandbox_id,
        billed.work_item_id,
        1,
    )
    assert (data["reason"], data["duration_s"]) == ("heartbeat_lost", 12.5)
    assert data["cost"] == {
        "amount_micros": 12_500,
        "amount": "0.012500",
        "billing_model": "wall-clock",
        "rate_micros": 1000,
        "cpu_seconds": None,
        "cpu_estimated": False,
    }
    assert event["created_at"] == data["ended_at"]


def test_an_org_without_a_subscribed_endpoint_owes_no_sandbox_event(
    sqlite_db: Database, receiver: Receiver
) -> None:
    make_endpoint(sqlite_db, "acme", receiver.url)  # item.final only
    [billed] = record_costs(sqlite_db, [_billable(sqlite_db, "acme", seconds=1)])
    assert billed.amount_micros == 1000 and _outbox(sqlite_db) == []


def _budget(db: Database, org: str) -> Budget:
    with db.session() as session:
        budget = Budget(
            id=f"budget-{uuid.uuid4().hex[:8]}",
            org_id=org,
            period="month",
            cap_micros=2_000_000,
            thresholds=[50, 80, 100],
        )
        session.add(budget)
    return budget


def _warn(db: Database, budget: Budget, reached: list[int], spent: int) -> bool:
    since = period_start(Period.MONTH, utcnow())
    with db.session() as session:
        return warn_budget(
            session,
            budget,
            since=since,
            reached=reached,
            spent_micros=spent,
            actor="test",
            detail="spent",
        )


def test_each_budget_threshold_crossed_is_sent_once_without_a_work_item(
    own_db: Database, receiver: Receiver
) -> None:
    db = own_db
    org = f"budget-{uuid.uuid4().hex[:8]}"
    secret = make_endpoint(db, org, receiver.url, ("budget.threshold",))
    budget = _budget(db, org)
    assert _warn(db, budget, [50, 80], 1_700_000)
    assert not _warn(db, budget, [50, 80], 1_700_000)  # a stale read: recorded already
    rows = _outbox(db)
    assert [(row.org_id, row.work_item_id) for row in rows] == [(org, None), (org, None)]

    assert len(_deliver(db, receiver)) == 2
    events = receiver.verified(secret)
    assert {e["type"] for e in events} == {"budget.threshold"}
    crossed: list[dict[str, Any]] = sorted(
        (e["data"] for e in events), key=lambda d: int(d["threshold_pct"])
    )
    assert [d["threshold_pct"] for d in crossed] == [50, 80]
    assert crossed[0] | {"threshold_pct": 0} == crossed[1] | {"threshold_pct": 0}
    assert {key: crossed[1][key] for key in ("budget_id", "org", "pool_id", "period")} == {
        "budget_id": budget.id,
        "org": org,
        "pool_id": None,
        "period": "month",
    }
    assert (crossed[1]["cap"], crossed[1]["spent"]) == ("2.000000", "1.700000")
