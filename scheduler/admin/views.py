"""How things read from the outside: work items (the api, ``corral show``), sandboxes
(``corral sandboxes list``) and costs (``GET /v1/costs``, ``corral costs``)."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import select, tuple_
from sqlalchemy.orm import Session

from corral.scheduler import admission
from corral.shared.store import estimates, pacing
from corral.shared.store.bundle_records import load_bundle_view
from corral.shared.store.db import Database
from corral.shared.store.leases import in_force
from corral.shared.store.ledger import CostGrouping, cost_report, format_micros
from corral.shared.store.models import (
    ItemState,
    LifecycleEvent,
    Pool,
    Sandbox,
    WorkItem,
    WorkItemLog,
)
from corral.shared.text import storable_line


def load_item_view(db: Database, item_id: str, *, max_attempts: int) -> dict[str, Any]:
    """The view of ``item_id`` with its current sandbox; ``max_attempts`` is the
    deployment's (``CORRAL_MAX_ATTEMPTS``), the lease of an item with no policy stored.

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
        pool = session.get(Pool, item.pool_id) if item.pool_id else None
        view = work_item_view(item, sandbox, pool.name if pool else None, max_attempts=max_attempts)
        view["bundle"] = load_bundle_view(session, item.id)
        view["waiting"] = _waiting_view(session, item)
        return view


def _waiting_view(session: Session, item: WorkItem) -> dict[str, Any] | None:
    """What holds a waiting item, its place (scheduler/admission.py) and when it may start
    (shared/store/estimates.py); None otherwise."""
    if item.wait_reason in pacing.PACE_REASONS and item.state in pacing.HELD_STATES:
        return _paced_view(session, item)
    if item.state != ItemState.WAITING_CAPACITY.value or item.wait_reason is None:
        return None
    ids = item.wait_pools or []
    rows = session.execute(select(Pool.id, Pool.name).where(Pool.id.in_(ids))) if ids else ()
    names = {pool_id: name for pool_id, name in rows}
    ahead = admission.ahead_of(session, item)
    return {
        "reason": item.wait_reason,
        "pools": [names.get(pool_id, pool_id) for pool_id in ids],
        "priority": (item.payload or {}).get("priority", "normal"),
        "ahead": ahead,
        **estimates.estimate_fields(estimates.waiting_estimate(session, item, ahead)),
    }


def _paced_view(session: Session, item: WorkItem) -> dict[str, Any]:
    """What holds a routed item its provider's pace keeps waiting (worker/pacing.py): its
    pool, when it may go, how many of its pool's paced items go before it and when its
    create may go by its pool's recent creates."""
    pool = session.get(Pool, item.pool_id) if item.pool_id else None
    ahead = pacing.paced_ahead(session, item)
    return {
        "reason": item.wait_reason,
        "pools": [pool.name] if pool else [],
        "priority": (item.payload or {}).get("priority", "normal"),
        "ahead": ahead,
        "until": item.not_before.isoformat() if item.not_before else None,
        **estimates.estimate_fields(estimates.paced_estimate(session, item, ahead)),
    }


def item_of_task(db: Database, task_id: str) -> str | None:
    """The work item a ``corral.dispatch`` message made, by the message's Celery task id
    (indexed on the item); None: no item of that task, or an id no item can keep (not one
    line of printable text, at most 255 characters: its item is keyed by its digest)."""
    if storable_line(task_id) is None:
        return None
    query = select(WorkItem.id).where(WorkItem.task_id == task_id).order_by(WorkItem.created_at)
    with db.session() as session:
        return session.scalars(query.limit(1)).first()


def task_of_item(db: Database, item_id: str) -> str | None:
    """The Celery task id of the message that made ``item_id`` (None: it came over HTTP)."""
    with db.session() as session:
        return session.scalar(select(WorkItem.task_id).where(WorkItem.id == item_id))


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


def load_events(db: Database, item_id: str) -> list[dict[str, Any]]:
    """Every lifecycle event of the item (its own, its sandboxes'), oldest first."""
    query = (
        select(LifecycleEvent)
        .where(LifecycleEvent.work_item_id == item_id)
        .order_by(LifecycleEvent.id)
    )
    with db.session() as session:
        return [
            {
                "entity": r.entity,
                "entity_id": r.entity_id,
                "from": r.from_state,
                "to": r.to_state,
                "actor": r.actor,
                "detail": r.detail,
                "at": r.created_at,
            }
            for r in session.scalars(query)
        ]


