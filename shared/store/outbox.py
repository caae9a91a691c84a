"""The outcome outbox: what each ended work item owes, written in the transaction that ended it.

Every path that moves an item to a final state notes it with
:func:`corral.shared.store.outcomes.note_final` (the lifecycle's :func:`transition` and
:func:`transition_items`, the batched intake's dispatch errors); at that transaction's commit
:func:`write_owed` writes, beside the item's end, one row per outcome it owes. So whichever
path ended it, it leaves the same rows, and a rolled-back end leaves none.

What an ended item owes is asked of each source in :data:`OWED`, in order, one per sink:
``celery`` (the item's replies: a result stored under each Celery task id that named it,
and its callbacks sent), then ``webhook`` (an ``item.final`` event to each live endpoint of
the item's org that subscribed to it: corral.shared.store.webhooks). A sink added later adds
its source here and its deliverer beside the others (corral.worker.outcome_sinks).

The maintenance worker delivers each row at least once (corral.worker.outcome_delivery): it
claims due rows (:func:`claim_due`), deletes those delivered (:func:`delivered`), and backs
off (:func:`retry`) or gives up (:func:`give_up`, the row kept with ``failed_at``) on the rest.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any, cast

from sqlalchemy import Table, delete, func, insert, select, update
from sqlalchemy.orm import Session

from corral.shared.store import webhooks
from corral.shared.store.db import Database, utcnow
from corral.shared.store.models import FINAL_ITEM_STATES, ItemState, OutcomeOutbox, WorkItem

OUTBOX = cast(Table, OutcomeOutbox.__table__)
CELERY = "celery"
MAX_REPLIES = 100  # messages one item answers; a key named more often answers the first ones


@dataclass(frozen=True)
class Ended:
    """An item that reached a final state, as its ending transaction wrote it."""

    item_id: str
    org_id: str
    outcome: str
    replies: Sequence[Mapping[str, Any]] | None = None
    at: datetime | None = None  # the instant of its end (its finished_at)


@dataclass(frozen=True)
class Owed:
    """One outcome an ended item owes: the sink that delivers it, where to, and since when."""

    item_id: str
    sink: str
    target: Mapping[str, Any]
    at: datetime


def _celery_replies(session: Session, ended: Sequence[Ended], now: datetime) -> list[Owed]:
    """One result (and its callbacks) per Celery message that named the item."""
    return [
        Owed(e.item_id, CELERY, dict(reply), e.at or now)
        for e in ended
        for reply in e.replies or ()
    ]


def _webhook_events(session: Session, ended: Sequence[Ended], now: datetime) -> list[Owed]:
    """One ``item.final`` event per live endpoint of the item's org subscribed to it."""
    endpoints = webhooks.subscribed(session, [e.org_id for e in ended], webhooks.ITEM_FINAL)
    owed = []
    for e in ended:
        at = e.at or now
        for endpoint_id in endpoints.get(e.org_id, ()):
            target = webhooks.event_target(endpoint_id, webhooks.ITEM_FINAL, at.isoformat())
            owed.append(Owed(e.item_id, webhooks.WEBHOOK, target, at))
    return owed


OWED: tuple[Callable[[Session, Sequence[Ended], datetime], list[Owed]], ...] = (
    _celery_replies,
    _webhook_events,
)
"""What an ended item owes, one source per sink, asked in this order (``now``: the instant of
an end that does not say its own)."""


def outbox_row(owed: Owed) -> dict[str, Any]:
    """The outbox row of ``owed``, due at once."""
    return {
        "work_item_id": owed.item_id,
        "sink": owed.sink,
        "target": dict(owed.target),
        "created_at": owed.at,
        "due_at": owed.at,
        "attempts": 0,
        "last_error": None,
        "failed_at": None,
    }


def write_owed(session: Session, ended: Iterable[Ended], *, now: datetime | None = None) -> None:
    """Write the outbox rows the items in ``ended`` owe, in ``session``'s transaction (the
    one that ended them), each from the instant of its end. An item noted twice owes once."""
    unique = list({e.item_id: e for e in ended}.values())
    at = now or utcnow()
    rows = [outbox_row(owed) for source in OWED for owed in source(session, unique, at)]
    if rows:
        session.flush()  # the items' own rows first: the outbox points at them
        session.execute(insert(OUTBOX), rows)


