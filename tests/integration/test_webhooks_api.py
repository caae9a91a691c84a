"""The admin api's webhook routes: an endpoint made (its secret answered once, stored
sealed), listed without secrets, removed; its delivery log read page by page, and an event
redelivered; an org key acts on its own org only."""

from __future__ import annotations

import uuid

from fastapi.testclient import TestClient
from sqlalchemy import select

from corral.shared.store import webhook_log, webhooks
from corral.shared.store.db import Database, utcnow
from corral.shared.store.models import OutcomeOutbox, WebhookEndpoint
from corral.shared.store.outbox import OutboxRow
from tests.conftest import TEST_SECRET_KEY
from tests.integration.api_clients import ClientFactory
from tests.integration.test_api import admin_headers
from tests.integration.test_org_keys import bearer, make_key


def _org() -> str:
    return f"hooks-{uuid.uuid4().hex[:8]}"


def test_an_org_key_makes_lists_and_removes_its_orgs_webhooks(
    make_client: ClientFactory, pg_db: Database
) -> None:
    client = make_client(secret_key=TEST_SECRET_KEY)
    org = _org()
    key = bearer(make_key(client, org, "admin"))
    made = client.post(
        f"/v1/admin/orgs/{org}/webhooks", json={"url": "https://example.com/in"}, headers=key
    )
    assert made.status_code == 201, made.text
    secret, webhook_id = made.json()["secret"], made.json()["id"]
    assert secret.startswith("whsec_") and made.json()["events"] == ["item.final"]
    with pg_db.session() as session:
        assert secret.encode() not in session.get_one(WebhookEndpoint, webhook_id).secret_sealed
    listed = client.get(f"/v1/admin/orgs/{org}/webhooks", headers=key)
    assert listed.status_code == 200 and secret not in listed.text
    assert [row["id"] for row in listed.json()["webhooks"]] == [webhook_id]
    other = client.get(f"/v1/admin/orgs/{_org()}/webhooks", headers=key)
    assert other.status_code == 404
    removed = client.delete(f"/v1/admin/orgs/{org}/webhooks/{webhook_id}", headers=key)
    assert removed.status_code == 200
    again = client.delete(f"/v1/admin/orgs/{org}/webhooks/{webhook_id}", headers=key)
    assert again.status_code == 404
    [row] = client.get(f"/v1/admin/orgs/{org}/webhooks", headers=key).json()["webhooks"]
    assert row["disabled_at"] is not None


def test_http_and_unknown_events_are_refused_unless_allowed(make_client: ClientFactory) -> None:
    client: TestClient = make_client(secret_key=TEST_SECRET_KEY)
    org = _org()
    path = f"/v1/admin/orgs/{org}/webhooks"
    plain = {"url": "http://example.com/in"}
    answer = client.post(path, json=plain, headers=admin_headers())
    assert answer.status_code == 422 and "example.com" not in answer.text
    events = {"url": "https://example.com/in", "events": ["item.started"]}
    assert client.post(path, json=events, headers=admin_headers()).status_code == 422
    allowed = make_client(secret_key=TEST_SECRET_KEY, webhook_allow_http=True)
    assert allowed.post(path, json=plain, headers=admin_headers()).status_code == 201


def test_without_a_secret_key_no_webhook_is_made(make_client: ClientFactory) -> None:
    client = make_client(secret_key=None)
    answer = client.post(
        f"/v1/admin/orgs/{_org()}/webhooks",
        json={"url": "https://example.com/in"},
        headers=admin_headers(),
    )
    assert answer.status_code == 409 and "CORRAL_SECRET_KEY" in answer.text


def _tried(db: Database, org: str, webhook_id: str, *, status: int | None, outbox_id: int) -> str:
    """A logged try at a new event of ``org``'s endpoint (its outbox row ``outbox_id``, which
    need not exist: delivered); the event's id."""
    target = webhooks.event_target(webhook_id, "sandbox.ended", "2026-12-09T10:00:00+00:00", {})
    row = OutboxRow(outbox_id, None, org, "webhook", target, 0, utcnow())
    error = None if status else "OutcomeDeliveryError: the webhook's host could not be reached"
    webhook_log.record_try(db, row, webhook_log.Try(status, error, utcnow()))
    return str(target["event_id"])


def test_an_org_key_reads_its_endpoints_log_and_redelivers_its_events(
    make_client: ClientFactory, pg_db: Database
) -> None:
    client = make_client(secret_key=TEST_SECRET_KEY)
    org = _org()
    key = bearer(make_key(client, org, "admin"))
    body = {"url": "https://example.com/in", "events": ["sandbox.ended", "budget.threshold"]}
    made = client.post(f"/v1/admin/orgs/{org}/webhooks", json=body, headers=key)
    assert made.status_code == 201 and made.json()["events"] == body["events"]
    webhook_id = made.json()["id"]
    events = [_tried(pg_db, org, webhook_id, status=s, outbox_id=0) for s in (500, None, 200)]
    path = f"/v1/admin/orgs/{org}/webhooks/{webhook_id}/deliveries"

    page = client.get(path, params={"limit": 2}, headers=key)
    assert page.status_code == 200, page.text
    newest, middle = page.json()["deliveries"]
    assert [newest["event_id"], middle["event_id"]] == events[:0:-1]
    assert (newest["status"], middle["status"], middle["owed"]) == (200, None, None)
    assert middle["error"].endswith("could not be reached")
    older = client.get(path, params={"before": page.json()["next_before"]}, headers=key)
    assert [t["event_id"] for t in older.json()["deliveries"]] == events[:1]
    assert older.json()["next_before"] is None

    redeliver = f"/v1/admin/orgs/{org}/webhooks/events/{events[0]}/redeliver"
    done = client.post(redeliver, headers=key)
    assert done.status_code == 202, done.text
    assert (done.json()["event_id"], done.json()["endpoint_id"]) == (events[0], webhook_id)
    with pg_db.session() as session:
        [owed] = session.scalars(
            select(OutcomeOutbox).where(
                OutcomeOutbox.org_id == org, OutcomeOutbox.sink == "webhook"
            )
        )
    assert owed.target["event_id"] == events[0] and owed.work_item_id is None

    other_org = bearer(make_key(client, _org(), "admin"))
    assert client.get(path, headers=other_org).status_code == 404
    assert client.post(redeliver, headers=other_org).status_code == 404
    unknown = f"/v1/admin/orgs/{org}/webhooks/events/evt_nothing/redeliver"
    assert client.post(unknown, headers=key).status_code == 404
    assert (
        client.get(f"/v1/admin/orgs/{org}/webhooks/wh-none/deliveries", headers=key).status_code
        == 404
    )
    assert (
        client.delete(f"/v1/admin/orgs/{org}/webhooks/{webhook_id}", headers=key).status_code == 200
    )
    removed = client.post(redeliver, headers=key)
    assert removed.status_code == 409 and "removed" in removed.text
    assert client.get(path, headers=key).status_code == 200  # a removed endpoint's log stays
