"""The admin api's webhook routes: an endpoint made (its secret answered once, stored
sealed), listed without secrets, removed; an org key acts on its own org only."""

from __future__ import annotations

import uuid

from fastapi.testclient import TestClient

from corral.shared.store.db import Database
from corral.shared.store.models import WebhookEndpoint
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
