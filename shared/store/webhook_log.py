"""The webhook delivery log: each try at delivering an event, and redelivery by hand.

The webhook sink (corral.worker.outcome_sinks.webhook) notes every try it makes
(:func:`record_try`): the endpoint, the event's id and type, its item, the try's number, the
endpoint's HTTP status or the error that stood for one, and when. The log is read per
endpoint, newest first (:func:`deliveries`), and pruned of tries older than
``CORRAL_WEBHOOK_LOG_KEEP_S`` (:func:`prune`, hourly, by the maintenance worker), so that
what it holds grows with recent traffic, not with history.

:func:`redeliver` owes an event again, with its own id (a receiver that has it may answer
2xx and do nothing): its outbox row, pending or given up, is made due at once with its
tries counted from nothing; once delivered (the row gone), a new row is written from the
target its last try kept. An event whose endpoint was removed is not owed again.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import delete, insert, select
from sqlalchemy.orm import Session

from corral.shared.errors import CorralError
from corral.shared.store import webhooks
from corral.shared.store.db import Database
from corral.shared.store.models import OutcomeOutbox, WebhookDelivery, WebhookEndpoint
from corral.shared.store.outbox import OUTBOX, OutboxRow, Owed, outbox_row

MAX_PAGE = 200  # tries one read of the log answers at most


class UnknownEventError(CorralError, LookupError):
    """no such webhook event of this org in the delivery log or the outbox"""

    code = "webhook_event_unknown"


class EndpointRemovedError(CorralError):
    """the event's webhook endpoint was removed: it is owed nothing more"""

    code = "webhook_endpoint_removed"


@dataclass(frozen=True)
class Try:
    """What became of one try: the endpoint's HTTP status, or the error that stood for one."""

    status: int | None
    error: str | None
    at: datetime


def record_try(db: Database, row: OutboxRow, outcome: Try) -> None:
    """Note a try at delivering ``row`` (a ``webhook`` outbox row), its number counted from
    the row's tries before it."""
    target = row.target
    values = {
        "endpoint_id": target["endpoint_id"],
        "org_id": row.org_id,
        "event_id": target["event_id"],
        "event_type": target["type"],
        "work_item_id": row.work_item_id,
        "outbox_id": row.id,
        "attempt": row.attempts + 1,
        "status": outcome.status,
        "error": None if outcome.error is None else outcome.error[:2000],
        "at": outcome.at,
        "event": dict(target),
    }
    with db.session() as session:
        session.execute(insert(WebhookDelivery), [values])


def _owed_state(row: OutcomeOutbox | None, event_id: str) -> str | None:
    """``pending`` or ``given_up`` while the event is in the outbox; None once it is not."""
    if row is None or row.target.get("event_id") != event_id:
        return None
    return "pending" if row.failed_at is None else "given_up"


def deliveries(
    session: Session, org_id: str, endpoint_id: str, *, limit: int, before: int | None = None
) -> list[dict[str, Any]]:
    """The tries at delivering the events of ``org_id``'s endpoint, newest first, at most
    ``limit`` (up to :data:`MAX_PAGE`), those older than the try ``before`` when given.
    Each says, as ``owed``, whether the outbox row it was of still holds the event."""
    query = (
        select(WebhookDelivery, OutcomeOutbox)
        .outerjoin(OutcomeOutbox, OutcomeOutbox.id == WebhookDelivery.outbox_id)
        .where(WebhookDelivery.endpoint_id == endpoint_id, WebhookDelivery.org_id == org_id)
        .order_by(WebhookDelivery.id.desc())
        .limit(max(1, min(limit, MAX_PAGE)))
    )
    if before is not None:
        query = query.where(WebhookDelivery.id < before)
    return [
        {
            "id": entry.id,
            "endpoint_id": entry.endpoint_id,
            "event_id": entry.event_id,
            "event_type": entry.event_type,
            "work_item_id": entry.work_item_id,
            "attempt": entry.attempt,
            "status": entry.status,
            "error": entry.error,
            "at": entry.at,
            "owed": _owed_state(owed, entry.event_id),
        }
        for entry, owed in session.execute(query)
    ]


def _last_try(session: Session, org_id: str, event_id: str) -> WebhookDelivery | None:
    query = (
        select(WebhookDelivery)
        .where(WebhookDelivery.event_id == event_id, WebhookDelivery.org_id == org_id)
        .order_by(WebhookDelivery.id.desc())
        .limit(1)
    )
    return session.scalars(query).first()


def _outbox_row(session: Session, org_id: str, event_id: str) -> OutcomeOutbox | None:
    """The org's outbox row that holds ``event_id``, locked: a scan of the org's webhook
    rows, for a redelivery by hand that the log does not lead to the row."""
    query = select(OutcomeOutbox).where(
        OutcomeOutbox.sink == webhooks.WEBHOOK,
        OutcomeOutbox.org_id == org_id,
        OutcomeOutbox.target["event_id"].as_string() == event_id,
    )
    return session.scalars(query.with_for_update()).first()


def _held_row(
    session: Session, org_id: str, event_id: str, last: WebhookDelivery | None
) -> OutcomeOutbox | None:
    """The outbox row that still holds the event, locked; None once it was delivered (and
    not owed again since)."""
    if last is not None and last.outbox_id is not None:
        row = session.get(OutcomeOutbox, last.outbox_id, with_for_update=True)
        if row is not None and row.target.get("event_id") == event_id:
            return row
    # Never tried, its tries pruned, or its row gone (delivered, or an id used again on
    # SQLite): a row owed again since the last try is found this way too.
    return _outbox_row(session, org_id, event_id)


def redeliver(session: Session, org_id: str, event_id: str, *, now: datetime) -> dict[str, Any]:
    """Owe ``org_id``'s event ``event_id`` again, due at ``now``: what was done. Under its
    endpoint's row lock, so that two redeliveries at once owe it once.

    Raises:
        UnknownEventError: neither the log nor the outbox knows the event (another org's
            answers the same).
        EndpointRemovedError: its endpoint was removed.
    """
    last, found = _last_try(session, org_id, event_id), None
    if last is not None:
        target = dict(last.event)
    else:
        found = _outbox_row(session, org_id, event_id)
        if found is None:
            raise UnknownEventError()
        target = dict(found.target)
    endpoint = session.get(WebhookEndpoint, target["endpoint_id"], with_for_update=True)
    if endpoint is None or endpoint.org_id != org_id or endpoint.disabled_at is not None:
        raise EndpointRemovedError()
    row = found or _held_row(session, org_id, event_id, last)
    if row is not None:
        row.failed_at, row.last_error, row.attempts, row.due_at = None, None, 0, now
    else:
        item_id = last.work_item_id if last is not None else None
        owed = Owed(item_id, org_id, webhooks.WEBHOOK, target, now)
        session.execute(insert(OUTBOX), [outbox_row(owed)])
    return {
        "event_id": event_id,
        "endpoint_id": target["endpoint_id"],
        "event_type": target["type"],
        "due_at": now,
    }


def prune(db: Database, *, before: datetime) -> int:
    """Delete the tries made before ``before``; how many."""
    with db.session() as session:
        result = session.execute(delete(WebhookDelivery).where(WebhookDelivery.at < before))
        return int(getattr(result, "rowcount", 0) or 0)
