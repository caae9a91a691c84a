"""The provision path's database work, batched across the process's provision tasks.

A provider worker keeps hundreds of provisions in flight, each a thread that claims a
sandbox row before the provider call and records the handle after it. Those threads' claims
run together, as do their handle writes (:class:`corral.shared.batching.GroupCommit`): one
transaction of a few Core statements per batch instead of two ORM transactions per item.

Only the common case is batched: an item still ``routed`` (claim), and a sandbox whose
lease is still this attempt's, its item and itself still ``provisioning`` (handle). Every
other case — a second delivery, a lease to take over, an item that was cancelled or has
moved on — comes back as ``None`` and is decided item by item in :mod:`corral.worker.provision`.
So does an item or sandbox whose row another transaction holds locked: a batch skips such
rows instead of waiting (``SKIP LOCKED``), so one long-held lock stalls one provision, not
every batch of the process.

The guarantees are those of the one-by-one path: the claim moves the item out of
``routed`` under its row lock, so of two deliveries at most one makes a sandbox (and the
unique ``(work_item_id, attempt)`` row backs that up); the handle is written only where the
lease is still ours (the fence), item row locked before sandbox row, as every path does.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any, cast

from sqlalchemy import JSON, Connection, Table, bindparam, insert, select, update
from sqlalchemy.dialects import postgresql, sqlite

from corral.providers.base import SandboxHandle, SandboxState
from corral.shared.batching import GroupCommit
from corral.shared.db import Database, UTCDateTime, utcnow
from corral.shared.lifecycle import EVENTS, event_row
from corral.shared.models import ItemState, Pool, RegistrationToken, Sandbox, WorkItem
from corral.shared.runtime import Runtime
from corral.shared.tokens import registration_token_row

_ITEMS = cast(Table, WorkItem.__table__)
_POOLS = cast(Table, Pool.__table__)
_SANDBOXES = cast(Table, Sandbox.__table__)
_TOKENS = cast(Table, RegistrationToken.__table__)

ROUTED = ItemState.ROUTED.value
PROVISIONING = ItemState.PROVISIONING.value
AWAITING_CLAIM = ItemState.AWAITING_CLAIM.value
SANDBOX_PROVISIONING = SandboxState.PROVISIONING.value
SANDBOX_READY = SandboxState.READY.value
MAX_BATCH = 100


def sandbox_id_for(item_id: str, attempt: int) -> str:
    return f"sb-{item_id.removeprefix('wi-')}-{attempt}"


@dataclass(frozen=True)
class ItemView:
    """What provisioning reads of a work item."""

    id: str
    org_id: str
    project_id: str
    pool_id: str
    attempts: int
    payload: dict[str, Any]

    @classmethod
    def of(cls, item: WorkItem) -> ItemView:
        assert item.pool_id is not None, "a routed item has a pool"
        return cls(item.id, item.org_id, item.project_id, item.pool_id, item.attempts, item.payload)


@dataclass(frozen=True)
class ClaimRequest:
    item_id: str
    actor: str


@dataclass(frozen=True)
class Fresh:
    """A sandbox row a claim batch made, under this worker's lease, and its token (in memory
    only: the stored row has its hash)."""

    item: ItemView
    pool: Pool  # transient: not attached to a session
    sandbox_id: str
    lease_until: datetime
    token: str = field(repr=False)


@dataclass(frozen=True)
class HandleWrite:
    """A provider's handle for a sandbox this worker holds the lease on."""

    work_item_id: str
    sandbox_id: str
    lease_until: datetime
    handle: SandboxHandle
    session_limit_s: int | None
    actor: str


class ProvisionBatches:
    """The process's claim and handle batches, on the runtime's database."""

    def __init__(self, rt: Runtime) -> None:
        db, settings = rt.db, rt.settings
        lease_s, ttl_s = settings.provision_lease_s, settings.token_ttl_s

        def claims(requests: Sequence[ClaimRequest]) -> list[Fresh | None]:
            return claim_routed(db, requests, lease_s=lease_s, token_ttl_s=ttl_s)

        def handles(writes: Sequence[HandleWrite]) -> list[bool | None]:
            return record_handles(db, writes)

        wait_s = settings.provision_batch_wait_s
        self.claims = GroupCommit(claims, max_batch=MAX_BATCH, gather_s=wait_s)
        self.handles = GroupCommit(handles, max_batch=MAX_BATCH, gather_s=wait_s)


def batches(rt: Runtime) -> ProvisionBatches:
    return rt.part("provision-batches", ProvisionBatches)


