"""Registration and runner-session tokens (docs/architecture.md §7).

A registration token is ``crt_`` + 32 random bytes (URL-safe base64); a runner session token
is ``crs_`` + the same. Only their SHA-256 is stored. Redeeming a registration token is one
UPDATE that sets ``redeemed_at`` only where it is still null and the token has not expired,
so of two concurrent redeems exactly one wins, on PostgreSQL and SQLite alike.
"""

from __future__ import annotations

import hashlib
import secrets
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import ColumnElement, select, update
from sqlalchemy.engine import CursorResult
from sqlalchemy.orm import Session

from corral.shared.store.db import utcnow
from corral.shared.store.models import RegistrationToken, RunnerSession, Sandbox

REGISTRATION_PREFIX = "crt_"
SESSION_PREFIX = "crs_"
TOKEN_BYTES = 32


def hash_token(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def new_token(prefix: str) -> str:
    return prefix + secrets.token_urlsafe(TOKEN_BYTES)


def mint_registration_token(session: Session, sandbox: Sandbox, *, ttl_s: float) -> str:
    """Store a new registration token for ``sandbox`` and return it; it is never stored."""
    token, row = registration_token_row(sandbox.id, sandbox.work_item_id, ttl_s=ttl_s)
    session.add(RegistrationToken(**row))
    return token


def registration_token_row(
    sandbox_id: str, work_item_id: str, *, ttl_s: float, now: datetime | None = None
) -> tuple[str, dict[str, Any]]:
    """A new registration token, and the row that stores its hash (for a multi-row insert)."""
    token = new_token(REGISTRATION_PREFIX)
    row = {
        "token_hash": hash_token(token),
        "sandbox_id": sandbox_id,
        "work_item_id": work_item_id,
        "expires_at": (now or utcnow()) + timedelta(seconds=ttl_s),
    }
    return token, row


def revoke_registration_tokens(session: Session, sandbox_id: str) -> None:
    """Make every unredeemed token of ``sandbox_id`` unusable (a sandbox being re-made)."""
    _revoke(session, RegistrationToken.sandbox_id == sandbox_id)


def revoke_token(session: Session, token_hash: str) -> None:
    """Make one registration token unusable, if it has not been redeemed."""
    _revoke(session, RegistrationToken.token_hash == token_hash)


def _revoke(session: Session, which: ColumnElement[bool]) -> None:
    now = utcnow()
    session.execute(
        update(RegistrationToken)
        .where(which, RegistrationToken.redeemed_at.is_(None))
        .values(redeemed_at=now, expires_at=now)
    )


def redeem_registration_token(
    session: Session, token: str, *, now: datetime | None = None
) -> RegistrationToken | None:
    """Redeem ``token`` once. None for an unknown, used or expired token — alike on purpose."""
    if not token.startswith(REGISTRATION_PREFIX):
        return None
    moment = now or utcnow()
    token_hash = hash_token(token)
    result = session.execute(
        update(RegistrationToken)
        .where(
            RegistrationToken.token_hash == token_hash,
            RegistrationToken.redeemed_at.is_(None),
            RegistrationToken.expires_at > moment,
        )
        .values(redeemed_at=moment)
        .execution_options(synchronize_session=False)
    )
    assert isinstance(result, CursorResult)
    if result.rowcount != 1:
        return None
    return session.scalars(
        select(RegistrationToken).where(RegistrationToken.token_hash == token_hash)
    ).one()


def open_runner_session(session: Session, sandbox: Sandbox, *, expires_at: datetime) -> str:
    """Store a new runner session for ``sandbox`` and return its bearer token."""
    token = new_token(SESSION_PREFIX)
    session.add(
        RunnerSession(
            session_hash=hash_token(token),
            sandbox_id=sandbox.id,
            work_item_id=sandbox.work_item_id,
            org_id=sandbox.org_id,
            expires_at=expires_at,
        )
    )
    return token


def end_other_runner_sessions(session: Session, sandbox_id: str, *, keep: int) -> None:
    """End every live runner session of ``sandbox_id`` but ``keep`` (the claiming runner's):
    the work of a sandbox is claimed once, by one runner."""
    now = utcnow()
    session.execute(
        update(RunnerSession)
        .where(
            RunnerSession.sandbox_id == sandbox_id,
            RunnerSession.id != keep,
            RunnerSession.expires_at > now,
        )
        .values(expires_at=now)
    )


def find_runner_session(
    session: Session, token: str, *, now: datetime | None = None
) -> RunnerSession | None:
    """The live session for ``token``, or None: unknown, expired, and sandbox-terminated
    look the same."""
    if not token.startswith(SESSION_PREFIX):
        return None
    return session.scalars(
        select(RunnerSession)
        .join(Sandbox, Sandbox.id == RunnerSession.sandbox_id)
        .where(
            RunnerSession.session_hash == hash_token(token),
            RunnerSession.expires_at > (now or utcnow()),
            Sandbox.terminated_at.is_(None),  # a session ends with its sandbox
        )
    ).one_or_none()
