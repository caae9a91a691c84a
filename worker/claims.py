"""The provision path's database work, batched across the process's provision tasks.

A provider worker keeps hundreds of provisions in flight, each a thread that claims a
sandbox row before the provider call and records the handle after it. Those threads' claims
run together, as do their handle writes (:class:`corral.shared.batching.GroupCommit`): one
transaction of a few Core statements per batch instead of two ORM transactions per item.

Each of the two writes has one definition here, whoever asks: :func:`claim` (a strategy per
database: one statement on PostgreSQL, steps on SQLite) and :func:`write_handles`. The
one-by-one path calls them on its own transaction for the cases it decides; the moves'
columns and audit rows come from :mod:`corral.shared.store.lifecycle`'s table.

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

import hashlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any, cast

from sqlalchemy import (
    CTE,
    JSON,
    Connection,
    Select,
    String,
    Table,
    bindparam,
    func,
    insert,
    literal,
    null,
    select,
    union_all,
    update,
)
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.sql.selectable import TableValuedAlias

from corral.providers.base import SandboxHandle, SandboxState
from corral.shared.batching import GroupCommit
from corral.shared.runtime import Runtime
from corral.shared.store.db import Database, UTCDateTime, utcnow
from corral.shared.store.driver_sql import DriverStatement
from corral.shared.store.lifecycle import EVENTS, event_row, item_move_values, sandbox_move_values
from corral.shared.store.models import ItemState, Pool, RegistrationToken, Sandbox, WorkItem
from corral.shared.store.pools import PROVISION_COLUMNS, PoolRow, ProvisionPool
from corral.shared.store.tokens import REGISTRATION_PREFIX, hash_token, new_token

_ITEMS = cast(Table, WorkItem.__table__)
_POOLS = cast(Table, Pool.__table__)
_SANDBOXES = cast(Table, Sandbox.__table__)
_TOKENS = cast(Table, RegistrationToken.__table__)

PROVISIONING = ItemState.PROVISIONING.value
SANDBOX_PROVISIONING = SandboxState.PROVISIONING.value
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
class Delivery:
    """Which try of which provision task claims. A claim notes it on the sandbox row (as
    :attr:`holder`), so that a later try of the same task can take over the lease of an
    earlier one: a try has done its work when it sends its retry (its claim's answer was
    lost, say, after the claim committed). Any other lease is waited out.

    Should the broker hand the earlier try out again before its acknowledgement (its
    connection lost, its worker killed after sending the retry), the two may provision
    side by side; the lease stays the fence: only the holder's handle is recorded, and the
    other's sandbox is ended, as after a lease taken over when it ran out."""

    task_id: str
    attempt: int  # Celery's retries: 0 for the first try

    @property
    def holder(self) -> str:
        return f"{self._task}#{max(0, min(self.attempt, 10**9))}"  # retries come from a header

    @property
    def _task(self) -> str:
        # A digest: a sender chooses task ids (a long one would not fit the column).
        return hashlib.sha256(self.task_id.encode("utf-8", "surrogatepass")).hexdigest()[:32]

    def follows(self, holder: str | None) -> bool:
        """Whether ``holder`` is an earlier try of this delivery's task."""
        task, _, attempt = (holder or "").partition("#")
        numbered = attempt.isascii() and attempt.isdigit()
        return task == self._task and numbered and int(attempt) < self.attempt


@dataclass(frozen=True)
class ClaimRequest:
    item_id: str
    actor: str
    holder: str | None = None  # the claiming :class:`Delivery`'s, when a task claims


@dataclass(frozen=True)
class Fresh:
    """A sandbox row a claim batch made, under this worker's lease, and its token (in memory
    only: the stored row has its hash)."""

    item: ItemView
    pool: ProvisionPool  # a claim's PoolRow, or a Pool no longer attached to a session
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
    """:func:`claim` on a connection of its own: on PostgreSQL the claim's held connection,
    outside any transaction block (the statement is atomic on its own, one round trip); on
    SQLite a transaction."""
    opened = db.held("claim").use() if db.is_postgres else db.connection()
    with opened as connection:
        return claim(connection, requests, lease_s=lease_s, token_ttl_s=token_ttl_s)


