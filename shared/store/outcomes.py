"""What became of the work items: owed and counted when the transaction that ended them commits.

:func:`note_final` is called by every path that moves an item to a final state (the
lifecycle's transitions, the batched intake's dispatch errors). Just before that session
commits, the outcomes the items owe are written in its transaction (the outcome outbox:
:func:`corral.shared.store.outbox.write_owed`); the counts are made after it commits and
dropped if it rolls back, so a retried transaction counts once.

- ``corral_items_finished_total{outcome, code, provider, org}``: items that reached a final
  state (``succeeded``, ``failed``, ``cancelled``, ``dispatch_error``), with the error code
  they ended with (empty for success) and the provider of their pool (empty when they never
  had one);
- ``corral_dispatch_errors_total{code, org}``: of those, the dispatch errors
  (``no_eligible_pool``, ``invalid_message``, …);
- ``corral_dispatch_to_finished_seconds{outcome, provider}``: from intake to the final state.

``org`` is the item's org when ``CORRAL_METRICS_ORG_LABELS`` is on and empty otherwise: one
series per org is affordable for tens of orgs, not for tens of thousands.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from datetime import datetime
from typing import Any

from prometheus_client import Counter, Histogram
from sqlalchemy import event, select
from sqlalchemy.orm import Session

from corral.shared.store.db import utcnow
from corral.shared.store.models import Pool, WorkItem
from corral.shared.store.outbox import Ended, write_owed

ITEMS_FINISHED = Counter(
    "corral_items_finished",
    "Work items that reached a final state, by outcome, error code and provider.",
    ["outcome", "code", "provider", "org"],
)
DISPATCH_ERRORS = Counter(
    "corral_dispatch_errors",
    "Work items that ended as dispatch errors, by error code.",
    ["code", "org"],
)
DISPATCH_TO_FINISHED = Histogram(
    "corral_dispatch_to_finished_seconds",
    "From a work item's intake to its final state, by outcome and provider.",
    ["outcome", "provider"],
    buckets=(0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800, 3600, 7200, 21600),
)

_PENDING = "corral.outcomes"
_org_labels = False
_providers: dict[str, str] = {}  # pool id -> provider id: a pool's provider never changes
_providers_lock = threading.Lock()


def configure(*, org_labels: bool) -> None:
    """Whether the counters carry each item's org (``CORRAL_METRICS_ORG_LABELS``)."""
    global _org_labels  # noqa: PLW0603 - one setting per process, set at start
    _org_labels = org_labels


@dataclass(frozen=True)
class Final:
    """One item's end, as its transaction wrote it. Without ``org_id`` or ``received_at``
    the item's row is read before the commit for them, its ``replies`` (the Celery messages
    its end answers) and when it ended; a path that gives both gives those too."""

    item_id: str
    outcome: str
    code: str | None
    pool_id: str | None
    org_id: str | None = None
    received_at: datetime | None = None
    replies: Sequence[Mapping[str, Any]] | None = None
    ended_at: datetime | None = None


def note_final(session: Session, ended: Iterable[Final | WorkItem]) -> None:
    """Count the items in ``ended`` once ``session`` commits; an ORM item is read as it is
    just before the commit (its error code may be set after its transition)."""
    session.info.setdefault(_PENDING, []).extend(ended)


@event.listens_for(Session, "before_commit")
def _resolve(session: Session) -> None:
    pending = session.info.get(_PENDING)
    if not pending:
        return
    finals = [_final_of(entry) for entry in pending]
    unknown = sorted({f.item_id for f in finals if f.org_id is None or f.received_at is None})
    rows = {}
    if unknown:  # items moved in bulk: one read for their org, intake time and replies
        query = select(
            WorkItem.id,
            WorkItem.org_id,
            WorkItem.created_at,
            WorkItem.replies,
            WorkItem.finished_at,
        )
        rows = {row.id: row for row in session.execute(query.where(WorkItem.id.in_(unknown)))}
    finals = [
        replace(
            f,
            org_id=rows[f.item_id].org_id,
            received_at=rows[f.item_id].created_at,
            replies=rows[f.item_id].replies,
            ended_at=rows[f.item_id].finished_at,
        )
        if f.item_id in rows
        else f
        for f in finals
    ]
    session.info[_PENDING] = finals
    write_owed(
        session,
        [Ended(f.item_id, f.org_id or "", f.outcome, f.replies, f.ended_at) for f in finals],
    )
    _resolve_providers(session, {f.pool_id for f in finals if f.pool_id})


def _final_of(entry: Final | WorkItem) -> Final:
    if isinstance(entry, Final):
        return entry
    return Final(
        entry.id,
        entry.state,
        entry.error_code,
        entry.pool_id,
        entry.org_id,
        entry.created_at,
        entry.replies,
        entry.finished_at,
    )


def _resolve_providers(session: Session, pool_ids: set[str]) -> None:
    # The pools of the items counted, read once per process.
    with _providers_lock:
        missing = sorted(pool_ids - _providers.keys())
    if missing:
        rows = session.execute(select(Pool.id, Pool.provider_id).where(Pool.id.in_(missing)))
        with _providers_lock:
            _providers.update({pool_id: provider for pool_id, provider in rows})


@event.listens_for(Session, "after_commit")
def _count(session: Session) -> None:
    finals: list[Final] = session.info.pop(_PENDING, None) or []
    now = utcnow()
    for final in finals:
        provider = _providers.get(final.pool_id or "", "")
        org = (final.org_id or "") if _org_labels else ""
        code = final.code or ""
        ITEMS_FINISHED.labels(final.outcome, code, provider, org).inc()
        if final.outcome == "dispatch_error":
            DISPATCH_ERRORS.labels(code, org).inc()
        if final.received_at is not None:
            seconds = max(0.0, (now - final.received_at).total_seconds())
            DISPATCH_TO_FINISHED.labels(final.outcome, provider).observe(seconds)


@event.listens_for(Session, "after_rollback")
def _drop(session: Session) -> None:
    session.info.pop(_PENDING, None)
