"""Signed webhooks without a network: endpoints made (secret sealed, shown once), the events
an item's end owes, the body, headers and signature a delivery carries, and the address
rules a target must pass before anything connects."""

from __future__ import annotations

import hashlib
import hmac
import json
import uuid
from collections.abc import Mapping, Sequence

import pytest
from sqlalchemy import select

from corral.providers.egress.rules import HostRule, parse_host_rules
from corral.shared.keyring import Keyring
from corral.shared.settings import CoreSettings
from corral.shared.store import webhooks
from corral.shared.store.db import Database
from corral.shared.store.lifecycle import transition
from corral.shared.store.models import (
    ItemState,
    OutcomeOutbox,
    Pool,
    WebhookDelivery,
    WebhookEndpoint,
    WorkItem,
)
from corral.worker.outcome_delivery import deliver_due
from corral.worker.outcome_sinks.webhook import WebhookSink, signature
from corral.worker.outcome_sinks.webhook_transport import (
    Answer,
    WebhookAddressRefusedError,
    is_open,
    post,
)
from tests.conftest import TEST_SECRET_KEY

CIPHER = Keyring(TEST_SECRET_KEY)
SETTINGS = CoreSettings(outcome_max_attempts=5)


class RecordingTransport:
    """Answers each POST with the next status given, and records what it was sent."""

    def __init__(self, *statuses: int) -> None:
        self.statuses = list(statuses)
        self.sent: list[tuple[str, dict[str, str], bytes]] = []

    def __call__(
        self, url: str, headers: Mapping[str, str], body: bytes, openings: Sequence[HostRule]
    ) -> Answer:
        self.sent.append((url, dict(headers), body))
        return Answer(self.statuses.pop(0) if self.statuses else 200, b"")


def _endpoint(db: Database, org: str = "acme", url: str = "https://hooks.example.com/in") -> str:
    with db.session() as session:
        document, secret = webhooks.create_endpoint(
            session, CIPHER, org, url, ["item.final"], allow_http=False
        )
    assert document["id"].startswith("wh-")
    return secret


def _ended_item(db: Database, org: str = "acme") -> str:
    item_id = f"wi-{uuid.uuid4().hex[:10]}"
    with db.session() as session:
        if session.get(Pool, "pool-w") is None:
            session.add(
                Pool(id="pool-w", org_id=org, name="w", provider_id="local", max_concurrent=9)
            )
            session.flush()
        item = WorkItem(
            id=item_id, org_id=org, project_id="p", payload={}, state="running", pool_id="pool-w"
        )
        session.add(item)
        session.flush()
        transition(session, item, ItemState.SUCCEEDED, actor="test")
    return item_id


def test_the_secret_is_shown_once_and_stored_sealed(sqlite_db: Database) -> None:
    secret = _endpoint(sqlite_db)
    assert secret.startswith("whsec_") and len(secret) > 40
    with sqlite_db.session() as session:
        row = session.scalars(select(WebhookEndpoint)).one()
        assert secret.encode() not in row.secret_sealed
        assert webhooks.open_secret(CIPHER, row.org_id, row.id, row.secret_sealed) == secret
        listed = webhooks.list_endpoints(session, "acme")
    assert secret not in json.dumps(listed, default=str)
    assert listed[0]["events"] == ["item.final"] and listed[0]["disabled_at"] is None


@pytest.mark.parametrize(
    ("url", "allow_http", "fragment"),
    [
        ("http://hooks.example.com/", False, "https://"),
        ("ftp://hooks.example.com/", True, "http://"),
        ("https://user:pw@hooks.example.com/", False, "user name"),
        ("https:///path", False, "host"),
        ("https://hooks.example.com:99999/", False, "port"),
        ("https://hooks.example.com/#x", False, "fragment"),
    ],
)
def test_a_url_is_refused_without_quoting_it(url: str, allow_http: bool, fragment: str) -> None:
    with pytest.raises(webhooks.WebhookError) as caught:
        webhooks.check_url(url, allow_http=allow_http)
    assert fragment in caught.value.message and url not in caught.value.message


def test_http_is_accepted_where_the_deployment_allows_it() -> None:
    assert webhooks.check_url("http://127.0.0.1:8080/in", allow_http=True)


def test_unknown_events_are_refused() -> None:
    with pytest.raises(webhooks.WebhookError):
        webhooks.check_events(["item.started"])
    with pytest.raises(webhooks.WebhookError):
        webhooks.check_events([])


def test_the_event_types_are_named_once_and_kept_in_their_order() -> None:
    named = (
        webhooks.ITEM_FINAL,
        webhooks.ITEM_DISPATCH_ERROR,
        webhooks.SANDBOX_ENDED,
        webhooks.BUDGET_THRESHOLD,
    )
    assert named == webhooks.EVENTS
    chosen = ["budget.threshold", "item.final", "budget.threshold"]
    assert webhooks.check_events(chosen) == ["item.final", "budget.threshold"]