def claim(
    connection: Connection,
    requests: Sequence[ClaimRequest],
    *,
    lease_s: float,
    token_ttl_s: float,
) -> list[Fresh | None]:
    """Claim the routed items among ``requests``: each moves to ``provisioning`` with a new
    sandbox row under a lease and a registration token, atomically. None for a request
    whose item was not routed (or that repeats an item earlier in the batch).

    The one definition of the claim, whichever path asks (a batch, or the one-by-one path
    for an item it holds locked). Its strategy is the database's: one statement on
    PostgreSQL (:data:`_CLAIM`), five on SQLite (:func:`_claim_in_steps`); a test holds them
    to the same rows (tests/integration/test_store_contract.py)."""
    now = utcnow()
    lease = now + timedelta(seconds=lease_s)
    actors = {request.item_id: request.actor for request in reversed(requests)}
    holders = {request.item_id: request.holder for request in reversed(requests)}
    # A token for every request; only those of the items claimed are stored (their hash)
    # and handed on, the rest are dropped here.
    minted = {item_id: new_token(REGISTRATION_PREFIX) for item_id in actors}
    expires = now + timedelta(seconds=token_ttl_s)
    strategy = _CLAIM_STRATEGIES.get(connection.dialect.name, _claim_in_steps)
    claimed = strategy(connection, _Batch(actors, holders, minted, lease, expires, now))
    results: list[Fresh | None] = []
    for request in requests:
        one = claimed.pop(request.item_id, None)  # a repeated item: only its first request
        if one is None:
            results.append(None)
            continue
        item, pool = one
        sandbox_id = sandbox_id_for(item.id, item.attempts)
        results.append(Fresh(item, pool, sandbox_id, lease, minted[item.id]))
    return results


@dataclass(frozen=True)
class _Batch:
    """What one claim batch writes: per item id its actor, its lease's holder and a new
    token (kept in memory only: rows store its hash); the lease, the tokens' expiry, the
    time."""

    actors: dict[str, str]
    holders: dict[str, str | None]
    tokens: dict[str, str] = field(repr=False)
    lease: datetime
    expires: datetime
    now: datetime


_Claimed = dict[str, tuple[ItemView, PoolRow]]  # item id → the item and its pool: row made


def _claim_in_steps(connection: Connection, batch: _Batch) -> _Claimed:
    """The claim as five statements in the connection's transaction (SQLite)."""
    now = batch.now
    items = _take_routed(connection, sorted(batch.actors), now)
    if not items:
        return {}
    pools = _pools(connection, {item.pool_id for item in items})
    made = _insert_sandboxes(connection, items, pools, batch, now)
    tokens = [
        {
            "token_hash": hash_token(batch.tokens[item.id]),
            "sandbox_id": sandbox_id_for(item.id, item.attempts),
            "work_item_id": item.id,
            "expires_at": batch.expires,
            "created_at": now,
        }
        for item in items
        if item.id in made
    ]
    if tokens:
        connection.execute(_INSERT_TOKENS, tokens)
    connection.execute(_INSERT_EVENTS, _claim_events(items, made, batch.actors, now))
    return {item.id: (item, pools[item.pool_id]) for item in items if item.id in made}


def _claim_in_one_statement(connection: Connection, batch: _Batch) -> _Claimed:
    """The claim as one statement (PostgreSQL): :data:`_CLAIM`."""
    ids = sorted(batch.actors)
    parameters = {
        "ids": ids,
        "item_ids": ids,
        "actors": [batch.actors[item_id] for item_id in ids],
        "holders": [batch.holders[item_id] for item_id in ids],
        "hashes": [hash_token(batch.tokens[item_id]) for item_id in ids],
        "expires": batch.expires,
        "held_until": batch.lease,
        "now": batch.now,
    }
    rows = _CLAIM.run(connection, parameters).all()
    claimed = {}
    for row in rows:
        values = row._asdict()
        item = ItemView(*(values[name] for name in _ITEM_VIEW))
        pool = PoolRow(**{name: values[f"pool__{name}"] for name in PROVISION_COLUMNS})
        claimed[item.id] = (item, pool)
    return claimed


_CLAIM_STRATEGIES = {"postgresql": _claim_in_one_statement, "sqlite": _claim_in_steps}

# Each item's move, as both strategies write it: its columns from the lifecycle's table.
_CLAIM_MOVE = (ItemState.ROUTED, ItemState.PROVISIONING)
_HANDLE_MOVE = (ItemState.PROVISIONING, ItemState.AWAITING_CLAIM)


def _locked_ids() -> CTE:
    """The rows of the ids given (``ids``), locked; those another transaction holds are
    skipped, not waited for: their items go the one-by-one way, so that one long-held lock
    stalls one provision, not the process's every batch. The rows are locked by id alone
    and their state read from the locked (newest) version: with a state condition beside
    the ids, a plan without statistics may walk the state index over every routed item
    instead of looking the ids up (seen: 12 ms per claim with 300 routed)."""
    return (
        select(_ITEMS.c.id, _ITEMS.c.state)
        .where(_ITEMS.c.id.in_(bindparam("ids", expanding=True)))
        .with_for_update(skip_locked=True)
        .cte("locked")
    )


