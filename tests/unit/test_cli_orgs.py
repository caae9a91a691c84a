"""``corral orgs`` against the embedded database: a key made, printed once, listed without
itself, found by the api's lookup, and revoked; a webhook endpoint likewise, its delivery
log read and an event redelivered; an org's limit set, shown and removed."""

from __future__ import annotations

import json
from pathlib import Path

from corral.shared.store import webhook_log, webhooks
from corral.shared.store.api_keys import find_key
from corral.shared.store.db import utcnow
from corral.shared.store.outbox import OutboxRow
from tests.unit.test_cli_operator import db, dispatched, embedded, run, setup_pool

__all__ = ["embedded"]  # the autouse fixture: an embedded database of the test's own


def test_a_key_is_printed_once_listed_without_itself_and_revoked(embedded: Path) -> None:
    made = run("orgs", "keys", "create", "acme", "--scope", "read", "--scope", "dispatch")
    key = made.stdout.strip()
    assert key.startswith("cok_") and "\n" not in key
    listed = run("orgs", "keys", "list", "acme", "--format", "json").stdout
    assert key not in listed
    (row,) = json.loads(listed)
    assert row["scopes"] == ["dispatch", "read"]
    database = db(embedded)
    with database.session() as session:
        found = find_key(session, key)
    assert found is not None and found.org_id == "acme"
    run("orgs", "keys", "revoke", "acme", row["id"])
    with database.session() as session:
        assert find_key(session, key) is None
    again = run("orgs", "keys", "revoke", "acme", row["id"], code=2)
    assert "no live key" in again.output
    database.engine.dispose()


def test_an_unknown_scope_is_refused_naming_the_scopes(embedded: Path) -> None:
    refused = run("orgs", "keys", "create", "acme", "--scope", "root", code=2)
    assert "dispatch, read, review, admin" in refused.output


def test_an_org_limit_is_set_shown_and_removed(embedded: Path) -> None:
    setup_pool()
    dispatched()
    assert "at most 3 in flight" in run("orgs", "limit", "acme", "--max-concurrent", "3").stdout
    shown = run("orgs", "limit", "acme").stdout
    assert "at most 3 in flight" in shown
    assert "no limit" in run("orgs", "limit", "acme", "--remove").stdout
    bad = run("orgs", "limit", "acme", "--max-concurrent", "0", code=2)
    assert "--max-concurrent" in bad.output


def test_commands_use_an_org_key_before_any_admin_token(tmp_path: Path) -> None:
    from pydantic import SecretStr

    from corral.cli.api_target import api_target, publish
    from corral.shared.settings import CoreSettings

    publish(tmp_path, "http://127.0.0.1:9", "from-the-file")
    plain = CoreSettings(state_dir=tmp_path)
    assert api_target(plain).token == "from-the-file"
    admin = CoreSettings(state_dir=tmp_path, admin_token=SecretStr("admin"))
    assert api_target(admin).token == "admin"
    keyed = CoreSettings(
        state_dir=tmp_path, admin_token=SecretStr("admin"), api_key=SecretStr("cok_x")
    )
    assert api_target(keyed).token == "cok_x"


def _tried(embedded: Path, webhook_id: str, status: int) -> str:
    """A logged try at a new sandbox.ended event of the endpoint (its outbox row delivered
    and gone); the event's id."""
    target = webhooks.event_target(webhook_id, "sandbox.ended", "2026-12-09T10:00:00+00:00", {})
    row = OutboxRow(1, None, "acme", "webhook", target, 0, utcnow())
    database = db(embedded)
    webhook_log.record_try(database, row, webhook_log.Try(status, None, utcnow()))
    database.dispose()
    return str(target["event_id"])


def test_a_webhook_is_added_its_log_read_an_event_redelivered_and_it_is_removed(
    embedded: Path,
) -> None:
    made = run(
        "orgs",
        "webhooks",
        "add",
        "acme",
        "https://example.com/in",
        "--event",
        "sandbox.ended",
        "--event",
        "item.final",
    )
    secret = made.stdout.strip()
    assert secret.startswith("whsec_") and "\n" not in secret
    listed = run("orgs", "webhooks", "list", "acme", "--format", "json").stdout
    assert secret not in listed
    (row,) = json.loads(listed)
    assert row["events"] == ["item.final", "sandbox.ended"]
    webhook_id = row["id"]

    event_id = _tried(embedded, webhook_id, 503)
    log = run("orgs", "webhooks", "deliveries", "acme", webhook_id).stdout
    assert event_id in log and "sandbox.ended" in log and "503" in log
    assert "no webhook" in run("orgs", "webhooks", "deliveries", "other", webhook_id, code=2).output
    again = run("orgs", "webhooks", "redeliver", "acme", event_id).stdout
    assert f"event {event_id} (sandbox.ended) owed again to webhook {webhook_id}" in again
    unknown = run("orgs", "webhooks", "redeliver", "acme", "evt_none", code=2)
    assert "no such webhook event" in unknown.output

    run("orgs", "webhooks", "remove", "acme", webhook_id)
    gone = run("orgs", "webhooks", "redeliver", "acme", event_id, code=2)
    assert "removed" in gone.output
    assert "no live webhook" in run("orgs", "webhooks", "remove", "acme", webhook_id, code=2).output
