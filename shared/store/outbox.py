"""The outcome outbox: what a change owes others, written in the transaction that made it.

Three kinds of change owe outcomes, each noted where it is written, once:

- a work item's end (:class:`Ended`): every path that moves an item to a final state notes
  it with :func:`corral.shared.store.outcomes.note_final` (the lifecycle's
  :func:`transition` and :func:`transition_items`, the batched intake's dispatch errors),
  and at that transaction's commit :func:`write_owed` writes what it owes;
- a sandbox's end, billed (:class:`Billed`): :func:`corral.shared.store.ledger.record_costs`,
  the one writer of cost events, calls :func:`write_billed` beside the events it writes;
- a budget's threshold crossed (:class:`Crossed`): :func:`corral.shared.store.lifecycle.
  warn_budget`, which records each crossing once per period, calls :func:`write_crossed`.

So whichever path made the change, it leaves the same rows, and a rolled-back change
leaves none. What each kind owes is asked of its sources, in order, one per sink and event:
:data:`OWED` for an item's end (``celery``: a result stored under each Celery task id that
named the item, and its callbacks sent; ``webhook``: an ``item.final`` event, and an
``item.dispatch_error`` one for a dispatch error, to each live endpoint of the item's org
subscribed to it), :data:`OWED_BILLED` (``sandbox.ended``) and :data:`OWED_CROSSED`
(``budget.threshold``): corral.shared.store.webhooks. A sink added later adds its source
here and its deliverer beside the others (corral.worker.outcome_sinks).

An item's record is read when it is delivered (its cost settles after its end); a sandbox's
end and a budget's crossing carry theirs in the row (the target's ``data``), as they were
when written.

The maintenance worker delivers each row at least once (corral.worker.outcome_delivery): it
claims due rows (:func:`claim_due`), deletes those delivered (:func:`delivered`), and backs
off (:func:`retry`) or gives up (:func:`give_up`, the row kept with ``failed_at``) on the rest.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any, Protocol, TypeVar, cast

from sqlalchemy import Table, delete, func, insert, select, update
from sqlalchemy.orm import Session

from corral.shared.store import webhooks
from corral.shared.store.db import Database, utcnow
from corral.shared.store.models import FINAL_ITEM_STATES, ItemState, OutcomeOutbox, WorkItem

OUTBOX = cast(Table, OutcomeOutbox.__table__)
CELERY = "celery"
MAX_REPLIES = 100  # messages one item answers; a key named more often answers the first ones


class Owing(Protocol):
    """A change that owes events: whose it is, its item (if any), when, and what it says."""

    @property
    def org_id(self) -> str: ...

    @property
    def item_id(self) -> str | None: ...

    @property
    def at(self) -> datetime | None: ...

    @property
    def data(self) -> Mapping[str, Any] | None: ...


@dataclass(frozen=True)
class Ended:
    """An item that reached a final state, as its ending transaction wrote it."""

    item_id: str
    org_id: str
    outcome: str
    replies: Sequence[Mapping[str, Any]] | None = None
    at: datetime | None = None  # the instant of its end (its finished_at)

    @property
    def data(self) -> None:
        """None: an item's record is read when it is delivered, its cost settled by then."""
        return None


@dataclass(frozen=True)
class Billed:
    """A sandbox whose cost event was written: its end as that transaction billed it."""

    sandbox_id: str
    item_id: str
    org_id: str
    at: datetime  # when it ended
    data: Mapping[str, Any]  # ledger.sandbox_end_record: why, how long, what it cost


@dataclass(frozen=True)
class Crossed:
    """A budget threshold its spend reached, recorded once in its period."""

    budget_id: str
    org_id: str
    threshold_pct: int
    at: datetime
    data: Mapping[str, Any]  # budgets.crossing_record
    item_id: None = None


@dataclass(frozen=True)
class Owed:
    """One outcome a change owes: the sink that delivers it, where to, and since when."""

    item_id: str | None
    org_id: str
    sink: str
    target: Mapping[str, Any]
    at: datetime


Fact = TypeVar("Fact", bound=Owing)
Source = Callable[[Session, Sequence[Fact], datetime], list[Owed]]


def _celery_replies(session: Session, ended: Sequence[Ended], now: datetime) -> list[Owed]:
    """One result (and its callbacks) per Celery message that named the item."""
    return [
        Owed(e.item_id, e.org_id, CELERY, dict(reply), e.at or now)
        for e in ended
        for reply in e.replies or ()
    ]


