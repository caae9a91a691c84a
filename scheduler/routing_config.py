"""What routing reads, read once, the same way for every routing path.

:func:`read_config` reads the routing configuration of some requests (their profiles' auth
modes, their orgs' limits and active pools) in a transaction; :func:`read_config_unlocked` is
the same read as one statement that locks nothing (PostgreSQL, a batch of unlimited orgs);
a batch may instead be routed on a configuration kept from an earlier read
(:mod:`corral.scheduler.routing_cache`). :class:`Board` turns a configuration into each
request's :class:`~corral.scheduler.placement.Facts`, applying the pools' breakers and
reading the spent budgets, and keeps the slots the requests it routed took. The one-item path
(:mod:`corral.scheduler.intake`) and the batch path (:mod:`corral.scheduler.batch`) both
route through it, so they consult the same facts for the same request. A requeued item's
earlier attempts are read by :func:`failed_pools_of` (the batch path writes new items, which
have none).
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from datetime import datetime
from typing import Any, cast

from sqlalchemy import JSON, Connection, Select, Table, bindparam, func, select, type_coerce
from sqlalchemy.orm import Session
from sqlalchemy.sql.elements import BindParameter

from corral.scheduler.placement import Facts
from corral.shared.messages import DispatchRequest
from corral.shared.settings import IntakeSettings
from corral.shared.store import attempts, breaker, budgets, org_policies
from corral.shared.store.models import ModelProfile, OrgPolicy, Pool, RoutingConfigVersion
from corral.shared.store.org_limits import OrgRoom, limited_among
from corral.shared.store.pools import ROUTING_COLUMNS, PoolRecord, PoolView, pool_view

_POOLS = cast(Table, Pool.__table__)
_VERSION = cast(Table, RoutingConfigVersion.__table__)
_PROFILE_ROWS = cast(Table, ModelProfile.__table__)
_POLICIES = cast(Table, OrgPolicy.__table__)


@dataclass(frozen=True)
class OverBudget:
    """The spent budgets routing must respect: by org, and by pool, what each says."""

    orgs: dict[str, str]
    pools: dict[str, str]

    @classmethod
    def read(
        cls,
        session: Session,
        org_ids: Iterable[str],
        pools: Iterable[PoolRecord],
        *,
        max_age_s: float,
    ) -> OverBudget:
        """The spent budgets of ``org_ids`` and of ``pools``, each spend at most
        ``max_age_s`` old (``CORRAL_BUDGET_CHECK_INTERVAL_S``)."""
        names = {pool.id: pool.name for pool in pools}
        orgs, by_pool = {}, {}
        for state in budgets.states(session, org_ids, max_age_s=max_age_s):
            if not state.exhausted:
                continue
            pool_id = state.budget.pool_id
            if pool_id is None:
                orgs[state.budget.org_id] = state.describe()
            else:
                by_pool[pool_id] = state.describe(names.get(pool_id))
        return cls(orgs, by_pool)


@dataclass(frozen=True)
class Config:
    """What routing reads for some requests: each named profile's auth mode, each limited
    org's room, and the orgs' active pools (rows of :data:`ROUTING_COLUMNS`, in id order);
    the configuration's version when known, and, when kept from an earlier read
    (:mod:`corral.scheduler.routing_cache`), the pools' slot counters and views."""

    profiles: Mapping[str, str]
    room: OrgRoom
    pools: Sequence[Any]
    version: int | None = None
    counts: Mapping[str, int] | None = None
    views: Mapping[str, PoolView] | None = None
    policies: Mapping[str, tuple[Any, Any]] = field(default_factory=dict)  # stored, by org


