"""An item's place in a queue: how many items come before it, counted up to a cap."""

from __future__ import annotations

from sqlalchemy import ColumnElement, func, select
from sqlalchemy.orm import Session

from corral.shared.store.models import WorkItem

MAX_AHEAD = 10_000  # a place further back is said as "at least this many ahead"


def items_ahead(session: Session, *before: ColumnElement[bool]) -> int:
    """How many work items meet ``before`` (those ahead of one), at most :data:`MAX_AHEAD`:
    a range of an index, never a count of all of them."""
    ahead = select(WorkItem.id).where(*before).limit(MAX_AHEAD).subquery()
    return int(session.scalar(select(func.count()).select_from(ahead)) or 0)