def claim_routed(
    db: Database, requests: Sequence[ClaimRequest], *, lease_s: float, token_ttl_s: float
) -> list[Fresh | None]:
    """Claim the routed items among ``requests``: each moves to ``provisioning`` with a new
    sandbox row under a lease and a registration token, in one transaction. None for a
    request whose item was not routed (or that repeats an item earlier in the batch)."""
    now = utcnow()
    lease = now + timedelta(seconds=lease_s)
    actors = {request.item_id: request.actor for request in reversed(requests)}
    with db.connection() as connection:
        items = _take_routed(connection, sorted(actors), now)
        if not items:
            return [None] * len(requests)
        pools = _pools(connection, {item.pool_id for item in items})
        made = _insert_sandboxes(connection, items, pools, lease, now)
        tokens = _insert_tokens(
            connection, [item for item in items if item.id in made], ttl_s=token_ttl_s, now=now
        )
        connection.execute(_INSERT_EVENTS, _claim_events(items, made, actors, now))
    by_id = {item.id: item for item in items if item.id in made}
    results: list[Fresh | None] = []
    for request in requests:
        claimed = by_id.pop(request.item_id, None)  # a repeated item: only its first request
        results.append(
            None
            if claimed is None
            else Fresh(
                claimed,
                pools[claimed.pool_id],
                sandbox_id_for(claimed.id, claimed.attempts),
                lease,
                tokens[claimed.id],
            )
        )
    return results


# The hot path's statements, built once (building one costs about as much as running it).
# Rows another transaction holds are skipped, not waited for: their items go the one-by-one
# way, so that one long-held lock stalls one provision, not the process's every batch.
# The rows are locked by id alone and their state read from the locked (newest) version:
# with a state condition beside the ids, a plan without statistics may walk the state index
# over every routed item instead of looking the ids up (seen: 12 ms per claim with 300 routed).
_LOCKED = (
    select(_ITEMS.c.id, _ITEMS.c.state)
    .where(_ITEMS.c.id.in_(bindparam("ids", expanding=True)))
    .with_for_update(skip_locked=True)
    .cte("locked")
)
_TAKE_ROUTED = (
    update(_ITEMS)
    .where(_ITEMS.c.id == _LOCKED.c.id, _LOCKED.c.state == ROUTED)
    .values(state=PROVISIONING, updated_at=bindparam("now", type_=UTCDateTime()))
    .returning(
        *(
            _ITEMS.c[name]
            for name in ("id", "org_id", "project_id", "pool_id", "attempts", "payload")
        )
    )
)
_POOLS_BY_ID = select(_POOLS).where(_POOLS.c.id.in_(bindparam("ids", expanding=True)))
# Per dialect: PostgreSQL's and SQLite's ON CONFLICT DO NOTHING.
_INSERT_SANDBOXES = {
    dialect.dialect.name: dialect.insert(_SANDBOXES)
    .on_conflict_do_nothing()
    .returning(_SANDBOXES.c.work_item_id)
    for dialect in (postgresql, sqlite)
}
_INSERT_TOKENS = insert(_TOKENS)
_INSERT_EVENTS = insert(EVENTS)


def _take_routed(connection: Connection, ids: list[str], now: datetime) -> list[ItemView]:
    """Move the routed items among ``ids`` to ``provisioning``, under their row locks (those
    whose row another transaction holds are left out)."""
    rows = connection.execute(_TAKE_ROUTED, {"ids": ids, "now": now})
    return [ItemView(*row) for row in rows]


def _pools(connection: Connection, pool_ids: Iterable[str]) -> dict[str, Pool]:
    rows = connection.execute(_POOLS_BY_ID, {"ids": sorted(pool_ids)})
    return {row.id: Pool(**row._asdict()) for row in rows}


def _insert_sandboxes(
    connection: Connection,
    items: list[ItemView],
    pools: dict[str, Pool],
    lease: datetime,
    now: datetime,
) -> set[str]:
    """Insert each item's sandbox row for its attempt; the items whose row this made (an
    existing row, which the item's state rules out, is left to the one-by-one path)."""
    rows = [
        {
            "id": sandbox_id_for(item.id, item.attempts),
            "work_item_id": item.id,
            "attempt": item.attempts,
            "org_id": item.org_id,
            "pool_id": item.pool_id,
            "provider_id": pools[item.pool_id].provider_id,
            "status": SANDBOX_PROVISIONING,
            "lease_until": lease,
            "created_at": now,
            "metadata": {},
        }
        for item in items
    ]
    made = connection.execute(_INSERT_SANDBOXES[connection.dialect.name], rows)
    return set(made.scalars())