def read_config(
    session: Session, requests: Sequence[DispatchRequest], *, lock: bool, fresh: bool = False
) -> Config:
    """The requests' :class:`Config` in the session's transaction (limited orgs' rows
    locked first; with ``lock``, the pools' too, under ``FOR NO KEY UPDATE``, in id order,
    which leaves foreign-key checks free). ``fresh``: the requests arrive now, and take no
    room of an org whose waiting items wait for it (:meth:`OrgRoom.read`)."""
    connection = session.connection()  # Core reads: no ORM objects on the hot path
    names = sorted({r.profile for r in requests})
    found = connection.execute(_PROFILES, {"names": names}).all()
    orgs = sorted({r.org for r in requests})
    room = OrgRoom.read(session, orgs, fresh=fresh)  # locks limited orgs first
    pools = connection.execute(_LOCKED_POOLS_OF if lock else _POOLS_OF, {"orgs": orgs}).all()
    return Config(dict(found), room, pools, policies=org_policies.stored_of(session, orgs))


def read_config_unlocked(
    connection: Connection, requests: Sequence[DispatchRequest]
) -> Config | None:
    """:func:`read_config` in one statement, locking nothing (PostgreSQL), with the
    configuration's version; None when an org of the requests has a limit, whose row must
    be locked while its pools' slots are read."""
    names = sorted({r.profile for r in requests})
    orgs = sorted({r.org for r in requests})
    rows = connection.execute(_CONFIG_AND_POOLS, {"names": names, "orgs": orgs}).all()
    if rows[0].limited:
        return None
    pools = [row for row in rows if row.id is not None]  # none: a row of nulls
    policies = {org: tuple(stored) for org, stored in (rows[0].policies or {}).items()}
    return Config(
        rows[0].profiles or {}, OrgRoom(), pools, version=rows[0].version, policies=policies
    )


@dataclass
class Board:
    """One routing pass over a :class:`Config`: the facts each request is routed on, and
    the slots the requests routed so far took (so the next one sees them gone)."""

    config: Config
    settings: IntakeSettings
    over: OverBudget
    by_org: dict[str, list[PoolView]]
    counts: dict[str, int]
    given: dict[str, int] = field(default_factory=dict)
    _lease_by_pool: dict[str, Any] | None = None

    @classmethod
    def read(
        cls,
        session: Session,
        config: Config,
        orgs: Collection[str],
        settings: IntakeSettings,
        now: datetime,
    ) -> Board:
        """The board of ``config`` for requests of ``orgs``: the pools' views with their
        breakers as of ``now``, and the spent budgets (read through the budgets' own cache)."""
        views = config.views or {}
        by_org: dict[str, list[PoolView]] = {}
        for row in config.pools:
            gate, view = breaker.gate(row, settings, now), views.get(row.id)
            if view is None:
                view = pool_view(row, breaker=gate)
            elif view.breaker != gate:
                view = replace(view, breaker=gate)
            by_org.setdefault(row.org_id, []).append(view)
        counts = dict(config.counts or {row.id: row.slots_in_use for row in config.pools})
        max_age_s = settings.budget_check_interval_s
        over = OverBudget.read(session, orgs, config.pools, max_age_s=max_age_s)
        return cls(config, settings, over, by_org, counts)

    def facts(
        self, request: DispatchRequest, *, failed_pools: frozenset[str] = frozenset()
    ) -> Facts:
        """What the gates consult for ``request``, after the slots taken so far;
        ``failed_pools``: those that failed to make its sandbox before (a requeued item's,
        :func:`corral.shared.store.attempts.failed_pools`)."""
        return Facts(
            auth_mode=self.config.profiles.get(request.profile),
            org_full=self.config.room.full(request.org),
            org_over_budget=self.over.orgs.get(request.org),
            pools=self.by_org.get(request.org, ()),
            in_use=self.counts,
            pools_over_budget=self.over.pools,
            network_allowed=self.settings.network_allowed(request.org),
            policy=org_policies.effective(
                self.config.policies.get(request.org), self.settings.item_images
            ),
            failed_pools=failed_pools,
        )

    def take(self, org_id: str, pool: PoolView) -> None:
        """A request of ``org_id`` was routed to ``pool``: its slot (and the org's room)
        is gone for the requests after it; a half-open pool's one probe is sent."""
        self.config.room.take(org_id)
        self.counts[pool.id] += 1
        self.given[pool.id] = self.given.get(pool.id, 0) + 1
        if pool.breaker == breaker.PROBE:
            self.pass_by(pool)

    def mark_full(self, pool: PoolView) -> None:
        """``pool`` turned out to have no slot left (another router took it)."""
        self.counts[pool.id] = pool.slot_limit

    def pass_by(self, pool: PoolView) -> None:
        """Route nothing more to ``pool`` in this pass (its probe went to another item)."""
        pools = self.by_org[pool.org_id]
        pools[pools.index(pool)] = replace(pool, breaker=breaker.SKIP)

    def lease_of(self, pool_id: str) -> dict[str, Any] | None:
        """The pool's default lease policy, as read (one lookup: a batch asks it per item)."""
        return self._leases.get(pool_id)

    @property
    def _leases(self) -> dict[str, Any]:
        if self._lease_by_pool is None:
            self._lease_by_pool = {row.id: row.lease for row in self.config.pools}
        return self._lease_by_pool


