"""What an item's earlier attempts say: the pools that failed it, and the sandboxes it got.

Each attempt of a work item owns one sandbox row, which records its pool; how it ended
(``termination_reason``) says what the attempt tells routing and the lease policy:

- ``provision_failed``: the pool's provider could not make the sandbox. With failover (the
  default; the message's ``failover: false`` opts out) routing passes that pool by for the
  item's later attempts, and the item fails once every qualifying pool has failed it
  (:func:`failed_pools`).
- ``provision_unavailable``: the provider failed transiently past the provision task's
  retries (a brown-out). The item waits and is routed again; the pool is not passed by
  for it: its breaker decides when it is tried again.

Neither made a sandbox, so neither counts against the lease's ``max_attempts`` (sandboxes
the item may get; :func:`made_attempts`).
"""

from __future__ import annotations

from collections.abc import Collection

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from corral.shared.store.models import Sandbox, TerminationReason

# The ends of attempts that made no sandbox.
UNMADE = (TerminationReason.PROVISION_FAILED.value, TerminationReason.PROVISION_UNAVAILABLE.value)


def failed_pools(session: Session, item_id: str) -> list[str]:
    """The pools whose provider could not make a sandbox for ``item_id`` (a permanent
    error, or any error of a provider bug), in the order of the attempts."""
    rows = session.execute(
        select(Sandbox.pool_id, func.min(Sandbox.attempt).label("first"))
        .where(
            Sandbox.work_item_id == item_id,
            Sandbox.termination_reason == TerminationReason.PROVISION_FAILED.value,
        )
        .group_by(Sandbox.pool_id)
        .order_by("first")
    )
    return [row.pool_id for row in rows]


def unmade_attempts(session: Session, item_ids: Collection[str]) -> dict[str, int]:
    """How many attempts of each of ``item_ids`` made no sandbox (only those with any)."""
    if not item_ids:
        return {}
    rows = session.execute(
        select(Sandbox.work_item_id, func.count())
        .where(Sandbox.work_item_id.in_(sorted(item_ids)), Sandbox.termination_reason.in_(UNMADE))
        .group_by(Sandbox.work_item_id)
    )
    return {item_id: int(count) for item_id, count in rows}


def made_attempts(attempts: int, unmade: int) -> int:
    """The attempts that got a sandbox: what the lease's ``max_attempts`` counts."""
    return max(attempts - unmade, 0)