def test_an_end_owes_one_event_per_live_subscribed_endpoint_of_its_org(
    sqlite_db: Database,
) -> None:
    _endpoint(sqlite_db)
    _endpoint(sqlite_db, url="https://two.example.com/")
    _endpoint(sqlite_db, org="other")
    with sqlite_db.session() as session:
        gone = webhooks.list_endpoints(session, "acme")[1]["id"]
        assert webhooks.remove_endpoint(session, "acme", gone)
        assert not webhooks.remove_endpoint(session, "acme", gone)
    item_id = _ended_item(sqlite_db)
    with sqlite_db.session() as session:
        rows = session.scalars(select(OutcomeOutbox).where(OutcomeOutbox.sink == "webhook")).all()
        [row] = rows
        assert row.work_item_id == item_id and row.target["type"] == "item.final"
        assert row.target["event_id"].startswith("evt_")


def test_a_delivery_is_signed_and_carries_the_final_record(sqlite_db: Database) -> None:
    secret = _endpoint(sqlite_db)
    item_id = _ended_item(sqlite_db)
    transport = RecordingTransport()
    sink = WebhookSink(sqlite_db, SETTINGS, transport=transport, clock=lambda: 1_700_000_000.5)
    assert deliver_due(sqlite_db, {"webhook": sink}, SETTINGS).summary()["delivered"] == 1
    [(url, headers, body)] = transport.sent
    event = json.loads(body)
    assert url == "https://hooks.example.com/in"
    assert event["type"] == "item.final" and event["data"]["id"] == item_id
    assert event["data"]["state"] == "succeeded" and event["id"].startswith("evt_")
    assert headers["Corral-Webhook-Id"] == event["id"]
    assert headers["Corral-Webhook-Timestamp"] == "1700000000"
    expected = hmac.new(secret.encode(), b"1700000000." + body, hashlib.sha256).hexdigest()
    assert headers["Corral-Webhook-Signature"] == f"v1={expected}"
    assert signature(secret, "1700000000", body) == f"v1={expected}"
    assert headers["Content-Type"] == "application/json"


def test_a_non_2xx_answer_is_retried_with_the_same_event_id(sqlite_db: Database) -> None:
    _endpoint(sqlite_db)
    _ended_item(sqlite_db)
    transport = RecordingTransport(500, 302, 204)
    sink = WebhookSink(sqlite_db, SETTINGS, transport=transport)
    report = deliver_due(sqlite_db, {"webhook": sink}, SETTINGS)
    assert len(report.retried) == 1
    with sqlite_db.session() as session:
        row = session.scalars(select(OutcomeOutbox)).one()
        assert row.last_error == "OutcomeDeliveryError: the webhook endpoint answered 500"
        later = row.due_at
    deliver_due(sqlite_db, {"webhook": sink}, SETTINGS, now=later)
    with sqlite_db.session() as session:
        assert "302 (redirects are not followed)" in str(
            session.scalars(select(OutcomeOutbox)).one().last_error
        )
        later = session.scalars(select(OutcomeOutbox)).one().due_at
    assert len(deliver_due(sqlite_db, {"webhook": sink}, SETTINGS, now=later).delivered) == 1
    ids = {headers["Corral-Webhook-Id"] for _, headers, _ in transport.sent}
    assert len(transport.sent) == 3 and len(ids) == 1


def test_an_event_to_a_removed_endpoint_is_dropped(sqlite_db: Database) -> None:
    _endpoint(sqlite_db)
    _ended_item(sqlite_db)
    with sqlite_db.session() as session:
        endpoint_id = webhooks.list_endpoints(session, "acme")[0]["id"]
        webhooks.remove_endpoint(session, "acme", endpoint_id)
    transport = RecordingTransport()
    sink = WebhookSink(sqlite_db, SETTINGS, transport=transport)
    assert len(deliver_due(sqlite_db, {"webhook": sink}, SETTINGS).delivered) == 1
    assert transport.sent == []
    with sqlite_db.session() as session:  # nothing was tried: nothing logged
        assert session.scalars(select(WebhookDelivery)).all() == []


@pytest.mark.parametrize(
    "address",
    ["127.0.0.1", "::1", "10.1.2.3", "192.168.0.1", "169.254.169.254", "100.64.0.1", "0.0.0.0"],
)
def test_closed_addresses_are_refused_unless_opened(address: str) -> None:
    assert not is_open(address, 443, ())
    assert is_open(address, 443, parse_host_rules([address]))
    assert not is_open(
        address, 443, parse_host_rules([f"[{address}]:80" if ":" in address else f"{address}:80"])
    )


def test_a_global_address_is_open() -> None:
    assert is_open("93.184.216.34", 443, ())


def test_a_loopback_target_is_refused_before_anything_connects() -> None:
    with pytest.raises(WebhookAddressRefusedError, match="CORRAL_WEBHOOK_OPEN_NETWORKS"):
        post("http://127.0.0.1:9/in", {}, b"{}", ())
    with pytest.raises(WebhookAddressRefusedError):
        post("https://localhost:9/in", {}, b"{}", parse_host_rules(["127.0.0.1:10"]))