def failed_pools_of(session: Session, item_id: str, *, attempts_made: int) -> frozenset[str]:
    """The pools routing passes by for item ``item_id`` after ``attempts_made`` attempts:
    those whose provider failed to make its sandbox (failover). No read for an item not yet
    routed."""
    if attempts_made == 0:
        return frozenset()
    return frozenset(attempts.failed_pools(session, item_id))


# The reads, built once (building them costs about as much as running them), of the tables,
# not the ORM classes: no ORM compilation or objects for each batch.
_PROFILES = select(_PROFILE_ROWS.c.name, _PROFILE_ROWS.c.auth_mode).where(
    _PROFILE_ROWS.c.name.in_(bindparam("names", expanding=True))
)
_POOLS_OF = (
    select(*(_POOLS.c[name] for name in ROUTING_COLUMNS))
    .where(_POOLS.c.org_id.in_(bindparam("orgs", expanding=True)), _POOLS.c.active.is_(True))
    .order_by(_POOLS.c.id)
)
_LOCKED_POOLS_OF = _POOLS_OF.with_for_update(key_share=True)  # FOR NO KEY UPDATE


def _config_and_pools() -> Select[Any]:
    """:func:`read_config`'s reads as one statement, on PostgreSQL: one row per pool (or
    one of nulls, for orgs without one), each with the profiles' auth modes (a JSON object),
    how many of the orgs have a limit, and the configuration's version."""
    orgs: BindParameter[str] = bindparam("orgs", expanding=True)
    modes = (
        select(func.json_object_agg(_PROFILE_ROWS.c.name, _PROFILE_ROWS.c.auth_mode))
        .where(_PROFILE_ROWS.c.name.in_(bindparam("names", expanding=True)))
        .scalar_subquery()
    )
    limited = limited_among(orgs)
    version = select(_VERSION.c.version).where(_VERSION.c.id == 1).scalar_subquery()
    policies = (
        select(
            func.json_object_agg(
                _POLICIES.c.org_id,
                func.json_build_array(_POLICIES.c.item_images, _POLICIES.c.regions),
            )
        )
        .where(_POLICIES.c.org_id.in_(orgs))
        .scalar_subquery()
    )
    config = select(
        type_coerce(modes, JSON()).label("profiles"),
        limited.label("limited"),
        version.label("version"),
        type_coerce(policies, JSON()).label("policies"),
    ).subquery("config")
    active = _POOLS.c.org_id.in_(orgs) & _POOLS.c.active.is_(True)
    columns = (config.c.profiles, config.c.limited, config.c.version, config.c.policies)
    return (
        select(*columns, *(_POOLS.c[n] for n in ROUTING_COLUMNS))
        .select_from(config)
        .outerjoin(_POOLS, active)
        .order_by(_POOLS.c.id)
    )


_CONFIG_AND_POOLS = _config_and_pools()
