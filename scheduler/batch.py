"""Accepting and routing a batch of dispatch messages in one transaction.

Per batch, not per item: one read of the idempotency keys already taken, one read of the
profiles and one of the orgs' active pools (no lock), routing in memory against the pools'
slot counters, one multi-row insert of the items in their routed state (or waiting, or
failed with their dispatch error), one of their lifecycle events, and, last, one guarded
counter update per pool that gave slots (in id order; see :func:`accept_batch`). The items
and their events are committed before any provision task for them is published.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass, replace
from datetime import datetime
from typing import Any, cast

from sqlalchemy import (
    JSON,
    BigInteger,
    Connection,
    Integer,
    Select,
    Table,
    Text,
    bindparam,
    func,
    insert,
    literal_column,
    or_,
    select,
    tuple_,
    update,
)
from sqlalchemy import cast as sql_cast
from sqlalchemy.exc import DBAPIError, IntegrityError
from sqlalchemy.orm import Session
from sqlalchemy.sql.schema import ColumnDefault
from sqlalchemy.sql.selectable import TableValuedAlias

from corral.scheduler import routing_cache
from corral.scheduler.admission import NOT_WAITING, Wait, queue_key, wait_of
from corral.scheduler.errors import (
    DispatchError,
    SecretKeyMissingError,
)
from corral.scheduler.intake import (
    NO_ORIGIN,
    Origin,
    RouteOutcome,
    expired_at_intake,
    new_item_id,
    resume,
    unknown_secrets,
)
from corral.scheduler.placement import Facts, decide
from corral.scheduler.routing import Exhausted, Routed
from corral.scheduler.routing_config import Board, Config, read_config, read_config_unlocked
from corral.shared import logs
from corral.shared.messages import DispatchRequest
from corral.shared.settings import IntakeSettings
from corral.shared.store import breaker, liveness
from corral.shared.store.db import Database, utcnow
from corral.shared.store.driver_sql import DriverStatement
from corral.shared.store.leases import chosen
from corral.shared.store.lifecycle import EVENTS, event_row, item_creation_values
from corral.shared.store.models import (
    ItemState,
    Pool,
    RoutingConfigVersion,
    WorkItem,
)
from corral.shared.store.org_limits import OrgRoom
from corral.shared.store.outcomes import Final, note_final
from corral.shared.store.pools import PoolView
from corral.shared.store.sealing import Sealer, stored
from corral.shared.store.slots import close, take_slots, within

OPTIMISTIC_TRIES = 3  # batches routed on unlocked counters before one routed under lock
log = logging.getLogger(__name__)
_ITEMS = cast(Table, WorkItem.__table__)
_POOLS = cast(Table, Pool.__table__)
_VERSION = cast(Table, RoutingConfigVersion.__table__)


@dataclass(frozen=True)
class Placement:
    """Where one request goes: a pool and queue, a wait, or a dispatch error."""

    state: ItemState
    pool: PoolView | None = None
    queue: str | None = None
    error: DispatchError | None = None
    pool_lease: dict[str, Any] | None = None  # the chosen pool's default lease policy
    passed_full: frozenset[str] = frozenset()  # pools passed by as full (routing.Routed)
    unserved: bool = False  # no worker consumes its queue: its routing event says so
    wait: Wait | None = None  # a waiting item's: what holds it (scheduler/admission.py)


@dataclass(frozen=True)
class Taken:
    """One request of a batch: its item, whether this batch wrote it, and whether the item
    was there before the batch (a second delivery, which may still owe a step)."""

    item_id: str
    created: bool
    outcome: RouteOutcome
    existed: bool = False


class _SlotsMoved(Exception):  # noqa: N818 - a signal within this module, not an error
    """Another router took a pool's slots between this batch's read and its update."""


def accept_batch(
    db: Database,
    requests: Sequence[DispatchRequest],
    *,
    actor: str,
    settings: IntakeSettings,
    origins: Sequence[Origin] = (),
) -> list[Taken]:
    """Write and route ``requests`` in one transaction; one :class:`Taken` per request
    (each with its :class:`~corral.scheduler.intake.Origin` in ``origins``, when given: its
    message's task id and reply, kept on its item).

    A request whose ``(org, idempotency_key)`` already has an item (from before, or earlier
    in the same batch) gets that item, ``created=False``. Keys are not looked up first: a
    batch is written as if none had been seen (one statement fewer for every batch), and
    only when the unique key refuses its insert is it written again, knowing them.

    The pools' counters are read without a lock and taken by guarded updates, the last
    statements before the commit, so a pool row is locked only for that moment (routing
    on one pool does not serialise on it, and the provider workers' inserts that check the
    pool as a foreign key never wait). When another router took a pool's slots meanwhile the
    transaction is rolled back and the batch routed again on fresh counters; the last try
    reads them under lock, so it cannot lose.
    """
    if not requests:
        return []
    look_up = False  # first, as if no key had been seen: a second delivery is rare
    attempt = 0
    while attempt <= OPTIMISTIC_TRIES:
        try:
            lock = attempt == OPTIMISTIC_TRIES
            return _accept(
                db,
                requests,
                actor=actor,
                settings=settings,
                lock=lock,
                look_up=look_up,
                origins=origins,
            )
        except IntegrityError:
            if look_up:
                raise
            look_up = True  # a key has an item already: write the batch again, knowing them
        except _SlotsMoved:
            log.debug("intake: a pool's slots moved under a batch; routing it again")
            attempt += 1
    raise AssertionError("a batch routed under lock cannot lose its slots")


def _accept(
    db: Database,
    requests: Sequence[DispatchRequest],
    *,
    actor: str,
    settings: IntakeSettings,
    lock: bool,
    look_up: bool,
    origins: Sequence[Origin],
) -> list[Taken]:
    if db.is_postgres and not (lock or look_up):
        unlocked = _accept_unlocked(db, requests, actor=actor, settings=settings, origins=origins)
        if unlocked is not None:
            return unlocked
    now = utcnow()
    with db.session() as session:
        known = _known_keys(session, requests) if look_up else {}
        fresh, taken = _assign_ids(requests, known)
        placements, slots = _place_sealable(session, fresh, db.sealer, settings, lock=lock)
        at = _At(db.sealer, actor, now, origins, settings.priority_aging_s)
        batch = _rows(fresh, placements, taken, at)
        note_final(session, batch.ended)
        _write(session, batch, slots)
        _take_probes(session, placements, settings)
    return [taken[index] for index in range(len(requests))]


def _accept_unlocked(
    db: Database,
    requests: Sequence[DispatchRequest],
    *,
    actor: str,
    settings: IntakeSettings,
    origins: Sequence[Origin],
) -> list[Taken] | None:
    """:func:`_accept` on PostgreSQL without a transaction around the reads: the profiles,
    the orgs' limits and pools are one statement, and a batch whose items all go to one
    pool is written by one more (:data:`_ONE_POOL_WRITE`, which takes the slots only if
    they are still free): two round trips, each committing on its own. Other batches are
    written in a transaction, as :func:`_accept` does. None when an org of the batch has a
    limit: its row must be locked while its pools' slots are read
    (:mod:`corral.shared.store.org_limits`).

    A batch whose orgs and profiles the process keeps (:mod:`corral.scheduler.routing_cache`)
    skips the read: one round trip, :func:`_accept_kept`.
    """
    at = _At(db.sealer, actor, utcnow(), origins, settings.priority_aging_s)
    fresh, taken = _assign_ids(requests, {})
    wanted = [request for _, request, _ in fresh]
    cache = routing_cache.of(db)
    kept = cache.kept({r.profile for r in wanted}, {r.org for r in wanted})
    if kept is not None and _accept_kept(db, fresh, taken, kept, settings, at=at):
        return [taken[index] for index in range(len(requests))]
    with db.autocommit() as connection, Session(bind=connection) as reads:
        config = read_config_unlocked(connection, wanted)
        if config is None:
            return None
        if config.version is not None:  # none: the version row is gone, keep nothing
            orgs = {request.org for request in wanted}
            views = cache.remember(
                config.version, config.profiles, orgs, config.pools, config.policies
            )
            config = replace(config, views=views or None)  # built once, for both
        placements, slots = _place_sealable(
            reads, fresh, db.sealer, settings, lock=False, config=config
        )
        batch = _rows(fresh, placements, taken, at)
        if _one_statement(batch, placements, slots):
            # Routed on what this statement's read saw: like the transaction path, it
            # does not ask for the version (a change elsewhere meanwhile need not fail it).
            in_use = _write_one_pool(connection, batch, slots)
            cache.taken(*in_use)
            return [taken[index] for index in range(len(requests))]
    with db.session() as session:
        note_final(session, batch.ended)
        _write(session, batch, slots)
        _take_probes(session, placements, settings)
    return [taken[index] for index in range(len(requests))]


def _accept_kept(
    db: Database,
    fresh: list[tuple[int, DispatchRequest, str]],
    taken: dict[int, Taken],
    kept: routing_cache.Kept,
    settings: IntakeSettings,
    *,
    at: _At,
) -> bool:
    """Route and write the batch on the kept configuration (:mod:`corral.scheduler.routing_cache`)
    in one statement, which writes only while that configuration is current; False when
    the batch must be routed on a fresh read instead: it needs more than that statement, a
    decision depended on a kept slot counter, or the write found the configuration (or the
    pool's slots) changed and wrote nothing."""
    config = Config(
        kept.profiles,
        OrgRoom(),
        kept.pools,
        kept.version,
        kept.counts,
        kept.views,
        policies=kept.policies,
    )
    with Session(db.engine) as reads:  # budgets: read only when their own cache is stale
        placements, slots = _place_sealable(
            reads, fresh, db.sealer, settings, lock=False, config=config
        )
    if any(placement.passed_full for placement in placements):
        return False  # a kept counter said full: it may be stale high
    batch = _rows(fresh, placements, taken, at)
    if not _one_statement(batch, placements, slots):
        return False
    cache = routing_cache.of(db)
    try:
        with db.held("intake-write").use() as connection:
            in_use = _write_one_pool(connection, batch, slots, version=kept.version)
    except _SlotsMoved:
        cache.forget()
        return False
    cache.taken(*in_use)
    return True


def _one_statement(
    batch: _Batch, placements: Sequence[Placement], slots: dict[str, tuple[int, int]]
) -> bool:
    """Whether :data:`_ONE_POOL_WRITE` writes the whole batch: items that take one pool's
    slots, none ended at intake, no breaker probe and none waiting among them (the pools a
    waiting item waits for are closed to fresh arrivals: :func:`slots.close <close>`)."""
    probing = any(p.pool is not None and p.pool.breaker == breaker.PROBE for p in placements)
    waits = bool(batch.waited_for)
    return bool(batch.items) and len(slots) == 1 and not (batch.ended or probing or waits)


def _assign_ids(
    requests: Sequence[DispatchRequest], known: dict[tuple[str, str | None], str]
) -> tuple[list[tuple[int, DispatchRequest, str]], dict[int, Taken]]:
    """A new item id for each request, but for one whose ``(org, idempotency_key)`` is in
    ``known`` or earlier in the batch: it gets that item, not created here."""
    fresh: list[tuple[int, DispatchRequest, str]] = []
    taken: dict[int, Taken] = {}
    batch_ids: set[str] = set()
    for index, request in enumerate(requests):
        key = (request.org, request.idempotency_key)
        if request.idempotency_key is not None and key in known:
            existing = known[key]
            earlier = existing in batch_ids
            outcome = RouteOutcome(existing, ItemState.RECEIVED, detail="duplicate")
            taken[index] = Taken(existing, False, outcome, existed=not earlier)
            continue
        item_id = new_item_id()
        batch_ids.add(item_id)
        if request.idempotency_key is not None:
            known[key] = item_id
        fresh.append((index, request, item_id))
    return fresh, taken


@dataclass(frozen=True)
class _Batch:
    """The rows a batch writes, and the items it ends at intake (dispatch errors)."""

    items: list[dict[str, Any]]
    events: list[dict[str, Any]]
    ended: list[Final]
    waited_for: frozenset[str] = frozenset()  # the pools its waiting items wait for


@dataclass(frozen=True)
class _At:
    """How a batch's rows are written: sealed with ``sealer``, by ``actor`` at ``now``, each
    request's origin (by its place in the batch) in ``origins`` (none: no Celery message)."""

    sealer: Sealer
    actor: str
    now: datetime
    origins: Sequence[Origin] = ()
    aging_s: float = 300.0  # CORRAL_PRIORITY_AGING_S: a waiting item's place

    def origin(self, index: int) -> Origin:
        return self.origins[index] if self.origins else NO_ORIGIN


def _rows(
    fresh: Sequence[tuple[int, DispatchRequest, str]],
    placements: Sequence[Placement],
    taken: dict[int, Taken],
    at: _At,
) -> _Batch:
    """The item and event rows of the requests placed; each one's :class:`Taken` into
    ``taken``."""
    items, events, ended = [], [], []
    for (index, request, item_id), placement in zip(fresh, placements, strict=True):
        payload = stored(request.model_dump(mode="json"), at.sealer, request.org, item_id)
        origin = at.origin(index).columns()
        items.append(_item_row(item_id, payload, placement, at.now, _lease(request, placement)))
        items[-1]["expires_at"] = request.expires_at
        waits = placement.wait
        key = queue_key(request.priority, at.now, at.aging_s)
        items[-1] |= waits.columns(key) if waits is not None else NOT_WAITING
        items[-1] |= origin
        events += _event_rows(item_id, placement, at.actor, at.now)
        pool_id = placement.pool.id if placement.pool else None
        logs.remember(org_id=request.org, pool_id=pool_id, work_item_id=item_id)
        if placement.error is not None:  # a dispatch error: the item ends here
            state, code = placement.state.value, placement.error.code
            end = Final(item_id, state, code, None, request.org, at.now, origin["replies"], at.now)
            ended.append(end)
        outcome = RouteOutcome(
            item_id,
            placement.state,
            queue=placement.queue,
            detail=placement.error.message if placement.error else None,
        )
        taken[index] = Taken(item_id, True, outcome)
    waited_for = frozenset(
        p for placement in placements if placement.wait for p in placement.wait.pools
    )
    return _Batch(items, events, ended, waited_for)


def _write(session: Session, batch: _Batch, slots: dict[str, tuple[int, int]]) -> None:
    """Insert the batch's items and events and take its pools' slots, the guarded updates
    last. On PostgreSQL a batch that takes one pool's slots (the common case) does it all
    in one statement, :data:`_ONE_POOL_WRITE`.

    Raises:
        _SlotsMoved: another router took a pool's slots since they were read.
    """
    if not batch.items:
        return
    one_pool = len(slots) == 1 and not batch.waited_for
    if session.get_bind().dialect.name == "postgresql" and one_pool:
        _write_one_pool(session.connection(), batch, slots)
        return
    # Core inserts of the tables: one multi-row statement each (the ORM's bulk path
    # would fetch every new event's id back, one statement per row).
    session.execute(insert(_ITEMS), batch.items)
    session.execute(insert(EVENTS), batch.events)
    # The pools' rows in id order, as every path: take the slots, close those waited for.
    for pool_id in sorted(slots.keys() | batch.waited_for):
        if pool_id in slots:
            count, limit = slots[pool_id]
            if not take_slots(session, pool_id, count, limit=limit):
                raise _SlotsMoved(pool_id)
        if pool_id in batch.waited_for:
            close(session, [pool_id])


def _write_one_pool(
    connection: Connection,
    batch: _Batch,
    slots: dict[str, tuple[int, int]],
    *,
    version: int | None = None,
) -> tuple[str, int]:
    """:data:`_ONE_POOL_WRITE` of ``batch``, which takes the slots of its one pool (with
    ``version``: only while the routing configuration is at that version); the pool and its
    slots in use after it.

    Raises:
        _SlotsMoved: another router took the pool's slots since they were read, or the
            configuration changed; nothing of the statement was written.
    """
    [(pool_id, (count, limit))] = slots.items()
    parameters = {
        "pool_id": pool_id,
        "count": count,
        "slot_limit": limit,
        "config_version": version,
        "items": _as_json(_with_defaults(_ITEMS, batch.items)),
        "events": _as_json(batch.events),
    }
    try:
        in_use = _ONE_POOL_WRITE.run(connection, parameters).one().in_use
    except DBAPIError as exc:
        if getattr(exc.orig, "sqlstate", None) == SLOTS_TAKEN:
            raise _SlotsMoved(pool_id) from None
        raise
    return pool_id, int(in_use)


# What corral_slots_taken() raises (migration 0017): the guarded update changed no pool row.
SLOTS_TAKEN = "CR001"


_SLOT_LIMIT = bindparam("slot_limit", type_=Integer())


def _one_pool_write() -> Select[Any]:
    """A batch's write on PostgreSQL when it takes one pool's slots, as one statement: the
    inserts of its items and events as data-modifying CTEs, and the guarded update of the
    pool's counter. The rows travel as two JSON parameters (``items``, ``events``) read by
    ``json_populate_recordset``, so the statement's text is the same for every batch (one
    compilation, and psycopg prepares it once); it runs as driver SQL
    (:mod:`corral.shared.store.driver_sql`), being on the way from a dispatch to ``provision()``.
    No parameter may share a pools column's name: SQLAlchemy would take it for one more SET.

    All or nothing on its own (it runs outside a transaction on the intake's hot path):
    when the guard finds the slots gone, ``corral_slots_taken`` raises and the whole
    statement, inserts included, is undone.

    The update's condition counts the inserted rows: PostgreSQL runs a CTE nobody reads
    after the main statement, which would hold the pool row's lock while a big batch is
    inserted; read in the condition, the inserts run before the row is locked, and the lock
    is held only from the update to the commit."""
    count = bindparam("count", type_=Integer())
    item_rows = _recordset(_ITEMS, "items")
    event_columns = [column.name for column in EVENTS.c if column.name != "id"]
    event_rows = _recordset(EVENTS, "events")
    items = (
        insert(_ITEMS)
        .from_select([c.name for c in _ITEMS.c], select(*item_rows.c))
        .returning(_ITEMS.c.id)
        .cte("items")
    )
    events = (
        insert(EVENTS)
        .from_select(event_columns, select(*(event_rows.c[n] for n in event_columns)))
        .returning(EVENTS.c.id)
        .cte("events")
    )
    written = (
        select(func.count()).select_from(items).scalar_subquery()
        + select(func.count()).select_from(events).scalar_subquery()
    )
    version = select(_VERSION.c.version).where(_VERSION.c.id == 1).scalar_subquery()
    asked = sql_cast(bindparam("config_version"), BigInteger())
    taken = (
        update(_POOLS)
        .where(
            _POOLS.c.id == bindparam("pool_id"),
            written > 0,  # always: a batch writes items; see above
            within(_POOLS.c.slots_in_use, _POOLS.c.share_limit, count, _SLOT_LIMIT),
            # the configuration routed on is current (no version given: not asked)
            or_(asked.is_(None), version == asked),
        )
        .values(slots_in_use=_POOLS.c.slots_in_use + count)
        .returning(_POOLS.c.id, _POOLS.c.slots_in_use)
        .cte("taken")
    )
    changed = select(func.count()).select_from(taken).scalar_subquery()
    in_use = select(taken.c.slots_in_use).scalar_subquery()
    return select(
        func.corral_slots_taken(changed, bindparam("pool_id")).label("changed"),
        in_use.label("in_use"),
    )


def _recordset(table: Table, name: str) -> TableValuedAlias:
    """The rows of the JSON parameter ``name`` as rows of ``table`` (a key missing from an
    object is NULL)."""
    rows = bindparam(name, type_=Text()).cast(JSON())
    return func.json_populate_recordset(literal_column(f"NULL::{table.name}"), rows).table_valued(
        *(column.name for column in table.c)
    )


def _as_json(rows: list[dict[str, Any]]) -> str:
    return json.dumps(rows, default=lambda value: value.isoformat())  # datetimes


_ONE_POOL_WRITE = DriverStatement(_one_pool_write())


def _with_defaults(table: Table, rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``rows`` with the table's client-side column defaults filled in, which SQLAlchemy
    fills for its own INSERT statements only."""
    missing = {}
    for column in table.c:
        default = column.default
        if column.name in rows[0] or not isinstance(default, ColumnDefault):
            continue
        if default.is_callable:
            missing[column.name] = default.arg(None)
        elif default.is_scalar:
            missing[column.name] = default.arg
    return [{**missing, **row} for row in rows] if missing else rows


def _take_probes(
    session: Session, placements: Sequence[Placement], settings: IntakeSettings
) -> None:
    """The half-open pools this batch sends a probe: each must still be this batch's to
    probe (another router may have taken it), else the batch is placed again."""
    for placement in placements:
        pool = placement.pool
        probing = pool is not None and pool.breaker == breaker.PROBE
        if probing and pool and not breaker.take_probe(session, pool.id, settings):
            raise _SlotsMoved(pool.id)


def owed(
    db: Database, taken: Sequence[Taken], *, actor: str, settings: IntakeSettings
) -> list[RouteOutcome]:
    """The routing decisions whose provision tasks a batch must publish: those of the items
    it wrote, and what an item from before still owes (a second delivery finishes what the
    first may have left: routing it, or sending its provision task again)."""
    outcomes = []
    for one in taken:
        if one.created:
            outcomes.append(one.outcome)
        elif one.existed:
            outcomes.append(resume(db, one.item_id, actor=actor, settings=settings))
    return outcomes


def _known_keys(
    session: Session, requests: Sequence[DispatchRequest]
) -> dict[tuple[str, str | None], str]:
    keys = {(r.org, r.idempotency_key) for r in requests if r.idempotency_key is not None}
    if not keys:
        return {}
    rows = session.execute(
        select(WorkItem.org_id, WorkItem.idempotency_key, WorkItem.id).where(
            tuple_(WorkItem.org_id, WorkItem.idempotency_key).in_(sorted(keys))
        )
    )
    return {(org, key): item_id for org, key, item_id in rows}


def place(
    session: Session,
    requests: Sequence[DispatchRequest],
    *,
    settings: IntakeSettings,
    lock: bool = False,
    config: Config | None = None,
) -> tuple[list[Placement], dict[str, tuple[int, int]]]:
    """Route ``requests`` in order against the orgs' pools; their placements, and the slots
    to take: ``{pool id: (count, the pool's slot limit)}``.

    The configuration is read once (:func:`~corral.scheduler.routing_config.read_config`,
    ``lock``: the pools' rows locked), unless ``config`` was read already, and each pool
    that gives slots is named once.
    """
    if not requests:
        return [], {}
    config = config or read_config(session, requests, lock=lock, fresh=True)  # arrivals
    board = Board.read(session, config, {r.org for r in requests}, settings, utcnow())
    limits: dict[str, int] = {}
    placements = []
    for request in requests:
        placement = _placement(request, board.facts(request))
        pool = placement.pool
        if pool is not None:
            board.take(request.org, pool)
            placement = replace(placement, pool_lease=board.lease_of(pool.id))
            limits[pool.id] = pool.slot_limit
        placements.append(placement)
    return placements, {pool_id: (n, limits[pool_id]) for pool_id, n in board.given.items()}


def _placement(request: DispatchRequest, facts: Facts) -> Placement:
    """The request's placement by the gates (:mod:`corral.scheduler.placement`)."""
    try:
        decision = decide(request, facts)
    except DispatchError as exc:
        return Placement(ItemState.DISPATCH_ERROR, error=exc)
    if isinstance(decision, Routed):
        return Placement(
            ItemState.ROUTED,
            pool=decision.pool,
            queue=decision.queue,
            passed_full=decision.passed_full,
        )
    # A batch writes new items: no attempt of theirs has failed on any pool yet.
    assert not isinstance(decision, Exhausted), "a new item has no failed pools"
    return Placement(
        ItemState.WAITING_CAPACITY, passed_full=decision.passed_full, wait=wait_of(decision)
    )


def _place_sealable(
    session: Session,
    fresh: list[tuple[int, DispatchRequest, str]],
    sealer: Sealer,
    settings: IntakeSettings,
    *,
    lock: bool,
    config: Config | None = None,
) -> tuple[list[Placement], dict[str, tuple[int, int]]]:
    """:func:`place`, but a request whose env values cannot be sealed (no secret key), whose
    own expiry has passed, or that refers to a named secret there is none of, is a dispatch
    error, routed nowhere and holding no slot."""
    now = utcnow()
    refused: dict[int, DispatchError] = {
        **unknown_secrets(session, [request for _, request, _ in fresh])
    }
    for i, (_, request, _) in enumerate(fresh):
        error: DispatchError | None = expired_at_intake(request, now)
        if not sealer.can_seal and _has_env(request):
            error = SecretKeyMissingError()
        if error is not None:
            refused[i] = error
    routable = [request for i, (_, request, _) in enumerate(fresh) if i not in refused]
    placed, slots = place(session, routable, settings=settings, lock=lock, config=config)
    if any(placement.queue for placement in placed):
        served = liveness.served_queues(session)
        placed = [
            replace(p, unserved=True) if p.queue and p.queue not in served else p for p in placed
        ]
    found = iter(placed)
    return [
        Placement(ItemState.DISPATCH_ERROR, error=refused[i]) if i in refused else next(found)
        for i in range(len(fresh))
    ], slots


def _has_env(request: DispatchRequest) -> bool:
    return bool(request.env or request.toolchain.env)


def _lease(request: DispatchRequest, placement: Placement) -> dict[str, Any] | None:
    """The lease fields chosen for a routed request (its own, else its pool's), as stored;
    None until it is routed."""
    if placement.pool is None:
        return None
    return chosen(request.lease, placement.pool_lease)


def _item_row(
    item_id: str,
    payload: dict[str, Any],
    placement: Placement,
    now: Any,
    lease: dict[str, Any] | None,
) -> dict[str, Any]:
    routed = placement.state is ItemState.ROUTED
    error = placement.error
    return {
        "id": item_id,
        "org_id": payload["org"],
        "project_id": payload["project"],
        "idempotency_key": payload.get("idempotency_key"),
        "profile": payload["profile"],
        "payload": payload,
        "pool_id": placement.pool.id if placement.pool else None,
        "queue": placement.queue,
        "attempts": 1 if routed else 0,
        "lease": lease,
        "error_code": error.code if error else None,
        "error_message": error.message if error else None,
        **item_creation_values(placement.state, now),
    }


def _event_rows(item_id: str, placement: Placement, actor: str, now: Any) -> list[dict[str, Any]]:
    if placement.pool is not None and placement.queue is not None:
        detail = f"pool {placement.pool.name} via {placement.queue}"
        if placement.unserved:
            detail += liveness.unserved_note(placement.queue)
    elif placement.error is not None:
        detail = placement.error.code
    else:
        assert placement.wait is not None  # the one other placement: a wait
        detail = placement.wait.detail
    received = ItemState.RECEIVED.value
    return [
        event_row(item_id, None, received, actor=actor, at=now, detail="accepted"),
        event_row(item_id, received, placement.state.value, actor=actor, at=now, detail=detail),
    ]