def add_reply(db: Database, item_id: str, reply: Mapping[str, Any]) -> None:
    """``item_id`` owes ``reply`` too: a later Celery message named the item by its
    idempotency key. Owed at its end, or at once when it has ended already.

    Under the item's row lock, which every final transition holds: either the reply is
    among those its end reads, or the end came first and the row is written here. A reply
    already owed (the same task id: a second delivery) is not owed twice.
    """
    with db.session() as session:
        item = session.get(WorkItem, item_id, with_for_update=True)
        if item is None:
            return
        replies = list(item.replies or [])
        known = {r.get("task_id") for r in replies}
        if reply.get("task_id") in known or len(replies) >= MAX_REPLIES:
            return
        item.replies = [*replies, dict(reply)]
        if ItemState(item.state) in FINAL_ITEM_STATES:
            session.flush()
            owed = Owed(item.id, CELERY, reply, utcnow())
            session.execute(insert(OUTBOX), [outbox_row(owed)])


@dataclass(frozen=True)
class OutboxRow:
    """A claimed outbox row, as its deliverer reads it."""

    id: int
    work_item_id: str
    sink: str
    target: Mapping[str, Any]
    attempts: int
    created_at: datetime


def claim_due(db: Database, *, now: datetime, limit: int, lease_s: float) -> list[OutboxRow]:
    """Up to ``limit`` rows due at ``now``, oldest first, each made due again only after
    ``lease_s`` (a deliverer that dies with them leaves them to the next). On PostgreSQL
    rows another deliverer holds are skipped, not waited for."""
    query = (
        select(OutcomeOutbox)
        .where(OutcomeOutbox.failed_at.is_(None), OutcomeOutbox.due_at <= now)
        .order_by(OutcomeOutbox.due_at, OutcomeOutbox.id)
        .limit(limit)
        .with_for_update(skip_locked=True)
    )
    with db.session() as session:
        rows = session.scalars(query).all()
        for row in rows:
            row.due_at = now + timedelta(seconds=lease_s)
        return [
            OutboxRow(row.id, row.work_item_id, row.sink, row.target, row.attempts, row.created_at)
            for row in rows
        ]


def delivered(db: Database, row_ids: Sequence[int]) -> None:
    """The rows ``row_ids`` were delivered: they go."""
    if row_ids:
        with db.session() as session:
            session.execute(delete(OutcomeOutbox).where(OutcomeOutbox.id.in_(row_ids)))


def postpone(db: Database, row_ids: Sequence[int], *, until: datetime) -> None:
    """The rows ``row_ids`` are not ready (their items' cost is not settled): due again at
    ``until``, no try counted."""
    if row_ids:
        with db.session() as session:
            session.execute(
                update(OutcomeOutbox).where(OutcomeOutbox.id.in_(row_ids)).values(due_at=until)
            )


def retry(db: Database, row: OutboxRow, *, error: str, due_at: datetime) -> None:
    """A try at ``row`` failed with ``error``: counted, and due again at ``due_at``."""
    values = {"attempts": row.attempts + 1, "last_error": error[:2000], "due_at": due_at}
    with db.session() as session:
        session.execute(update(OutcomeOutbox).where(OutcomeOutbox.id == row.id).values(values))


def give_up(db: Database, row: OutboxRow, *, error: str, now: datetime) -> None:
    """The last try at ``row`` failed: it is kept as failed, never tried again."""
    values = {"attempts": row.attempts + 1, "last_error": error[:2000], "failed_at": now}
    with db.session() as session:
        session.execute(update(OutcomeOutbox).where(OutcomeOutbox.id == row.id).values(values))


def counts(db: Database) -> dict[tuple[str, str], int]:
    """Rows by sink and status (``pending``, ``failed``)."""
    status = OutcomeOutbox.failed_at.is_(None)
    query = select(OutcomeOutbox.sink, status, func.count()).group_by(OutcomeOutbox.sink, status)
    with db.session() as session:
        return {
            (sink, "pending" if pending else "failed"): int(number)
            for sink, pending, number in session.execute(query)
        }


def prune(db: Database, *, before: datetime) -> int:
    """Delete the rows given up before ``before``; how many."""
    with db.session() as session:
        result = session.execute(
            delete(OutcomeOutbox).where(
                OutcomeOutbox.failed_at.is_not(None), OutcomeOutbox.failed_at < before
            )
        )
        return int(getattr(result, "rowcount", 0) or 0)