def _take_routed_from(locked: CTE) -> Any:
    """The claim's move of the routed items among ``locked``, at ``now``; each item's
    :class:`ItemView` columns returned. What held one for its provider's pace
    (:mod:`corral.worker.pacing`) is over: it goes."""
    from_state, to = _CLAIM_MOVE
    return (
        update(_ITEMS)
        .where(_ITEMS.c.id == locked.c.id, locked.c.state == from_state.value)
        .values(item_move_values(from_state, to, bindparam("now", type_=UTCDateTime())))
        .values(wait_reason=null(), not_before=null())
        .returning(*(_ITEMS.c[name] for name in _ITEM_VIEW))
    )


# The steps' statements, built once (building one costs about as much as running it).
_ITEM_VIEW = ("id", "org_id", "project_id", "pool_id", "attempts", "payload")
_TAKE_ROUTED = _take_routed_from(_locked_ids())
_POOLS_BY_ID = select(*(_POOLS.c[name] for name in PROVISION_COLUMNS)).where(
    _POOLS.c.id.in_(bindparam("ids", expanding=True))
)
_INSERT_SANDBOXES = (
    sqlite.insert(_SANDBOXES).on_conflict_do_nothing().returning(_SANDBOXES.c.work_item_id)
)
_INSERT_TOKENS = insert(_TOKENS)
_INSERT_EVENTS = insert(EVENTS)
_SANDBOX_FROM_CLAIM = (
    "id",
    "work_item_id",
    "attempt",
    "org_id",
    "pool_id",
    "provider_id",
    "status",
)


def _one_statement_claim() -> Select[Any]:
    """The claim on PostgreSQL, as one statement of data-modifying CTEs (they all see one
    snapshot and commit together): lock the ids (skipping rows held elsewhere), move the
    routed ones to ``provisioning``, insert their sandbox rows (none where the attempt has
    one; ids as :func:`sandbox_id_for` makes them, built in SQL), the hashes of the tokens
    of the rows made, and the events; answer each item given a row, with its pool.

    It runs as driver SQL (:mod:`corral.shared.store.driver_sql`): it is on the way from a dispatch
    to ``provision()``. Parameters: the sorted ids twice, ``ids`` (expanded into ``IN``, see
    :data:`_LOCKED`) and ``item_ids`` (an array); ``actors``, ``holders`` (each lease's
    holder, or null) and ``hashes``, one per id in that order; ``expires``, ``held_until``
    (the lease) and ``now``. No parameter may share a column's name: SQLAlchemy would take
    it for one more SET of the UPDATE."""
    text_array = postgresql.ARRAY(String)
    taken = _take_routed_from(_locked_ids()).cte("taken")
    given = (
        func.unnest(
            bindparam("item_ids", type_=text_array),
            bindparam("actors", type_=text_array),
            bindparam("holders", type_=text_array),
        )
        .table_valued("item_id", "actor", "holder")
        .render_derived()
    )
    made = _claim_sandboxes(taken, given)
    tokens = _claim_tokens(made)
    events = _claim_events_insert(taken, made, given)
    return (
        select(
            *(taken.c[name] for name in _ITEM_VIEW),
            *(_POOLS.c[name].label(f"pool__{name}") for name in PROVISION_COLUMNS),
        )
        .join_from(taken, made, made.c.work_item_id == taken.c.id)  # the items given a row
        .join(_POOLS, _POOLS.c.id == taken.c.pool_id)
        .add_cte(tokens, events)
    )


def _claim_sandboxes(taken: CTE, given: TableValuedAlias) -> CTE:
    """The claim's insert of a sandbox row for each item taken (none where its attempt has
    one), its lease held by the item's given holder; the ids, as :func:`sandbox_id_for`
    makes them, are built in SQL."""
    when = UTCDateTime()
    sandbox_id = (
        literal("sb-")
        + func.regexp_replace(taken.c.id, "^wi-", "")
        + literal("-")
        + taken.c.attempts.cast(String)
    )
    made = (
        postgresql.insert(_SANDBOXES)
        .from_select(
            [*_SANDBOX_FROM_CLAIM, "lease_until", "lease_holder", "created_at", "metadata"],
            select(
                sandbox_id,
                taken.c.id,
                taken.c.attempts,
                taken.c.org_id,
                taken.c.pool_id,
                _POOLS.c.provider_id,
                literal(SANDBOX_PROVISIONING),
                bindparam("held_until", type_=when),
                given.c.holder,
                bindparam("now", type_=when),
                literal({}, JSON()),
            )
            .join_from(taken, _POOLS, _POOLS.c.id == taken.c.pool_id)
            .join(given, given.c.item_id == taken.c.id),
        )
        .on_conflict_do_nothing()
        .returning(_SANDBOXES.c.id, _SANDBOXES.c.work_item_id)
        .cte("made")
    )
    return made