def _webhook_events(event: str, wanted: Callable[[Fact], bool] | None = None) -> Source[Fact]:
    """A source of ``event``: one per change (of those ``wanted``) and live endpoint of its
    org subscribed to it, carrying the change's data."""

    def source(session: Session, changes: Sequence[Fact], now: datetime) -> list[Owed]:
        chosen = [c for c in changes if wanted is None or wanted(c)]
        endpoints = webhooks.subscribed(session, [c.org_id for c in chosen], event)
        owed = []
        for change in chosen:
            at = change.at or now
            for endpoint_id in endpoints.get(change.org_id, ()):
                target = webhooks.event_target(endpoint_id, event, at.isoformat(), change.data)
                owed.append(Owed(change.item_id, change.org_id, webhooks.WEBHOOK, target, at))
        return owed

    source.__name__ = f"webhook_{event}"
    return source


def _dispatch_error(ended: Ended) -> bool:
    return ended.outcome == ItemState.DISPATCH_ERROR.value


OWED: tuple[Source[Ended], ...] = (
    _celery_replies,
    _webhook_events(webhooks.ITEM_FINAL),
    _webhook_events(webhooks.ITEM_DISPATCH_ERROR, _dispatch_error),
)
"""What an ended item owes, one source per sink and event, asked in this order (``now``: the
instant of an end that does not say its own)."""
OWED_BILLED: tuple[Source[Billed], ...] = (_webhook_events(webhooks.SANDBOX_ENDED),)
"""What a sandbox's billed end owes."""
OWED_CROSSED: tuple[Source[Crossed], ...] = (_webhook_events(webhooks.BUDGET_THRESHOLD),)
"""What a budget's crossed threshold owes."""


def outbox_row(owed: Owed) -> dict[str, Any]:
    """The outbox row of ``owed``, due at once."""
    return {
        "work_item_id": owed.item_id,
        "org_id": owed.org_id,
        "sink": owed.sink,
        "target": dict(owed.target),
        "created_at": owed.at,
        "due_at": owed.at,
        "attempts": 0,
        "last_error": None,
        "failed_at": None,
    }


def _write(
    session: Session, sources: Sequence[Source[Fact]], changes: Sequence[Fact], now: datetime
) -> None:
    rows = [outbox_row(owed) for source in sources for owed in source(session, changes, now)]
    if rows:
        session.flush()  # the changes' own rows first: the outbox points at them
        session.execute(insert(OUTBOX), rows)


def write_owed(session: Session, ended: Iterable[Ended], *, now: datetime | None = None) -> None:
    """Write the outbox rows the items in ``ended`` owe, in ``session``'s transaction (the
    one that ended them), each from the instant of its end. An item noted twice owes once."""
    unique = list({e.item_id: e for e in ended}.values())
    _write(session, OWED, unique, now or utcnow())


def write_billed(session: Session, billed: Sequence[Billed]) -> None:
    """Write the outbox rows the sandboxes in ``billed`` owe, in the transaction that wrote
    their cost events (one per sandbox: the ledger's unique key)."""
    _write(session, OWED_BILLED, billed, utcnow())


def write_crossed(session: Session, crossed: Sequence[Crossed]) -> None:
    """Write the outbox rows the budget crossings in ``crossed`` owe, in the transaction
    that recorded them (once per threshold and period: lifecycle.warn_budget)."""
    _write(session, OWED_CROSSED, crossed, utcnow())


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
            owed = Owed(item.id, item.org_id, CELERY, reply, utcnow())
            session.execute(insert(OUTBOX), [outbox_row(owed)])


@dataclass(frozen=True)
class OutboxRow:
    """A claimed outbox row, as its deliverer reads it."""

    id: int
    work_item_id: str | None
    org_id: str
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
            OutboxRow(
                row.id,
                row.work_item_id,
                row.org_id,
                row.sink,
                row.target,
                row.attempts,
                row.created_at,
            )
            for row in rows
        ]


def delivered(db: Database, row_ids: Sequence[int]) -> None:
    """The rows ``row_ids`` were delivered: they go."""
    if row_ids:
        with db.session() as session:
            session.execute(delete(OutcomeOutbox).where(OutcomeOutbox.id.in_(row_ids)))


def postpone(db: Database, row_ids: Sequence[int], *, until: datetime) -> None:
    """The rows ``row_ids`` are put off (their items' cost is not settled, or the run's
    claim on them is ending): due again at ``until``, no try counted."""
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
