"""The web console's browser sessions, held server-side (docs/console.md).

A login makes a random session id (32 bytes) that only the browser's cookie holds; the
table keeps its SHA-256. A session's principal is an org key (by id, with its org) or the
deployment admin, bound to the admin token it logged in with. Each request finds the live
row by the id's digest, with the key it names: a session logged out (``revoked_at``), past
its expiry (8 hours after the login), of a revoked or deleted key, or of an admin token
that has since changed, is no session.

The table stays small: a login deletes every expired row and its principal's revoked ones,
and leaves its principal at most :data:`MAX_LIVE_PER_PRINCIPAL` sessions (the oldest go).
"""

from __future__ import annotations

import hmac
import secrets
from dataclasses import dataclass
from datetime import datetime, timedelta

from sqlalchemy import ColumnElement, delete, select, update
from sqlalchemy.orm import Session

from corral.shared.store.api_keys import FoundKey, granted
from corral.shared.store.models import ApiKey, ConsoleSessionRecord
from corral.shared.store.tokens import hash_token

SESSION_TTL = timedelta(hours=8)
MAX_LIVE_PER_PRINCIPAL = 20
# last_seen_at moves on at most once a minute: a page polling every second writes no more.
LAST_SEEN_STEP = timedelta(minutes=1)
ID_BYTES = 32
_ADMIN_LABEL = b"corral-console-admin-v1:"


@dataclass(frozen=True)
class LiveSession:
    """A live session's principal as it is now: its org key, or None for the admin."""

    key: FoundKey | None
    expires_at: datetime


def _admin_check(session_id: str, admin_token: str) -> str:
    # Keyed by the session id, which the table does not hold: a copy of the table gives
    # nothing to guess the admin token against.
    return hmac.new(session_id.encode(), _ADMIN_LABEL + admin_token.encode(), "sha256").hexdigest()


def _of_principal(key_id: str | None) -> ColumnElement[bool]:
    column = ConsoleSessionRecord.api_key_id
    return column.is_(None) if key_id is None else column == key_id


def start_session(
    session: Session, *, key: FoundKey | None, admin_token: str | None, now: datetime
) -> str:
    """A new session for the org key ``key``, or (``key`` None) for the deployment admin
    who logged in with ``admin_token``: the session id, for the cookie only."""
    if key is None and admin_token is None:
        raise ValueError("a console session needs an org key or the admin token")
    _prune(session, key.id if key else None, now)
    session_id = secrets.token_urlsafe(ID_BYTES)
    admin_check = _admin_check(session_id, admin_token) if key is None and admin_token else None
    session.add(
        ConsoleSessionRecord(
            id_hash=hash_token(session_id),
            api_key_id=key.id if key else None,
            org_id=key.org_id if key else None,
            admin_check=admin_check,
            created_at=now,
            expires_at=now + SESSION_TTL,
            last_seen_at=now,
        )
    )
    return session_id


def _prune(session: Session, key_id: str | None, now: datetime) -> None:
    """Delete expired sessions, the principal's revoked ones, and its oldest live ones
    beyond the room a new one needs."""
    record = ConsoleSessionRecord
    mine = _of_principal(key_id)
    session.execute(delete(record).where(record.expires_at <= now))
    session.execute(delete(record).where(mine, record.revoked_at.is_not(None)))
    newest = (
        select(record.id_hash)
        .where(mine)
        .order_by(record.created_at.desc())
        .limit(MAX_LIVE_PER_PRINCIPAL - 1)
    )
    session.execute(delete(record).where(mine, record.id_hash.not_in(newest)))


def find_session(
    session: Session, session_id: str, *, admin_token: str | None, now: datetime
) -> LiveSession | None:
    """The live session ``session_id`` names, or None (unknown, expired, logged out, its
    key revoked or deleted, or its admin token no longer the deployment's)."""
    found = session.execute(
        select(ConsoleSessionRecord, ApiKey)
        .outerjoin(ApiKey, ApiKey.id == ConsoleSessionRecord.api_key_id)
        .where(ConsoleSessionRecord.id_hash == hash_token(session_id))
    ).first()
    if found is None:
        return None
    row, key = found
    if row.revoked_at is not None or row.expires_at <= now:
        return None
    live = _principal_now(row, key, session_id, admin_token)
    if live is not None and now - row.last_seen_at >= LAST_SEEN_STEP:
        row.last_seen_at = now
    return live


def _principal_now(
    row: ConsoleSessionRecord, key: ApiKey | None, session_id: str, admin_token: str | None
) -> LiveSession | None:
    """A live row's principal as it is now: None once its key is revoked or deleted, or
    once the admin token is not the one it logged in with."""
    if row.api_key_id is None:
        if admin_token is None or row.admin_check is None:
            return None
        if not hmac.compare_digest(row.admin_check, _admin_check(session_id, admin_token)):
            return None
        return LiveSession(key=None, expires_at=row.expires_at)
    if key is None or key.revoked_at is not None or key.org_id != row.org_id:
        return None
    found = FoundKey(key.id, key.org_id, granted(key.scopes.split(",")))
    return LiveSession(key=found, expires_at=row.expires_at)


def revoke_session(session: Session, session_id: str, *, now: datetime) -> bool:
    """Log a session out: its id opens nothing from now on. Whether a live one was."""
    done = session.execute(
        update(ConsoleSessionRecord)
        .where(
            ConsoleSessionRecord.id_hash == hash_token(session_id),
            ConsoleSessionRecord.revoked_at.is_(None),
        )
        .values(revoked_at=now)
    )
    return bool(done.rowcount)  # type: ignore[attr-defined]  # a CursorResult