def _insert_tokens(
    connection: Connection, items: list[ItemView], *, ttl_s: float, now: datetime
) -> dict[str, str]:
    """A registration token for each item's new sandbox: its hash stored, the token kept in
    memory only; by item id."""
    tokens, rows = {}, []
    for item in items:
        sandbox_id = sandbox_id_for(item.id, item.attempts)
        tokens[item.id], row = registration_token_row(sandbox_id, item.id, ttl_s=ttl_s, now=now)
        rows.append(row)
    if rows:
        connection.execute(_INSERT_TOKENS, rows)
    return tokens


def _claim_events(
    items: list[ItemView], made: set[str], actors: dict[str, str], now: datetime
) -> list[dict[str, Any]]:
    events = []
    for item in items:
        actor = actors[item.id]
        if item.id in made:
            events.append(
                event_row(
                    item.id,
                    None,
                    SANDBOX_PROVISIONING,
                    actor=actor,
                    at=now,
                    sandbox_id=sandbox_id_for(item.id, item.attempts),
                )
            )
        events.append(event_row(item.id, ROUTED, PROVISIONING, actor=actor, at=now))
    return events


def record_handles(db: Database, writes: Sequence[HandleWrite]) -> list[bool | None]:
    """Record each handle whose sandbox is still this attempt's and still provisioning, its
    item too: sandbox ``ready``, item ``awaiting_claim``. True for those; None for the
    others, which :func:`corral.worker.provision.record_handle` decides one by one."""
    now = utcnow()
    by_sandbox = {write.sandbox_id: write for write in writes}
    with db.connection() as connection:
        rows = connection.execute(_LOCK_HANDLED, {"ids": sorted(by_sandbox)})
        ready = [
            by_sandbox[sandbox_id]
            for state, sandbox_id, status, lease_until in rows
            if (state, status) == (PROVISIONING, SANDBOX_PROVISIONING)
            and lease_until == by_sandbox[sandbox_id].lease_until
        ]
        if ready:
            _write_handles(connection, ready, now)
    recorded = {write.sandbox_id for write in ready}
    return [True if write.sandbox_id in recorded else None for write in writes]


_LOCK_HANDLED = (
    select(_ITEMS.c.state, _SANDBOXES.c.id, _SANDBOXES.c.status, _SANDBOXES.c.lease_until)
    .join_from(_ITEMS, _SANDBOXES, _SANDBOXES.c.work_item_id == _ITEMS.c.id)
    .where(_SANDBOXES.c.id.in_(bindparam("ids", expanding=True)))
    .order_by(_ITEMS.c.id)
    .with_for_update(skip_locked=True)  # both rows; those held elsewhere go one by one
)
_TO_AWAITING_CLAIM = (
    update(_ITEMS)
    .where(_ITEMS.c.id.in_(bindparam("ids", expanding=True)))
    .values(
        state=AWAITING_CLAIM,
        updated_at=bindparam("now", type_=UTCDateTime()),
        provisioned_at=bindparam("now", type_=UTCDateTime()),
    )
)
_SET_HANDLE = (
    update(_SANDBOXES)
    .where(_SANDBOXES.c.id == bindparam("b_id"))
    .values(
        external_id=bindparam("b_external_id"),
        metadata=bindparam("b_metadata", type_=JSON()),
        started_at=bindparam("b_now", type_=UTCDateTime()),
        deadline_at=bindparam("b_deadline", type_=UTCDateTime()),
        lease_until=None,
        status=SANDBOX_READY,
    )
)


def _write_handles(connection: Connection, ready: list[HandleWrite], now: datetime) -> None:
    connection.execute(
        _SET_HANDLE,
        [
            {
                "b_id": write.sandbox_id,
                "b_external_id": write.handle.external_id,
                "b_metadata": dict(write.handle.metadata),
                "b_now": now,
                "b_deadline": now + timedelta(seconds=write.session_limit_s)
                if write.session_limit_s
                else None,
            }
            for write in ready
        ],
    )
    ids = sorted(write.work_item_id for write in ready)
    connection.execute(_TO_AWAITING_CLAIM, {"ids": ids, "now": now})
    events = []
    for write in ready:
        events.append(
            event_row(
                write.work_item_id,
                SANDBOX_PROVISIONING,
                SANDBOX_READY,
                actor=write.actor,
                at=now,
                sandbox_id=write.sandbox_id,
                detail=f"handle {write.handle.external_id}",
            )
        )
        events.append(
            event_row(write.work_item_id, PROVISIONING, AWAITING_CLAIM, actor=write.actor, at=now)
        )
    connection.execute(_INSERT_EVENTS, events)
