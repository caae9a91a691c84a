"""Lease policies: how many sandboxes a work item may get, and which ends give it another.

An operator chooses them per item (the dispatch message's ``lease``) or per pool (a pool's
``lease``, through the admin api or ``corral pools create/update --lease-...``); a field the
item leaves out is the pool's, and one the pool leaves out is the deployment's default,
which is what corral did before leases could be chosen (:func:`deployment_default`).

What the item and its pool chose is resolved when the item is first routed and stored on
it (``work_items.lease``), so that every later attempt follows the same rules whichever pool
takes it; a field neither chose is the deployment's when it applies (``CORRAL_MAX_ATTEMPTS``
of the process that settles the attempt, as before) (docs/dispatch.md#lease). What each
field does:

- ``max_attempts``: sandboxes the item may get (1 to :data:`MAX_ATTEMPTS_LIMIT`). Every
  requeue below counts an attempt; the one after the last fails the item with its reason
  and "gave up after N attempts".
- ``on_heartbeat_lost``: what losing the runner after its claim does: ``fail`` the item
  (the default), or ``requeue`` it for a new sandbox. Losing the runner is the reaper's
  ``heartbeat_lost``, and the sandbox ending at its provider before the work reported
  (``sandbox_lost``, ``gone``). A sandbox lost before the claim is always requeued.
- ``retry_on_work_failed``: a work phase that exits non-zero (``work_failed``) routes the
  item again instead of failing it. Other failures (install, a deadline, a result too
  large, out of memory) are never retried: another attempt would most likely end alike.
- back-off: the ``n``-th requeue waits ``min(backoff_max_s, backoff_s * backoff_factor **
  (n - 1))`` seconds, without jitter (an operator can read from the policy when the item
  runs again; items requeued together are spread by the re-drive's batches and their pools'
  slots anyway). The item holds no slot while it waits.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass
from datetime import datetime, timedelta
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool

MAX_ATTEMPTS_LIMIT = 20
MAX_BACKOFF_S = 86_400.0  # a day: a longer wait is a schedule, not a retry
HeartbeatLost = Literal["fail", "requeue"]
FAIL: HeartbeatLost = "fail"
REQUEUE: HeartbeatLost = "requeue"


class LeaseSpec(BaseModel):
    """A lease policy as a message or a pool gives it: each field left out is the next
    level's (the item's beats the pool's beats the deployment's)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    max_attempts: int | None = Field(
        default=None,
        ge=1,
        le=MAX_ATTEMPTS_LIMIT,
        description=f"sandboxes the item may get, 1 to {MAX_ATTEMPTS_LIMIT} "
        "(default: CORRAL_MAX_ATTEMPTS)",
    )
    retry_on_work_failed: StrictBool | None = Field(
        default=None,
        description="a work phase that exits non-zero routes the item again (default false)",
    )
    on_heartbeat_lost: HeartbeatLost | None = Field(
        default=None,
        description="a runner lost after its claim: fail the item (default) or requeue it",
    )
    backoff_s: float | None = Field(
        default=None,
        ge=0,
        le=MAX_BACKOFF_S,
        description="seconds before the first requeued attempt is routed (default 0)",
    )
    backoff_factor: float | None = Field(
        default=None,
        ge=1,
        le=10,
        description="each further requeue waits this many times longer (default 2)",
    )
    backoff_max_s: float | None = Field(
        default=None,
        ge=0,
        le=MAX_BACKOFF_S,
        description=f"the longest wait, at most {MAX_BACKOFF_S:g} s (default 300)",
    )

    def given(self) -> dict[str, Any]:
        """The fields set, as stored on a pool."""
        return self.model_dump(exclude_none=True)


@dataclass(frozen=True)
class Lease:
    """The policy in force for one item: every field known."""

    max_attempts: int
    retry_on_work_failed: bool
    on_heartbeat_lost: HeartbeatLost
    backoff_s: float
    backoff_factor: float
    backoff_max_s: float

    def delay_s(self, requeues: int) -> float:
        """Seconds the ``requeues``-th requeue (1 for the first) waits."""
        wait = self.backoff_s * self.backoff_factor ** max(requeues - 1, 0)
        return min(self.backoff_max_s, wait)

    def not_before(self, requeues: int, now: datetime) -> datetime | None:
        """When the ``requeues``-th requeued attempt may be routed; None: at once."""
        delay = self.delay_s(requeues)
        return now + timedelta(seconds=delay) if delay > 0 else None

    @property
    def requeues_lost_runner(self) -> bool:
        return self.on_heartbeat_lost == REQUEUE


def gave_up(attempts: int) -> str:
    """What a failed item's message says once its attempts are spent."""
    return f"gave up after {attempts} attempt{'s' if attempts != 1 else ''}"


def deployment_default(max_attempts: int) -> Lease:
    """What corral does when nobody chose: requeue only before the claim, up to
    ``max_attempts`` (CORRAL_MAX_ATTEMPTS), at once; fail a lost runner and failed work."""
    return Lease(
        max_attempts=max_attempts,
        retry_on_work_failed=False,
        on_heartbeat_lost=FAIL,
        backoff_s=0.0,
        backoff_factor=2.0,
        backoff_max_s=300.0,
    )


def chosen(item: LeaseSpec | None, pool: Mapping[str, Any] | None) -> dict[str, Any]:
    """What operators chose for an item routed to a pool: each field the item's, else the
    pool's (as stored); the fields neither chose are left out."""
    fields = LeaseSpec.model_validate(pool).given() if pool else {}
    if item is not None:
        fields |= item.given()
    return fields


def in_force(stored: Mapping[str, Any] | None, *, max_attempts: int) -> Lease:
    """The policy in force for an item: what was chosen for it (as stored), the deployment's
    default for the rest (none stored: an item routed before leases were kept)."""
    fields = asdict(deployment_default(max_attempts))
    fields |= {name: value for name, value in (stored or {}).items() if name in fields}
    return Lease(**fields)


def resolve(item: LeaseSpec | None, pool: Mapping[str, Any] | None, *, max_attempts: int) -> Lease:
    """The policy in force: each field the item's, else the pool's, else the deployment's."""
    return in_force(chosen(item, pool), max_attempts=max_attempts)
