"""Org api keys: ``cok_`` + 32 random bytes, shown once when made, stored as SHA-256 only.

A key acts for one org, with the scopes it was given: ``read`` (items, logs, events,
bundles, pools, sandboxes, costs, budgets of its org), ``dispatch`` (new items, cancelling
its org's items; sessions), ``review`` (accepting and rejecting its org's result bundles)
and ``admin`` (its org's pools, budgets, credentials, limits and keys). ``dispatch`` and
``review`` hold ``read``, ``admin`` holds all: the work's author is not its reviewer unless
a key says so. Looking a key up is one indexed read of its hash; a revoked key is found by
nothing.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from sqlalchemy import func, select, update
from sqlalchemy.orm import Session

from corral.shared.store.db import utcnow
from corral.shared.store.models import ApiKey
from corral.shared.store.tokens import hash_token, new_token

KEY_PREFIX = "cok_"
SCOPES = ("dispatch", "read", "review", "admin")
# What each scope grants, the scope itself included. ``dispatch`` never holds ``review``.
_GRANTS = {
    "admin": frozenset(SCOPES),
    "dispatch": frozenset({"dispatch", "read"}),
    "review": frozenset({"review", "read"}),
}
MAX_KEYS_PER_ORG = 100


class ApiKeyError(ValueError):
    """A key request corral refuses; its message says what to change."""


@dataclass(frozen=True)
class FoundKey:
    id: str
    org_id: str
    scopes: frozenset[str]


def granted(scopes: Iterable[str]) -> frozenset[str]:
    """Every scope that ``scopes`` hold (``admin`` holds all; ``dispatch`` and ``review``
    hold ``read``)."""
    held: set[str] = set()
    for scope in scopes:
        held |= _GRANTS.get(scope, {scope})
    return frozenset(held)


def parse_scopes(scopes: Iterable[str]) -> list[str]:
    wanted = sorted(set(scopes))
    unknown = [s for s in wanted if s not in SCOPES]
    if unknown or not wanted:
        raise ApiKeyError(f"scopes must be one or more of: {', '.join(SCOPES)}")
    return wanted


def create_key(session: Session, org_id: str, name: str, scopes: Iterable[str]) -> tuple[str, str]:
    """A new key for ``org_id``: ``(key id, the key)``. The key itself is never stored."""
    wanted = parse_scopes(scopes)
    if session.get_bind().dialect.name == "postgresql":
        # One creation per org at a time (until this transaction ends): two at once would
        # both count the keys before either is written. SQLite has one writer already.
        session.execute(
            select(
                func.pg_advisory_xact_lock(func.hashtextextended(f"corral api keys of {org_id}", 0))
            )
        )
    live = session.scalars(
        select(ApiKey.id).where(ApiKey.org_id == org_id, ApiKey.revoked_at.is_(None))
    ).all()
    if len(live) >= MAX_KEYS_PER_ORG:
        raise ApiKeyError(
            f"org has {MAX_KEYS_PER_ORG} live keys, the most it may hold: revoke one first"
        )
    token = new_token(KEY_PREFIX)
    key_id = f"key-{uuid.uuid4().hex[:16]}"
    session.add(
        ApiKey(
            id=key_id,
            org_id=org_id,
            name=name,
            scopes=",".join(wanted),
            key_hash=hash_token(token),
            created_at=utcnow(),
        )
    )
    return key_id, token


def find_key(session: Session, token: str) -> FoundKey | None:
    """The live key ``token`` is, or None (unknown and revoked keys alike)."""
    if not token.startswith(KEY_PREFIX):
        return None
    return find_key_by_hash(session, hash_token(token))


def find_key_by_hash(session: Session, key_hash: str) -> FoundKey | None:
    """The live key whose SHA-256 is ``key_hash`` (the console's session keeps only that)."""
    row = session.scalars(
        select(ApiKey).where(ApiKey.key_hash == key_hash, ApiKey.revoked_at.is_(None))
    ).first()
    if row is None:
        return None
    return FoundKey(row.id, row.org_id, granted(row.scopes.split(",")))


def list_keys(session: Session, org_id: str) -> list[dict[str, Any]]:
    """An org's keys, newest first, without anything that could be used as one."""
    rows = session.scalars(
        select(ApiKey).where(ApiKey.org_id == org_id).order_by(ApiKey.created_at.desc())
    ).all()
    return [key_document(row) for row in rows]


def key_document(row: ApiKey) -> dict[str, Any]:
    return {
        "id": row.id,
        "org_id": row.org_id,
        "name": row.name,
        "scopes": row.scopes.split(","),
        "created_at": row.created_at,
        "revoked_at": row.revoked_at,
    }


def revoke_key(session: Session, org_id: str, key_id: str) -> bool:
    """Revoke one of ``org_id``'s keys; whether a live one was revoked."""
    done = session.execute(
        update(ApiKey)
        .where(ApiKey.id == key_id, ApiKey.org_id == org_id, ApiKey.revoked_at.is_(None))
        .values(revoked_at=utcnow())
    )
    return bool(done.rowcount)  # type: ignore[attr-defined]  # a CursorResult
