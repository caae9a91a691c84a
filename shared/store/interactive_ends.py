"""An interactive session's end, by a call or by the reaper's session rule: its row, its
work item and the sandbox to end with it. Storage and lifecycle only: no HTTP, so the
maintenance worker loads none of the api (the api's routes are scheduler/api/interactive_api.py,
its request models scheduler/api/interactive.py)."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta

from sqlalchemy import select
from sqlalchemy.orm import Session

from corral.shared.store.db import Database
from corral.shared.store.lifecycle import end_session, transition
from corral.shared.store.models import (
    InteractiveSession,
    ItemState,
    Sandbox,
    TerminationReason,
    WorkItem,
)


def current_sandbox(session: Session, item: WorkItem) -> Sandbox | None:
    """The sandbox of the item's current attempt, if it has one."""
    return session.scalars(
        select(Sandbox).where(Sandbox.work_item_id == item.id, Sandbox.attempt == item.attempts)
    ).one_or_none()


def close_session(
    db: Database, session_id: str, reason: str, *, actor: str, detail: str
) -> str | None:
    """End a live session and cancel its work item; the id of the sandbox to end now (None:
    it had ended, or has no sandbox yet). Its sandbox is ended anyway (the item's end
    requests it: the reaper's ``finished`` rule).

    Raises:
        LookupError: no such session.
    """
    with db.session() as session:
        row, item = _locked(session, session_id)
        if row.ended_at is not None:
            return None
        return _end_locked(session, row, item, reason, actor=actor, detail=detail)


def _locked(session: Session, session_id: str) -> tuple[InteractiveSession, WorkItem | None]:
    """The session and its work item, locked: the item first, the order every path that
    locks an item and its sandbox or session uses.

    Raises:
        LookupError: no such session.
    """
    found = session.execute(
        select(InteractiveSession.work_item_id, InteractiveSession.org_id).where(
            InteractiveSession.id == session_id
        )
    ).one_or_none()
    if found is None:
        raise LookupError(f"session {session_id} does not exist")
    item_id, org_id = found
    if item_id is None:  # its creation stopped before it noted its item: find it by its key
        item_id = session.scalar(
            select(WorkItem.id).where(
                WorkItem.org_id == org_id, WorkItem.idempotency_key == session_item_key(session_id)
            )
        )
    item = session.get(WorkItem, item_id, with_for_update=True) if item_id else None
    row = session.get(InteractiveSession, session_id, with_for_update=True)
    assert row is not None
    if item is not None:
        row.work_item_id = item.id
    return row, item


def session_item_key(session_id: str) -> str:
    """The idempotency key of a session's work item."""
    return f"session:{session_id}"


def _end_locked(
    session: Session,
    row: InteractiveSession,
    item: WorkItem | None,
    reason: str,
    *,
    actor: str,
    detail: str,
) -> str | None:
    end_session(session, row, reason, actor=actor, detail=detail)
    if item is None:
        return None
    sandbox = current_sandbox(session, item)
    if not ItemState(item.state).is_final:
        transition(session, item, ItemState.CANCELLED, actor=actor, detail=f"session {reason}")
    if sandbox is None or sandbox.terminated_at is not None:
        return None
    return sandbox.id


@dataclass(frozen=True)
class Lapsed:
    """A session the reaper ended: the sandbox to end with it (if any), and why."""

    session_id: str
    sandbox_id: str | None
    reason: TerminationReason
    detail: str


def lapsed_sessions(db: Database, now: datetime, *, limit: int, actor: str) -> list[Lapsed]:
    """The reaper's session rule: end the live sessions past their ``ttl_s`` or idle past
    their ``idle_ttl_s`` (at most ``limit`` of each), cancelling their work items; the
    sandboxes the caller ends with them. Idle time counts from when the session was ready:
    one still provisioning has its idle clock moved on instead."""
    live = InteractiveSession.ended_at.is_(None)
    with db.session() as session:
        due = list(
            session.scalars(
                select(InteractiveSession.id)
                .where(live, InteractiveSession.expires_at < now)
                .order_by(InteractiveSession.expires_at)
                .limit(limit)
            )
        )
        due += session.scalars(
            select(InteractiveSession.id)
            .where(live, InteractiveSession.idle_until < now)
            .order_by(InteractiveSession.idle_until)
            .limit(limit)
        )
    ended: list[Lapsed] = []
    for session_id in dict.fromkeys(due):
        with db.session() as session:
            lapsed = _lapse(session, session_id, now, actor)
        if lapsed is not None:
            ended.append(lapsed)
    return ended


def _lapse(session: Session, session_id: str, now: datetime, actor: str) -> Lapsed | None:
    row, item = _locked(session, session_id)
    if row.ended_at is not None:
        return None
    if row.expires_at < now:
        reason, detail = TerminationReason.SESSION_EXPIRED, f"past its ttl_s of {row.ttl_s} s"
    elif row.idle_until >= now:
        return None  # a call moved its clock since the read
    elif item is not None and not ItemState(item.state).is_final:
        ready_at = item.claimed_at
        idle_from = ready_at + timedelta(seconds=row.idle_ttl_s) if ready_at else None
        if idle_from is None or idle_from > now:
            # Not ready yet, or ready for less than its idle TTL: idle from then on.
            row.idle_until = idle_from or now + timedelta(seconds=row.idle_ttl_s)
            return None
        reason = TerminationReason.SESSION_IDLE
        detail = f"no exec or file call for {row.idle_ttl_s} s"
    else:
        reason = TerminationReason.SESSION_IDLE
        detail = "its work item had ended" if item else "its creation did not finish"
    sandbox_id = _end_locked(session, row, item, reason.value, actor=actor, detail=detail)
    return Lapsed(session_id, sandbox_id, reason, detail)
