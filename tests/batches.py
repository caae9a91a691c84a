"""Batches of dispatch requests for the intake's tests, and what they left in the database."""

from __future__ import annotations

from typing import Any

from sqlalchemy import event, select

from corral.scheduler.batch import Taken, accept_batch
from corral.shared.messages import DispatchRequest
from corral.shared.store.db import Database
from corral.shared.store.models import Pool, WorkItem
from tests.seeding import SETTINGS


def dispatch_message(
    org: str, number: int, *, profile: str = "default", key: str | None = None
) -> dict[str, Any]:
    """A ``corral.dispatch`` message of ``org`` running ``echo <number>`` (with ``key`` as
    its idempotency key, when given)."""
    message: dict[str, Any] = {
        "org": org,
        "project": "p",
        "profile": profile,
        "work": {"kind": "shell", "command": f"echo {number}"},
    }
    if key is not None:
        message["idempotency_key"] = key
    return message


def requests_for(org: str, count: int) -> list[DispatchRequest]:
    """``count`` shell requests of ``org`` with the ``default`` profile."""
    work = {"kind": "shell", "command": "true"}
    message = {"org": org, "project": "p", "profile": "default", "work": work}
    return [DispatchRequest.model_validate(message) for _ in range(count)]


def states(db: Database, org: str) -> list[str]:
    with db.session() as session:
        return sorted(session.scalars(select(WorkItem.state).where(WorkItem.org_id == org)))


def in_use(db: Database, pool_id: str) -> int:
    with db.session() as session:
        return int(session.scalar(select(Pool.slots_in_use).where(Pool.id == pool_id)) or 0)


def statements(
    db: Database, requests: list[DispatchRequest]
) -> tuple[list[tuple[str, bool]], list[Taken]]:
    """Each statement ``accept_batch`` sent, with whether it ran outside a transaction, and
    what it answered."""
    seen: list[tuple[str, bool]] = []

    def note(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        seen.append((statement, bool(conn.connection.dbapi_connection.autocommit)))

    event.listen(db.engine, "before_cursor_execute", note)
    try:
        taken = accept_batch(db, requests, actor="test", settings=SETTINGS)
    finally:
        event.remove(db.engine, "before_cursor_execute", note)
    return seen, taken
