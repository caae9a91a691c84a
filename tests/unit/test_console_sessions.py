"""The console's server-side sessions (corral.shared.store.console_sessions) on SQLite: what
the table holds of an id, what ends a session, and how the table stays bounded."""

from __future__ import annotations

from datetime import datetime, timedelta

import pytest
from sqlalchemy import delete, func, select, update

from corral.shared.store.api_keys import create_key, find_key, revoke_key
from corral.shared.store.console_sessions import (
    LAST_SEEN_STEP,
    MAX_LIVE_PER_PRINCIPAL,
    SESSION_TTL,
    LiveSession,
    find_session,
    revoke_session,
    start_session,
)
from corral.shared.store.db import Database, utcnow
from corral.shared.store.models import ApiKey, ConsoleSessionRecord
from corral.shared.store.tokens import hash_token

ADMIN = "the-admin-token"


def admin_session(db: Database, now: datetime, token: str = ADMIN) -> str:
    with db.session() as session:
        return start_session(session, key=None, admin_token=token, now=now)


def key_session(db: Database, key: str, now: datetime) -> str:
    with db.session() as session:
        found = find_key(session, key)
        assert found is not None
        return start_session(session, key=found, admin_token=None, now=now)


def find(
    db: Database, session_id: str, now: datetime, token: str | None = ADMIN
) -> LiveSession | None:
    with db.session() as session:
        return find_session(session, session_id, admin_token=token, now=now)


def rows(db: Database) -> list[ConsoleSessionRecord]:
    with db.session() as session:
        found = session.scalars(select(ConsoleSessionRecord)).all()
        session.expunge_all()
        return list(found)


def test_the_table_keeps_the_ids_digest_and_an_admin_session_its_tokens_check(
    sqlite_db: Database,
) -> None:
    now = utcnow()
    session_id = admin_session(sqlite_db, now)
    assert len(session_id) == 43  # 32 random bytes
    [row] = rows(sqlite_db)
    assert row.id_hash == hash_token(session_id)
    stored = [str(getattr(row, column.key)) for column in ConsoleSessionRecord.__table__.c]
    assert not any(
        session_id in value or ADMIN in value or hash_token(ADMIN) in value for value in stored
    )
    assert (row.api_key_id, row.org_id, row.revoked_at) == (None, None, None)
    assert row.expires_at == now + SESSION_TTL
    live = find(sqlite_db, session_id, now)
    assert live == LiveSession(key=None, expires_at=now + SESSION_TTL)
    # Another admin token (changed since), none, or an unknown id: no session.
    assert find(sqlite_db, session_id, now, token="another-token") is None
    assert find(sqlite_db, session_id, now, token=None) is None
    assert find(sqlite_db, hash_token(session_id), now) is None
    refused = pytest.raises(ValueError, match="org key or the admin token")
    with refused, sqlite_db.session() as session:
        start_session(session, key=None, admin_token=None, now=now)


def test_a_session_ends_at_its_expiry_and_at_logout(sqlite_db: Database) -> None:
    now = utcnow()
    session_id = admin_session(sqlite_db, now)
    assert find(sqlite_db, session_id, now + SESSION_TTL - timedelta(seconds=1)) is not None
    assert find(sqlite_db, session_id, now + SESSION_TTL) is None
    with sqlite_db.session() as session:
        assert revoke_session(session, session_id, now=now)
        assert not revoke_session(session, session_id, now=now)  # once
    assert find(sqlite_db, session_id, now) is None
    assert rows(sqlite_db)[0].revoked_at == now


def test_an_org_keys_session_follows_its_key(sqlite_db: Database) -> None:
    now = utcnow()
    with sqlite_db.session() as session:
        revoked_id, revoked = create_key(session, "acme", "console", ["dispatch"])
        deleted_id, deleted = create_key(session, "acme", "console", ["read"])
    first, second = key_session(sqlite_db, revoked, now), key_session(sqlite_db, deleted, now)
    live = find(sqlite_db, first, now, token=None)  # no admin token needed
    assert live is not None and live.key is not None
    assert (live.key.id, live.key.org_id) == (revoked_id, "acme")
    assert live.key.scopes == {"dispatch", "read"}
    with sqlite_db.session() as session:
        assert revoke_key(session, "acme", revoked_id)
        session.execute(delete(ApiKey).where(ApiKey.id == deleted_id))
    assert find(sqlite_db, first, now) is None
    assert find(sqlite_db, second, now) is None


def test_a_session_naming_another_org_than_its_key_is_none(sqlite_db: Database) -> None:
    now = utcnow()
    with sqlite_db.session() as session:
        _, key = create_key(session, "acme", "console", ["read"])
    session_id = key_session(sqlite_db, key, now)
    with sqlite_db.session() as session:
        session.execute(update(ConsoleSessionRecord).values(org_id="other"))
    assert find(sqlite_db, session_id, now) is None


def test_last_seen_moves_at_most_once_a_step(sqlite_db: Database) -> None:
    now = utcnow()
    session_id = admin_session(sqlite_db, now)
    find(sqlite_db, session_id, now + LAST_SEEN_STEP / 2)
    assert rows(sqlite_db)[0].last_seen_at == now
    find(sqlite_db, session_id, now + LAST_SEEN_STEP)
    assert rows(sqlite_db)[0].last_seen_at == now + LAST_SEEN_STEP


def test_a_login_deletes_expired_and_revoked_rows_and_caps_its_principals(
    sqlite_db: Database,
) -> None:
    now = utcnow()
    with sqlite_db.session() as session:
        _, key = create_key(session, "acme", "console", ["read"])
    old_key_session = key_session(sqlite_db, key, now - SESSION_TTL)  # expired by now
    kept_key_session = key_session(sqlite_db, key, now)
    revoked = admin_session(sqlite_db, now)
    with sqlite_db.session() as session:
        revoke_session(session, revoked, now=now)
    admins = [admin_session(sqlite_db, now + timedelta(seconds=n)) for n in range(25)]
    remaining = {row.id_hash for row in rows(sqlite_db)}
    # Every expired row went (another principal's too), the admin's revoked one, and the
    # admin's oldest beyond the cap; the org key's live session stayed.
    assert hash_token(old_key_session) not in remaining
    assert hash_token(revoked) not in remaining
    assert hash_token(kept_key_session) in remaining
    newest = {hash_token(session_id) for session_id in admins[-MAX_LIVE_PER_PRINCIPAL:]}
    assert remaining == newest | {hash_token(kept_key_session)}
    with sqlite_db.session() as session:
        count = session.scalar(select(func.count()).select_from(ConsoleSessionRecord))
    assert count == MAX_LIVE_PER_PRINCIPAL + 1
    assert find(sqlite_db, admins[0], now) is None and find(sqlite_db, admins[-1], now)
