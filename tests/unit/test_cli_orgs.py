"""``corral orgs`` against the embedded database: a key made, printed once, listed without
itself, found by the api's lookup, and revoked; an org's limit set, shown and removed."""

from __future__ import annotations

import json
from pathlib import Path

from corral.shared.store.api_keys import find_key
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
