"""An ended work item's final record: what its sender is told (corral.worker.outcome_delivery).

The record is read when it is delivered, not when the item ended: its sandboxes are billed
once they have ended, a moment after the item (``cost.settled`` says whether every one of
them was). It holds the item's id, state, exit code, error, result, the tail of its output
and its cost; nothing of the message it was made from (env values, commands) but its ids.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from corral.shared.store.ledger import format_micros
from corral.shared.store.models import CostEvent, Sandbox, WorkItem, WorkItemLog

TAIL_LINES = 20  # the output's last lines in the record
TAIL_CHARACTERS = 4000  # and at most this much of them


@dataclass(frozen=True)
class FinalRecord:
    """A record, and whether every sandbox of its item was billed when it was read."""

    record: dict[str, Any]
    settled: bool


def final_record(session: Session, item_id: str) -> FinalRecord | None:
    """The final record of ``item_id`` (None: no such item)."""
    item = session.get(WorkItem, item_id)
    if item is None:
        return None
    cost = _cost(session, item_id)
    record = {
        "id": item.id,
        "state": item.state,
        "org": item.org_id,
        "project": item.project_id,
        "idempotency_key": item.idempotency_key,
        "task_id": item.task_id,
        "exit_code": item.exit_code,
        "result": item.result,
        "error": {"code": item.error_code, "message": item.error_message}
        if item.error_code
        else None,
        "duration_s": item.duration_s,
        "attempts": item.attempts,
        "output": {
            "lines": item.log_lines,
            "bytes": item.log_bytes,
            "dropped_lines": item.log_dropped_lines,
            "tail": _tail(session, item_id),
        },
        "cost": cost,
        "created_at": _at(item.created_at),
        "finished_at": _at(item.finished_at),
    }
    return FinalRecord(record, settled=cost["settled"])


def _cost(session: Session, item_id: str) -> dict[str, Any]:
    """The cost events of the item's sandboxes (through the sandboxes' indexes)."""
    sandboxes, billed, micros, seconds = session.execute(
        select(
            func.count(Sandbox.id),
            func.count(CostEvent.id),
            func.coalesce(func.sum(CostEvent.amount_micros), 0),
            func.coalesce(func.sum(CostEvent.seconds), 0.0),
        )
        .select_from(Sandbox)
        .outerjoin(CostEvent, CostEvent.sandbox_id == Sandbox.id)
        .where(Sandbox.work_item_id == item_id)
    ).one()
    return {
        "amount_micros": int(micros),
        "amount": format_micros(int(micros)),
        "seconds": round(float(seconds), 3),
        "sandboxes": int(sandboxes),
        "settled": billed == sandboxes,
    }


def _tail(session: Session, item_id: str) -> list[dict[str, str]]:
    """The output's last lines, oldest first, at most :data:`TAIL_CHARACTERS` of them."""
    rows = session.execute(
        select(WorkItemLog.stream, WorkItemLog.line)
        .where(WorkItemLog.work_item_id == item_id)
        .order_by(WorkItemLog.id.desc())
        .limit(TAIL_LINES)
    ).all()
    kept: list[dict[str, str]] = []
    room = TAIL_CHARACTERS
    for stream, line in rows:
        if len(line) > room:
            break
        room -= len(line)
        kept.append({"stream": stream, "line": line})
    return kept[::-1]


def _at(value: datetime | None) -> str | None:
    return value.isoformat() if value else None