def _claim_tokens(made: CTE) -> CTE:
    """The claim's insert of the token hashes of the sandbox rows it made."""
    text_array, when = postgresql.ARRAY(String), UTCDateTime()
    hashes = (
        func.unnest(bindparam("item_ids", type_=text_array), bindparam("hashes", type_=text_array))
        .table_valued("item_id", "token_hash")
        .render_derived()
    )
    tokens = (
        insert(_TOKENS)
        .from_select(
            ["token_hash", "sandbox_id", "work_item_id", "expires_at", "created_at"],
            select(
                hashes.c.token_hash,
                made.c.id,
                made.c.work_item_id,
                bindparam("expires", type_=when),
                bindparam("now", type_=when),
            ).join_from(made, hashes, hashes.c.item_id == made.c.work_item_id),
        )
        .returning(_TOKENS.c.id)
        .cte("tokens")
    )
    return tokens


def _claim_events_insert(taken: CTE, made: CTE, given: TableValuedAlias) -> CTE:
    """The claim's insert of its events: the sandbox's creation for each row made, the
    item's move for each item taken."""
    when = UTCDateTime()
    moves = union_all(
        # Per item the sandbox's creation first, then the item's move, as the steps write them.
        select(
            literal("sandbox").label("entity"),
            made.c.id.label("entity_id"),
            made.c.work_item_id.label("work_item_id"),
            null().label("from_state"),
            literal(SANDBOX_PROVISIONING).label("to_state"),
            given.c.actor.label("actor"),
            literal(0).label("step"),
        ).join_from(made, given, given.c.item_id == made.c.work_item_id),
        select(
            literal("work_item"),
            taken.c.id,
            taken.c.id,
            literal(_CLAIM_MOVE[0].value),
            literal(_CLAIM_MOVE[1].value),
            given.c.actor,
            literal(1),
        ).join_from(taken, given, given.c.item_id == taken.c.id),
    ).subquery("moves")
    columns = ["entity", "entity_id", "work_item_id", "from_state", "to_state", "actor"]
    events = (
        insert(EVENTS)
        .from_select(
            [*columns, "created_at"],
            select(*(moves.c[name] for name in columns), bindparam("now", type_=when)).order_by(
                moves.c.work_item_id, moves.c.step
            ),
        )
        .returning(EVENTS.c.id)
        .cte("events")
    )
    return events


_CLAIM = DriverStatement(_one_statement_claim())


def _take_routed(connection: Connection, ids: list[str], now: datetime) -> list[ItemView]:
    """Move the routed items among ``ids`` to ``provisioning``, under their row locks (those
    whose row another transaction holds are left out)."""
    rows = connection.execute(_TAKE_ROUTED, {"ids": ids, "now": now})
    return [ItemView(*row) for row in rows]


def _pools(connection: Connection, pool_ids: Iterable[str]) -> dict[str, PoolRow]:
    rows = connection.execute(_POOLS_BY_ID, {"ids": sorted(pool_ids)})
    return {row.id: PoolRow(**row._asdict()) for row in rows}


def _insert_sandboxes(
    connection: Connection,
    items: list[ItemView],
    pools: dict[str, PoolRow],
    batch: _Batch,
    now: datetime,
) -> set[str]:
    """Insert each item's sandbox row for its attempt; the items whose row this made (an
    existing row, which the item's state rules out, is left to the one-by-one path)."""
    rows: list[dict[str, Any]] = [
        {
            "id": sandbox_id_for(item.id, item.attempts),
            "work_item_id": item.id,
            "attempt": item.attempts,
            "org_id": item.org_id,
            "pool_id": item.pool_id,
            "provider_id": pools[item.pool_id].provider_id,
            "status": SANDBOX_PROVISIONING,
            "lease_until": batch.lease,
            "lease_holder": batch.holders[item.id],
            "created_at": now,
            "metadata": {},
        }
        for item in items
    ]
    made = connection.execute(_INSERT_SANDBOXES, rows)
    return set(made.scalars())


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
        from_state, to = (state.value for state in _CLAIM_MOVE)
        events.append(event_row(item.id, from_state, to, actor=actor, at=now))
    return events


