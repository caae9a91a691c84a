"""Signed webhooks over a real loopback HTTP server: one signed event per final item (a
dispatch error included), redelivered after a 500 with the same event id, and a loopback
target refused (and the refusal kept on the outbox row) unless the deployment opened it."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from sqlalchemy import select

from corral.scheduler.intake import record_invalid
from corral.shared.keyring import Keyring
from corral.shared.settings import CoreSettings
from corral.shared.store import webhooks
from corral.shared.store.db import Database
from corral.shared.store.lifecycle import transition
from corral.shared.store.models import ItemState, OutcomeOutbox, Pool, WorkItem
from corral.worker.outcome_delivery import deliver_due
from corral.worker.outcome_sinks.webhook import WebhookSink
from tests.conftest import TEST_SECRET_KEY
from tests.webhook_receivers import Receiver


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    found = Receiver()
    yield found
    found.stop()


def make_endpoint(
    db: Database, org: str, url: str, events: tuple[str, ...] = ("item.final",)
) -> str:
    """A new endpoint of ``org`` sent ``events``: its signing secret."""
    with db.session() as session:
        _, secret = webhooks.create_endpoint(
            session, Keyring(TEST_SECRET_KEY), org, url, events, allow_http=True
        )
    return secret


def ended_item(db: Database, org: str, state: ItemState) -> str:
    """A running item of ``org`` (in a pool of its own) moved to ``state``: its id."""
    item_id = f"wi-{uuid.uuid4().hex[:10]}"
    with db.session() as session:
        if session.get(Pool, f"pool-{org}") is None:
            session.add(
                Pool(id=f"pool-{org}", org_id=org, name=org, provider_id="local", max_concurrent=9)
            )
            session.flush()
        item = WorkItem(
            id=item_id,
            org_id=org,
            project_id="p",
            payload={},
            state="running",
            pool_id=f"pool-{org}",
        )
        session.add(item)
        session.flush()
        transition(session, item, state, actor="test")
    return item_id


def webhook_settings(opened: str, **more: Any) -> CoreSettings:
    """The deployment's settings with ``opened`` opened to webhooks (and ``more``)."""
    return CoreSettings(
        secret_key=TEST_SECRET_KEY,
        webhook_open_networks=opened,
        **{"outcome_max_attempts": 5, **more},
    )


def test_each_final_item_sends_one_signed_event(sqlite_db: Database, receiver: Receiver) -> None:
    secret = make_endpoint(sqlite_db, "acme", receiver.url)
    settings = webhook_settings(f"127.0.0.1:{receiver.port}")
    ended = {
        ended_item(sqlite_db, "acme", state) for state in (ItemState.SUCCEEDED, ItemState.FAILED)
    }
    invalid = record_invalid(sqlite_db, {"org": "acme"}, "no work", actor="test")
    sink = WebhookSink(sqlite_db, settings)
    report = deliver_due(sqlite_db, {"webhook": sink}, settings)
    assert len(report.delivered) == 3, report
    events = receiver.verified(secret)
    assert {e["data"]["id"] for e in events} == ended | {invalid}
    assert {e["type"] for e in events} == {"item.final"} and len({e["id"] for e in events}) == 3
    states = sorted(e["data"]["state"] for e in events)
    assert states == ["dispatch_error", "failed", "succeeded"]
    assert deliver_due(sqlite_db, {"webhook": sink}, settings).delivered == []


def test_a_500_is_redelivered_with_the_same_event_id(
    sqlite_db: Database, receiver: Receiver
) -> None:
    secret = make_endpoint(sqlite_db, "acme", receiver.url)
    settings = webhook_settings("127.0.0.1")
    ended_item(sqlite_db, "acme", ItemState.SUCCEEDED)
    receiver.statuses = [500]
    sink = WebhookSink(sqlite_db, settings)
    assert len(deliver_due(sqlite_db, {"webhook": sink}, settings).retried) == 1
    with sqlite_db.session() as session:
        row = session.scalars(select(OutcomeOutbox)).one()
        assert row.attempts == 1 and "answered 500" in str(row.last_error)
        due = row.due_at
    assert len(deliver_due(sqlite_db, {"webhook": sink}, settings, now=due).delivered) == 1
    first, second = receiver.verified(secret)
    assert first == second


def test_a_loopback_target_is_refused_without_the_opening(
    sqlite_db: Database, receiver: Receiver
) -> None:
    make_endpoint(sqlite_db, "acme", receiver.url)
    settings = webhook_settings(f"127.0.0.1:{receiver.port + 1}")  # another port: not this one
    ended_item(sqlite_db, "acme", ItemState.SUCCEEDED)
    sink = WebhookSink(sqlite_db, settings)
    assert len(deliver_due(sqlite_db, {"webhook": sink}, settings).retried) == 1
    assert receiver.received == []
    with sqlite_db.session() as session:
        row = session.scalars(select(OutcomeOutbox)).one()
    assert str(row.last_error).startswith("WebhookAddressRefusedError: ")
    assert "CORRAL_WEBHOOK_OPEN_NETWORKS" in str(row.last_error)
    assert receiver.url not in str(row.last_error)


def test_the_outbox_gauge_follows_the_rows_and_an_idle_run_reads_it_only_now_and_then(
    sqlite_db: Database, receiver: Receiver, monkeypatch: pytest.MonkeyPatch
) -> None:
    from corral.worker import outcome_delivery

    def pending() -> float:
        return outcome_delivery.OUTBOX_ROWS.labels("webhook", "pending")._value.get()

    reads: list[int] = []
    counts = outcome_delivery.outbox.counts

    def counted(db: Database) -> dict[tuple[str, str], int]:
        reads.append(1)
        return counts(db)

    monkeypatch.setattr(outcome_delivery.outbox, "counts", counted)
    monkeypatch.setattr(outcome_delivery, "_last_observed", [float("-inf")])
    make_endpoint(sqlite_db, "gauge", receiver.url)
    receiver.statuses = [500]  # the first try fails: the row stays pending
    ended_item(sqlite_db, "gauge", ItemState.SUCCEEDED)
    settings = webhook_settings("127.0.0.1")
    sink = WebhookSink(sqlite_db, settings)
    now = [100.0]
    report = deliver_due(sqlite_db, {"webhook": sink}, settings, clock=lambda: now[0])
    assert len(report.retried) == 1 and pending() == 1 and len(reads) == 1
    # Nothing due: an idle run does not read the gauge again until OBSERVE_EVERY_S passed.
    assert deliver_due(sqlite_db, {"webhook": sink}, settings, clock=lambda: now[0]).retried == []
    assert len(reads) == 1
    now[0] += outcome_delivery.OBSERVE_EVERY_S
    deliver_due(sqlite_db, {"webhook": sink}, settings, clock=lambda: now[0])
    assert len(reads) == 2 and pending() == 1
