"""An org's limit on work in flight across all its pools.

An org without a row in ``org_limits`` has no limit and costs routing one indexed read per
batch. For an org with one, routing locks its row (``FOR UPDATE``, in org id order, before
any pool counter is taken) and reads the slots its pools hold now: two routers of one
limited org take turns, so the org never holds more than its limit, while unlimited orgs
never wait on each other. An item that would pass the limit waits for capacity, like an
item whose pools are full, and is routed again when slots free.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, field
from typing import cast

from sqlalchemy import Table, bindparam, delete, func, select
from sqlalchemy.orm import Session
from sqlalchemy.sql.elements import BindParameter
from sqlalchemy.sql.selectable import ScalarSelect

from corral.shared.store.db import utcnow
from corral.shared.store.models import ItemState, OrgLimit, Pool, WorkItem

MAX_CONCURRENT_LIMIT = 1_000_000


# Read for every routed batch (locked: the batch takes the room it reads) and every
# hand-on (not locked: a cap on what it tries, each routing checks again): built once.
_LIMITS = cast(Table, OrgLimit.__table__)
_LIMITS_READ = (
    select(_LIMITS.c.org_id, _LIMITS.c.max_concurrent)
    .where(_LIMITS.c.org_id.in_(bindparam("orgs", expanding=True)))
    .order_by(_LIMITS.c.org_id)
)
_LIMITS_OF = _LIMITS_READ.with_for_update()


# Why an item waits when its org is at its limit (its view's ``waiting.reason``).
WAIT_REASON = "org_limit"
# The limited orgs that have items waiting for their limit (the partial index of waiting
# items, by org): read for arrivals only.
_QUEUED = (
    select(WorkItem.org_id)
    .where(
        WorkItem.state == ItemState.WAITING_CAPACITY.value,
        WorkItem.org_id.in_(bindparam("orgs", expanding=True)),
        WorkItem.wait_reason == WAIT_REASON,
    )
    .distinct()
)


def limited_among(orgs: BindParameter[str]) -> ScalarSelect[int]:
    """How many of ``orgs`` (an expanding parameter) have a limit: for a statement that
    reads without locks and must leave a batch of a limited org to :meth:`OrgRoom.read`."""
    return select(func.count()).where(_LIMITS.c.org_id.in_(orgs)).scalar_subquery()


@dataclass
class OrgRoom:
    """How many more items each limited org may route now (orgs without a limit absent)."""

    left: dict[str, int] = field(default_factory=dict)

    @classmethod
    def read(
        cls, session: Session, orgs: Collection[str], *, fresh: bool = False, lock: bool = True
    ) -> OrgRoom:
        """The room of ``orgs``, their limits' rows locked unless ``lock`` is False (a
        reader that routes nothing on it). ``fresh``: for items arriving now, which take no
        room a limited org's waiting items wait for (:data:`WAIT_REASON`): a slot the org
        frees is theirs, handed on in admission order by the re-drive, not an arrival's."""
        if not orgs:
            return cls()
        statement = _LIMITS_OF if lock else _LIMITS_READ
        found = session.connection().execute(statement, {"orgs": sorted(orgs)})
        limits: dict[str, int] = dict(found.all())
        if not limits:
            return cls()
        held = dict(
            session.execute(
                select(Pool.org_id, func.coalesce(func.sum(Pool.slots_in_use), 0))
                .where(Pool.org_id.in_(sorted(limits)))
                .group_by(Pool.org_id)
            ).all()
        )
        left = {org: limit - int(held.get(org, 0)) for org, limit in limits.items()}
        roomy = sorted(org for org, room in left.items() if room > 0)
        if fresh and roomy:  # a full org has no room to keep for its waiting items
            for org in session.connection().execute(_QUEUED, {"orgs": roomy}).scalars():
                left[org] = 0
        return cls(left)

    def full(self, org_id: str) -> bool:
        return org_id in self.left and self.left[org_id] <= 0

    def take(self, org_id: str) -> None:
        if org_id in self.left:
            self.left[org_id] -= 1


def set_limit(session: Session, org_id: str, max_concurrent: int | None) -> None:
    """Set (or, with None, remove) ``org_id``'s limit."""
    if max_concurrent is None:
        session.execute(delete(OrgLimit).where(OrgLimit.org_id == org_id))
        return
    if not 1 <= max_concurrent <= MAX_CONCURRENT_LIMIT:
        raise ValueError(f"max_concurrent must be between 1 and {MAX_CONCURRENT_LIMIT}")
    row = session.get(OrgLimit, org_id)
    if row is None:
        session.add(OrgLimit(org_id=org_id, max_concurrent=max_concurrent, updated_at=utcnow()))
    else:
        row.max_concurrent = max_concurrent
        row.updated_at = utcnow()


def org_limit(session: Session, org_id: str) -> int | None:
    row = session.get(OrgLimit, org_id)
    return row.max_concurrent if row is not None else None


def in_flight(session: Session, org_id: str) -> int:
    return int(
        session.scalar(
            select(func.coalesce(func.sum(Pool.slots_in_use), 0)).where(Pool.org_id == org_id)
        )
        or 0
    )