@dataclass(frozen=True)
class LockedHandle:
    """A handle to write, and what its writer found under the rows' locks (item row before
    sandbox row), its lease still held: the item's state and the sandbox's status."""

    write: HandleWrite
    item_state: str
    sandbox_status: str

    @property
    def item_moves(self) -> bool:
        return self.item_state == _HANDLE_MOVE[0].value

    @property
    def sandbox_moves(self) -> bool:
        # A runner may have registered and claimed already: never move backwards. Nor is
        # the sandbox of an item that ended made ready: its end is the caller's to record.
        ended = ItemState(self.item_state).is_final
        return self.sandbox_status == SANDBOX_PROVISIONING and not ended


def record_handles(db: Database, writes: Sequence[HandleWrite]) -> list[bool | None]:
    """:func:`write_handles` for the common case, batched: each handle whose sandbox is
    still this attempt's and still provisioning, its item too. True for those; None for the
    others (their rows held elsewhere, or another case), which
    :func:`corral.worker.provision._record_handle` decides one by one."""
    now = utcnow()
    by_sandbox = {write.sandbox_id: write for write in writes}
    with db.connection() as connection:
        rows = connection.execute(_LOCK_HANDLED, {"ids": sorted(by_sandbox)})
        ready = [
            LockedHandle(by_sandbox[sandbox_id], state, status)
            for state, sandbox_id, status, lease_until in rows
            if (state, status) == (PROVISIONING, SANDBOX_PROVISIONING)
            and lease_until == by_sandbox[sandbox_id].lease_until
        ]
        write_handles(connection, ready, now)
    recorded = {locked.write.sandbox_id for locked in ready}
    return [True if write.sandbox_id in recorded else None for write in writes]


def write_handles(connection: Connection, handles: Sequence[LockedHandle], now: datetime) -> None:
    """Record provider handles, all at ``now``: the one definition of the handle write,
    whichever path asks. Each sandbox gets its handle, is started with its deadline and its
    lease cleared; one still provisioning moves to ``ready`` (unless its item ended), an
    item still provisioning to ``awaiting_claim``; an audit row for each move. Three
    statements whatever the number of handles."""
    if not handles:
        return
    connection.execute(_SET_HANDLE, [_handle_parameters(locked, now) for locked in handles])
    moving = sorted(locked.write.work_item_id for locked in handles if locked.item_moves)
    if moving:
        connection.execute(_TO_AWAITING_CLAIM, {"ids": moving, "now": now})
    events = []
    for locked in handles:
        write = locked.write
        if locked.sandbox_moves:
            events.append(
                event_row(
                    write.work_item_id,
                    locked.sandbox_status,
                    _READY_STATUS,
                    actor=write.actor,
                    at=now,
                    sandbox_id=write.sandbox_id,
                    detail=f"handle {write.handle.external_id}",
                )
            )
        if locked.item_moves:
            from_state, to = (state.value for state in _HANDLE_MOVE)
            events.append(event_row(write.work_item_id, from_state, to, actor=write.actor, at=now))
    if events:
        connection.execute(_INSERT_EVENTS, events)


def _handle_parameters(locked: LockedHandle, now: datetime) -> dict[str, Any]:
    write, limit = locked.write, locked.write.session_limit_s
    return {
        "b_id": write.sandbox_id,
        "b_external_id": write.handle.external_id,
        "b_metadata": dict(write.handle.metadata),
        "b_now": now,
        "b_deadline": now + timedelta(seconds=limit) if limit else None,
        "b_status": _READY_STATUS if locked.sandbox_moves else locked.sandbox_status,
    }


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
    .values(item_move_values(*_HANDLE_MOVE, bindparam("now", type_=UTCDateTime())))
)
# The sandbox's move to ready writes its status alone, which the handle's one UPDATE carries
# per row (a row that does not move keeps its own); a stamp of ready's would belong there too.
_READY_VALUES = sandbox_move_values(SandboxState.READY, None)
if _READY_VALUES.keys() != {"status"}:
    raise RuntimeError(f"the handle write does not write {sorted(_READY_VALUES)}")
_READY_STATUS = str(_READY_VALUES["status"])
_SET_HANDLE = (
    update(_SANDBOXES)
    .where(_SANDBOXES.c.id == bindparam("b_id"))
    .values(
        external_id=bindparam("b_external_id"),
        metadata=bindparam("b_metadata", type_=JSON()),
        started_at=bindparam("b_now", type_=UTCDateTime()),
        deadline_at=bindparam("b_deadline", type_=UTCDateTime()),
        lease_until=None,
        status=bindparam("b_status"),
    )
)
