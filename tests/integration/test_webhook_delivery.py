"""Signed webhooks over a real loopback HTTP server: one signed event per final item (a
dispatch error included), redelivered after a 500 with the same event id, and a loopback
target refused (and the refusal kept on the outbox row) unless the deployment opened it."""

from __future__ import annotations

import hashlib
import hmac
import json
import threading
import uuid
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest
from sqlalchemy import select

from corral.providers.credentials import CredentialCipher
from corral.scheduler.intake import record_invalid
from corral.shared.settings import CoreSettings
from corral.shared.store import webhooks
from corral.shared.store.db import Database
from corral.shared.store.lifecycle import transition
from corral.shared.store.models import ItemState, OutcomeOutbox, Pool, WorkItem
from corral.worker.outcome_delivery import deliver_due
from corral.worker.outcome_sinks.webhook import WebhookSink
from tests.conftest import TEST_SECRET_KEY


class Receiver:
    """A loopback HTTP server that answers the statuses it is given (then 200), recording
    each request's headers and body."""

    def __init__(self) -> None:
        self.statuses: list[int] = []
        self.received: list[tuple[dict[str, str], bytes]] = []
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["Content-Length"]))
                receiver.received.append((dict(self.headers), body))
                status = receiver.statuses.pop(0) if receiver.statuses else 200
                self.send_response(status)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        self.url = f"http://127.0.0.1:{self.port}/hooks"

    def verified(self, secret: str) -> list[dict[str, Any]]:
        """The events received, each checked as docs/webhooks.md tells a receiver to."""
        events = []
        for headers, body in self.received:
            signed = headers["Corral-Webhook-Timestamp"].encode() + b"." + body
            digest = hmac.new(secret.encode(), signed, hashlib.sha256).hexdigest()
            assert hmac.compare_digest(headers["Corral-Webhook-Signature"], f"v1={digest}")
            event = json.loads(body)
            assert event["id"] == headers["Corral-Webhook-Id"]
            events.append(event)
        return events


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    found = Receiver()
    thread = threading.Thread(target=found.server.serve_forever, daemon=True)
    thread.start()
    yield found
    found.server.shutdown()
    found.server.server_close()
    thread.join(5)


def _endpoint(db: Database, org: str, url: str) -> str:
    with db.session() as session:
        _, secret = webhooks.create_endpoint(
            session, CredentialCipher(TEST_SECRET_KEY), org, url, ["item.final"], allow_http=True
        )
    return secret


def _ended(db: Database, org: str, state: ItemState) -> str:
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


def _settings(opened: str) -> CoreSettings:
    return CoreSettings(
        secret_key=TEST_SECRET_KEY, webhook_open_networks=opened, outcome_max_attempts=5
    )


def test_each_final_item_sends_one_signed_event(sqlite_db: Database, receiver: Receiver) -> None:
    secret = _endpoint(sqlite_db, "acme", receiver.url)
    settings = _settings(f"127.0.0.1:{receiver.port}")
    ended = {_ended(sqlite_db, "acme", state) for state in (ItemState.SUCCEEDED, ItemState.FAILED)}
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
    secret = _endpoint(sqlite_db, "acme", receiver.url)
    settings = _settings("127.0.0.1")
    _ended(sqlite_db, "acme", ItemState.SUCCEEDED)
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
    _endpoint(sqlite_db, "acme", receiver.url)
    settings = _settings(f"127.0.0.1:{receiver.port + 1}")  # another port: not this one
    _ended(sqlite_db, "acme", ItemState.SUCCEEDED)
    sink = WebhookSink(sqlite_db, settings)
    assert len(deliver_due(sqlite_db, {"webhook": sink}, settings).retried) == 1
    assert receiver.received == []
    with sqlite_db.session() as session:
        row = session.scalars(select(OutcomeOutbox)).one()
    assert str(row.last_error).startswith("WebhookAddressRefusedError: ")
    assert "CORRAL_WEBHOOK_OPEN_NETWORKS" in str(row.last_error)
    assert receiver.url not in str(row.last_error)
