"""The console's webhook pages through the api app on real PostgreSQL: an org admin adds an
endpoint (its secret on that answer alone), reads its delivery log, redelivers an event and
removes the endpoint; every form needs the session's CSRF token; a read-only login and the
deployment admin without an org see no endpoint."""

from __future__ import annotations

import re

from sqlalchemy import select

from corral.shared.keyring import Keyring
from corral.shared.store import webhook_log, webhooks
from corral.shared.store.api_keys import create_key
from corral.shared.store.db import Database, utcnow
from corral.shared.store.models import OutcomeOutbox, WebhookEndpoint
from corral.shared.store.outbox import OutboxRow
from tests.conftest import TEST_SECRET_KEY
from tests.integration.api_clients import ClientFactory
from tests.integration.test_console import logged_in, org, text_of

KEYRING = Keyring(TEST_SECRET_KEY)


def _tried(db: Database, org_id: str, webhook_id: str, status: int) -> str:
    """A logged try at a new item.final event of the endpoint; the event's id."""
    target = webhooks.event_target(webhook_id, "item.final", utcnow().isoformat())
    row = OutboxRow(0, None, org_id, "webhook", target, 0, utcnow())
    webhook_log.record_try(db, row, webhook_log.Try(status, None, utcnow()))
    return str(target["event_id"])


def test_an_org_admin_adds_reads_redelivers_and_removes_a_webhook(
    make_client: ClientFactory, pg_db: Database
) -> None:
    mine = org()
    with pg_db.session() as session:
        _, key = create_key(session, mine, "console", ["read", "admin"])
    client = make_client(secret_key=TEST_SECRET_KEY)
    csrf = logged_in(client, key)
    assert "no webhooks" in client.get("/console/webhooks").text

    form = {"url": "https://example.com/in", "event.sandbox.ended": "on", "org": mine}
    assert client.post("/console/webhooks", data=form).status_code == 403  # no CSRF token
    made = client.post("/console/webhooks", data={**form, "csrf": csrf})
    assert made.status_code == 201, made.text
    found = re.search(r'<pre id="webhook-secret">(whsec_[^<]+)</pre>', made.text)
    assert found is not None
    secret = found.group(1)
    with pg_db.session() as session:
        row = session.scalars(select(WebhookEndpoint).where(WebhookEndpoint.org_id == mine)).one()
        assert webhooks.open_secret(KEYRING, row.org_id, row.id, row.secret_sealed) == secret
        assert row.events == "sandbox.ended"
    listed = client.get("/console/webhooks")
    assert row.id in listed.text and secret not in listed.text

    refused = client.post("/console/webhooks", data={**form, "csrf": csrf, "url": "ftp://x/y"})
    assert refused.status_code == 422 and "must start with https://" in text_of(refused.text)

    event_id = _tried(pg_db, mine, row.id, 503)
    log = client.get(f"/console/webhooks/{row.id}")
    assert log.status_code == 200 and event_id in log.text and "503" in text_of(log.text)
    redeliver = f"/console/webhooks/events/{event_id}/redeliver"
    assert client.post(redeliver, data={}, follow_redirects=False).status_code == 403
    again = client.post(redeliver, data={"csrf": csrf}, follow_redirects=False)
    assert again.status_code == 303
    assert again.headers["location"] == f"/console/webhooks/{row.id}?redelivered={event_id}"
    with pg_db.session() as session:
        owed = session.scalars(select(OutcomeOutbox).where(OutcomeOutbox.org_id == mine)).one()
    assert owed.target["event_id"] == event_id

    removed = client.post(
        f"/console/webhooks/{row.id}/remove", data={"csrf": csrf}, follow_redirects=False
    )
    assert removed.status_code == 303
    with pg_db.session() as session:
        assert session.get_one(WebhookEndpoint, row.id).disabled_at is not None
    after = client.get(f"/console/webhooks/{row.id}").text
    assert "removed" in text_of(after) and "/redeliver" not in after


def test_a_read_only_login_and_an_admin_without_an_org_see_no_endpoint(
    make_client: ClientFactory, pg_db: Database
) -> None:
    mine = org()
    with pg_db.session() as session:
        _, reader = create_key(session, mine, "console", ["read"])
        hook, _ = webhooks.create_endpoint(
            session,
            KEYRING,
            mine,
            "https://example.com/in",
            ["item.final"],
            allow_http=False,
        )
    client = make_client(secret_key=TEST_SECRET_KEY)
    logged_in(client, reader)
    assert client.get("/console/webhooks").status_code == 403
    assert client.get(f"/console/webhooks/{hook['id']}").status_code == 403

    admin = make_client(secret_key=TEST_SECRET_KEY)
    logged_in(admin)
    chooser = admin.get("/console/webhooks")
    assert chooser.status_code == 200 and 'id="webhook-org"' in chooser.text
    assert hook["id"] not in chooser.text
    assert hook["id"] in admin.get(f"/console/webhooks?org={mine}").text
