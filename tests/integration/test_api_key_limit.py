"""An org's live api keys stay within MAX_KEYS_PER_ORG on PostgreSQL when keys are created
at once: a creation waits for another of the same org, then counts the key it wrote."""

from __future__ import annotations

import threading
import uuid

from sqlalchemy import func, select, text

from corral.shared.store.api_keys import MAX_KEYS_PER_ORG, ApiKeyError, create_key
from corral.shared.store.db import Database
from corral.shared.store.models import ApiKey
from tests.lock_waits import wait_for_lock_wait


def _live(db: Database, org: str) -> int:
    with db.session() as session:
        count = session.scalar(
            select(func.count()).where(ApiKey.org_id == org, ApiKey.revoked_at.is_(None))
        )
    return int(count or 0)


def test_two_creations_at_once_cannot_pass_the_limit_together(pg_db: Database) -> None:
    org = f"keys-{uuid.uuid4().hex[:8]}"
    with pg_db.session() as session:
        for number in range(MAX_KEYS_PER_ORG - 1):
            create_key(session, org, f"k{number}", ["read"])
    outcome: list[object] = []

    def second() -> None:
        try:
            with pg_db.session() as session:
                outcome.append(create_key(session, org, "second", ["read"]))
        except ApiKeyError as exc:
            outcome.append(exc)

    with pg_db.session() as first:
        create_key(first, org, "first", ["read"])  # the last one allowed, not yet committed
        racer = threading.Thread(target=second)
        racer.start()
        wait_for_lock_wait(pg_db, "the second creation")  # it waits for the first's commit
    racer.join(timeout=30)
    assert not racer.is_alive()
    [refused] = outcome
    assert isinstance(refused, ApiKeyError) and "revoke one first" in str(refused)
    assert _live(pg_db, org) == MAX_KEYS_PER_ORG


def test_creations_for_different_orgs_do_not_wait_for_each_other(pg_db: Database) -> None:
    mine, theirs = (f"keys-{uuid.uuid4().hex[:8]}" for _ in range(2))
    with pg_db.session() as first:
        create_key(first, mine, "held", ["read"])
        with pg_db.session() as other:
            # A lock shared by every org would make this wait on `first`: fail fast instead.
            other.execute(text("SET LOCAL lock_timeout = '5s'"))
            create_key(other, theirs, "free", ["read"])
    assert (_live(pg_db, mine), _live(pg_db, theirs)) == (1, 1)