def load_item_sandboxes(db: Database, item_id: str) -> list[dict[str, Any]]:
    """Every sandbox made for the item, one per attempt, first attempt first, each with its
    end log (the last lines of its provider's log, when it ended before its runner
    reported)."""
    query = select(Sandbox).where(Sandbox.work_item_id == item_id).order_by(Sandbox.attempt)
    with db.session() as session:
        return [
            {**sandbox_row(sandbox), "end_log": sandbox.end_log}
            for sandbox in session.scalars(query)
        ]


def load_state_changes(db: Database, item_id: str, *, after: int = 0) -> list[dict[str, Any]]:
    """The item's state changes after event ``after``, oldest first: id, state, when."""
    query = (
        select(LifecycleEvent.id, LifecycleEvent.to_state, LifecycleEvent.created_at)
        .where(
            LifecycleEvent.work_item_id == item_id,
            LifecycleEvent.entity == "work_item",
            LifecycleEvent.id > after,
        )
        .order_by(LifecycleEvent.id)
    )
    with db.session() as session:
        return [{"id": i, "state": state, "at": at} for i, state, at in session.execute(query)]


def work_item_view(
    item: WorkItem, sandbox: Sandbox | None, pool_name: str | None = None, *, max_attempts: int
) -> dict[str, Any]:
    stamp = {
        name: value.isoformat() if value else None
        for name, value in (
            ("created_at", item.created_at),
            ("routed_at", item.routed_at),
            ("provisioned_at", item.provisioned_at),
            ("claimed_at", item.claimed_at),
            ("finished_at", item.finished_at),
            ("not_before", item.not_before),
            ("expires_at", item.expires_at),
        )
    }
    return {
        "id": item.id,
        "org": item.org_id,
        "project": item.project_id,
        "profile": item.profile,
        "state": item.state,
        "pool_id": item.pool_id,
        "pool": pool_name,
        "queue": item.queue,
        "attempts": item.attempts,
        "lease": asdict(in_force(item.lease, max_attempts=max_attempts)),
        "exit_code": item.exit_code,
        "result": item.result,
        "duration_s": item.duration_s,
        "error": {"code": item.error_code, "message": item.error_message}
        if item.error_code
        else None,
        "sandbox": None
        if sandbox is None
        else {
            "id": sandbox.id,
            "provider_id": sandbox.provider_id,
            "external_id": sandbox.external_id,
            "status": sandbox.status,
            "termination_reason": sandbox.termination_reason,
            "end_log": sandbox.end_log,
        },
        "timestamps": stamp,
        "logs": {
            "lines": item.log_lines,
            "bytes": item.log_bytes,
            "dropped_lines": item.log_dropped_lines,
        },
        "waiting": None,  # what holds a waiting item: load_item_view's
    }


@dataclass(frozen=True)
class ItemFilter:
    """Which work items a listing holds (every field left None: no condition)."""

    org_id: str | None = None
    states: list[ItemState] | None = None
    since: datetime | None = None  # created at or after
    until: datetime | None = None  # created before
    project: str | None = None
    idempotency_key: str | None = None
    pool_id: str | None = None
    provider: str | None = None
    task_id: str | None = None  # the Celery task id of the message that made it

    def conditions(self) -> list[Any]:
        found: list[Any] = []
        for column, value in (
            (WorkItem.org_id, self.org_id),
            (WorkItem.project_id, self.project),
            (WorkItem.idempotency_key, self.idempotency_key),
            (WorkItem.pool_id, self.pool_id),
            (Pool.provider_id, self.provider),
            (WorkItem.task_id, self.task_id),
        ):
            if value is not None:
                found.append(column == value)
        if self.states:
            found.append(WorkItem.state.in_([state.value for state in self.states]))
        if self.since is not None:
            found.append(WorkItem.created_at >= self.since)
        if self.until is not None:
            found.append(WorkItem.created_at < self.until)
        return found


