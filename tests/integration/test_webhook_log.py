"""The webhook delivery log and redelivery by hand, over a real loopback receiver: every try
is logged (its status, or the error that stood for one), the log reads newest first by
endpoint and is pruned by age; an event given up, or delivered, is redelivered with its own
id; an unknown event, another org's, or one whose endpoint was removed is not."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import timedelta

import pytest
from sqlalchemy import select

from corral.shared.settings import CoreSettings
from corral.shared.store import webhook_log, webhooks
from corral.shared.store.db import Database, utcnow
from corral.shared.store.models import ItemState, OutcomeOutbox, WebhookEndpoint
from corral.worker.outcome_delivery import DeliveryReport, deliver_due
from corral.worker.outcome_sinks.webhook import WebhookSink
from tests.integration.test_webhook_delivery import ended_item, make_endpoint, webhook_settings
from tests.webhook_receivers import Receiver


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    found = Receiver()
    yield found
    found.stop()


def _run(db: Database, settings: CoreSettings, *, later_s: float = 0) -> DeliveryReport:
    """One delivery run, ``later_s`` from now (past the back-off of what was retried)."""
    sinks = {"webhook": WebhookSink(db, settings)}
    return deliver_due(db, sinks, settings, now=utcnow() + timedelta(seconds=later_s))


def _endpoint_id(db: Database, org: str) -> str:
    with db.session() as session:
        return session.scalars(
            select(WebhookEndpoint.id).where(WebhookEndpoint.org_id == org)
        ).one()


def _log(db: Database, org: str, **paging: int) -> list[dict[str, object]]:
    with db.session() as session:
        return webhook_log.deliveries(
            session,
            org,
            _endpoint_id(db, org),
            limit=paging.get("limit", 50),
            **{k: v for k, v in paging.items() if k == "before"},
        )


def _redeliver(db: Database, org: str, event_id: str) -> dict[str, object]:
    with db.session() as session:
        return webhook_log.redeliver(session, org, event_id, now=utcnow())


def test_every_try_is_logged_with_its_status_or_error(
    sqlite_db: Database, receiver: Receiver
) -> None:
    make_endpoint(sqlite_db, "acme", receiver.url)
    item_id = ended_item(sqlite_db, "acme", ItemState.SUCCEEDED)
    receiver.statuses = [503]
    settings = webhook_settings(f"127.0.0.1:{receiver.port}")
    assert len(_run(sqlite_db, settings).retried) == 1
    closed = webhook_settings(f"127.0.0.1:{receiver.port + 1}")  # this port closed: refused
    assert len(_run(sqlite_db, closed, later_s=3).retried) == 1
    assert len(_run(sqlite_db, settings, later_s=60).delivered) == 1

    newest, refused, first = _log(sqlite_db, "acme")
    assert [(t["attempt"], t["status"]) for t in (first, refused, newest)] == [
        (1, 503),
        (2, None),
        (3, 200),
    ]
    assert str(refused["error"]).startswith("WebhookAddressRefusedError: ")
    assert first["error"] is None and newest["error"] is None
    assert {t["event_type"] for t in (first, refused, newest)} == {"item.final"}
    assert {t["work_item_id"] for t in (first, refused, newest)} == {item_id}
    assert len({t["event_id"] for t in (first, refused, newest)}) == 1
    assert [t["owed"] for t in (first, refused, newest)] == [None, None, None]  # delivered
    assert _log(sqlite_db, "acme", before=int(str(newest["id"])), limit=1) == [refused]


def test_a_given_up_event_is_redelivered_with_its_own_id(
    own_db: Database, receiver: Receiver
) -> None:
    secret = make_endpoint(own_db, "acme", receiver.url)
    ended_item(own_db, "acme", ItemState.FAILED)
    receiver.statuses = [500]
    settings = webhook_settings(f"127.0.0.1:{receiver.port}", outcome_max_attempts=1)
    assert len(_run(own_db, settings).given_up) == 1
    [tried] = _log(own_db, "acme")
    assert tried["owed"] == "given_up"
    assert _run(own_db, settings, later_s=3600).delivered == []  # given up: never tried

    done = _redeliver(own_db, "acme", str(tried["event_id"]))
    assert (done["event_id"], done["event_type"]) == (tried["event_id"], "item.final")
    assert len(_run(own_db, settings, later_s=1).delivered) == 1
    first, again = receiver.verified(secret)
    assert first == again and first["id"] == tried["event_id"]
    assert [t["attempt"] for t in _log(own_db, "acme")] == [1, 1]  # its tries counted anew


def test_a_delivered_event_is_sent_again_with_what_it_carried(
    own_db: Database, receiver: Receiver
) -> None:
    secret = make_endpoint(own_db, "acme", receiver.url, ("budget.threshold",))
    with own_db.session() as session:  # an event that carries its data, and has no item
        [endpoint] = webhooks.subscribed(session, ["acme"], "budget.threshold")["acme"]
        target = webhooks.event_target(
            endpoint, "budget.threshold", utcnow().isoformat(), {"threshold_pct": 80}
        )
        session.add(
            OutcomeOutbox(
                work_item_id=None,
                org_id="acme",
                sink="webhook",
                target=target,
                created_at=utcnow(),
                due_at=utcnow(),
            )
        )
    settings = webhook_settings(f"127.0.0.1:{receiver.port}")
    assert len(_run(own_db, settings).delivered) == 1
    _redeliver(own_db, "acme", target["event_id"])
    _redeliver(own_db, "acme", target["event_id"])  # twice before a run: still owed once
    assert len(_run(own_db, settings, later_s=1).delivered) == 1
    first, again = receiver.verified(secret)
    assert first == again and first["data"] == {"threshold_pct": 80}


def test_an_unknown_or_removed_endpoints_event_is_not_redelivered(
    sqlite_db: Database, receiver: Receiver
) -> None:
    make_endpoint(sqlite_db, "acme", receiver.url)
    ended_item(sqlite_db, "acme", ItemState.SUCCEEDED)
    settings = webhook_settings(f"127.0.0.1:{receiver.port}")
    _run(sqlite_db, settings)
    [tried] = _log(sqlite_db, "acme")
    event_id = str(tried["event_id"])
    with pytest.raises(webhook_log.UnknownEventError):
        _redeliver(sqlite_db, "other-org", event_id)
    with pytest.raises(webhook_log.UnknownEventError):
        _redeliver(sqlite_db, "acme", "evt_0123")
    with sqlite_db.session() as session:
        assert webhooks.remove_endpoint(session, "acme", _endpoint_id(sqlite_db, "acme"))
    with pytest.raises(webhook_log.EndpointRemovedError):
        _redeliver(sqlite_db, "acme", event_id)


def test_old_tries_are_pruned_and_a_given_up_event_is_still_found_in_the_outbox(
    own_db: Database, receiver: Receiver
) -> None:
    make_endpoint(own_db, "acme", receiver.url)
    ended_item(own_db, "acme", ItemState.SUCCEEDED)
    receiver.statuses = [500]
    settings = webhook_settings(f"127.0.0.1:{receiver.port}", outcome_max_attempts=1)
    _run(own_db, settings)
    [tried] = _log(own_db, "acme")
    assert webhook_log.prune(own_db, before=utcnow() - timedelta(hours=1)) == 0
    assert webhook_log.prune(own_db, before=utcnow() + timedelta(seconds=1)) == 1
    assert _log(own_db, "acme") == []

    _redeliver(own_db, "acme", str(tried["event_id"]))  # found by its outbox row
    assert len(_run(own_db, settings, later_s=1).delivered) == 1
    assert [(t["event_id"], t["status"]) for t in _log(own_db, "acme")] == [
        (tried["event_id"], 200)
    ]
