"""Row-lock waits on PostgreSQL, as tests that hold a lock to stop a process at a known
point see them."""

from __future__ import annotations

import time

from sqlalchemy import text

from corral.shared.store.db import Database


def lock_waiters(db: Database) -> int:
    """Backends of ``db``'s database waiting for a lock now."""
    return _backends(db, "wait_event_type = 'Lock' AND state = 'active'")


def others_active(db: Database) -> int:
    """Statements other backends of ``db``'s database are running now."""
    return _backends(db, "state = 'active' AND pid <> pg_backend_pid()")


def _backends(db: Database, condition: str) -> int:
    # Read afresh each time: within one transaction pg_stat_activity is one snapshot.
    with db.session() as session:
        found = session.scalar(
            text(
                "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
                f"AND {condition}"
            )
        )
    return int(found or 0)


def wait_for_lock_wait(db: Database, what: str, timeout_s: float = 30) -> None:
    """Return once a backend of ``db``'s database waits for a lock."""
    deadline = time.monotonic() + timeout_s
    while not lock_waiters(db):
        assert time.monotonic() < deadline, f"{what} never waited for the lock"
        time.sleep(0.05)