def list_items(
    db: Database,
    *,
    org_id: str | None = None,
    states: list[ItemState] | None = None,
    since: datetime | None = None,
    limit: int = 50,
    pool_id: str | None = None,
    before: tuple[datetime, str] | None = None,
    where: ItemFilter | None = None,
) -> list[dict[str, Any]]:
    """Work items, newest first, with their pool's name; with ``before`` (the created_at
    and id of the last item of a page), the page after it. ``where`` holds the other
    filters (the keyword ones are its fields, for the callers that have only those)."""
    where = where or ItemFilter(org_id=org_id, states=states, since=since, pool_id=pool_id)
    query = (
        select(WorkItem, Pool.name)
        .outerjoin(Pool, Pool.id == WorkItem.pool_id)
        .where(*where.conditions())
        .order_by(WorkItem.created_at.desc(), WorkItem.id.desc())
        .limit(limit)
    )
    if before is not None:
        query = query.where(tuple_(WorkItem.created_at, WorkItem.id) < tuple_(*before))
    with db.session() as session:
        return [_item_row(item, pool_name) for item, pool_name in session.execute(query)]


def _item_row(item: WorkItem, pool_name: str | None) -> dict[str, Any]:
    return {
        "id": item.id,
        "org": item.org_id,
        "project": item.project_id,
        "idempotency_key": item.idempotency_key,
        "task_id": item.task_id,
        "state": item.state,
        "pool": pool_name,
        "queue": item.queue,
        "error_code": item.error_code,
        "exit_code": item.exit_code,
        "created_at": item.created_at.isoformat(),
        "finished_at": item.finished_at.isoformat() if item.finished_at else None,
    }


def item_state(db: Database, item_id: str) -> tuple[str, str | None, str | None] | None:
    """The item's state, error code and error message (None: no such item)."""
    with db.session() as session:
        row = session.execute(
            select(WorkItem.state, WorkItem.error_code, WorkItem.error_message).where(
                WorkItem.id == item_id
            )
        ).one_or_none()
    return None if row is None else (row[0], row[1], row[2])


def list_sandboxes(
    db: Database,
    *,
    statuses: list[str] | None = None,
    org_id: str | None = None,
    limit: int = 50,
) -> list[dict[str, Any]]:
    """Sandboxes, newest first; with ``statuses``, only those (a (status, created_at) index)."""
    query = select(Sandbox).order_by(Sandbox.created_at.desc()).limit(limit)
    if statuses:
        query = query.where(Sandbox.status.in_(statuses))
    if org_id is not None:
        query = query.where(Sandbox.org_id == org_id)
    with db.session() as session:
        return [sandbox_row(sandbox) for sandbox in session.scalars(query)]


def sandbox_row(sandbox: Sandbox) -> dict[str, Any]:
    def at(value: datetime | None) -> str | None:
        return value.isoformat() if value else None

    return {
        "id": sandbox.id,
        "work_item_id": sandbox.work_item_id,
        "attempt": sandbox.attempt,
        "org_id": sandbox.org_id,
        "pool_id": sandbox.pool_id,
        "provider_id": sandbox.provider_id,
        "external_id": sandbox.external_id,
        "status": sandbox.status,
        "created_at": at(sandbox.created_at),
        "started_at": at(sandbox.started_at),
        "deadline_at": at(sandbox.deadline_at),
        "last_heartbeat_at": at(sandbox.last_heartbeat_at),
        "terminated_at": at(sandbox.terminated_at),
        "termination_reason": sandbox.termination_reason,
    }


def cost_view(
    db: Database, *, by: CostGrouping, org_id: str | None, since: datetime | None
) -> dict[str, Any]:
    """Cost totals grouped ``by``, with the grand total; amounts in micro-units and as text."""
    rows = cost_report(db, by=by, org_id=org_id, since=since)
    total = sum(row.amount_micros for row in rows)
    return {
        "by": by.value,
        "org": org_id,
        "since": since.isoformat() if since else None,
        "rows": [
            {
                by.value: row.key,
                "events": row.events,
                "seconds": round(row.seconds, 3),
                "amount_micros": row.amount_micros,
                "amount": format_micros(row.amount_micros),
                "cpu_estimated_events": row.cpu_estimated_events,
            }
            for row in rows
        ],
        "total": {
            "events": sum(row.events for row in rows),
            "seconds": round(sum(row.seconds for row in rows), 3),
            "amount_micros": total,
            "amount": format_micros(total),
        },
    }
