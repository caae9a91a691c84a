"""How a work item reads from the outside: the api's answer and ``corral show``."""

from __future__ import annotations

from typing import Any

from sqlalchemy import select

from shared.db import Database
from shared.models import Sandbox, WorkItem, WorkItemLog


def load_item_view(db: Database, item_id: str) -> dict[str, Any]:
    """The view of ``item_id`` with its current sandbox.

    Raises:
        LookupError: no such item.
    """
    with db.session() as session:
        item = session.get(WorkItem, item_id)
        if item is None:
            raise LookupError(f"work item {item_id} does not exist")
        sandbox = session.scalars(
            select(Sandbox).where(Sandbox.work_item_id == item.id, Sandbox.attempt == item.attempts)
        ).one_or_none()
        return work_item_view(item, sandbox)


def load_log_lines(
    db: Database, item_id: str, *, after: int = 0, limit: int = 5000
) -> list[dict[str, Any]]:
    with db.session() as session:
        rows = session.scalars(
            select(WorkItemLog)
            .where(WorkItemLog.work_item_id == item_id, WorkItemLog.id > after)
            .order_by(WorkItemLog.id)
            .limit(limit)
        ).all()
        return [{"id": r.id, "stream": r.stream, "line": r.line} for r in rows]


def work_item_view(item: WorkItem, sandbox: Sandbox | None) -> dict[str, Any]:
    stamp = {
        name: value.isoformat() if value else None
        for name, value in (
            ("created_at", item.created_at), ("routed_at", item.routed_at),
            ("provisioned_at", item.provisioned_at), ("claimed_at", item.claimed_at),
            ("finished_at", item.finished_at),
        )
    }  # fmt: skip
    return {
        "id": item.id, "org": item.org_id, "project": item.project_id,
        "profile": item.profile, "state": item.state, "pool_id": item.pool_id,
        "queue": item.queue, "attempts": item.attempts, "exit_code": item.exit_code,
        "result": item.result, "duration_s": item.duration_s,
        "error": {"code": item.error_code, "message": item.error_message}
        if item.error_code else None,
        "sandbox": None if sandbox is None else {
            "id": sandbox.id, "provider_id": sandbox.provider_id,
            "external_id": sandbox.external_id, "status": sandbox.status,
            "termination_reason": sandbox.termination_reason,
        },
        "timestamps": stamp,
    }  # fmt: skip
