"""The routing configuration an intake process read last, kept while it is current.

Routing a batch reads the orgs' active pools and policies, the profiles' auth modes and
whether an org has a limit (:mod:`corral.scheduler.batch`). Those change rarely, so each
process keeps what it read, with the version of the configuration it read it at (the one row of
``routing_config_version``, bumped by triggers at the commit of every change routing reads:
migration 0018). A batch routed on what is kept is written by one statement that takes its
pool's slots only while that version is still current: a configuration changed meanwhile
makes the write fail, whole, and the batch is routed again on a fresh read. So no batch is
written on a pool, priority, breaker, profile or org limit that had changed when its write
began. (A change that commits while the write waits for the pool's row lock is ordered
after the batch, as on every path: the version is read once, as the statement starts.)

Slot counters move all the time, so the kept ones are only what this process last saw: its
own writes' results. They can be low (another router took slots since): the write's guard
refuses slots that are gone. They can be high (slots were freed since): so a batch in which
routing passed a pool by as full (``route()`` answers the pools it found full:
:attr:`~corral.scheduler.routing.Routed.passed_full`) is not written on what is kept; it is
routed on a fresh read instead. Routing says what it consulted, and the cache checks
exactly that.

PostgreSQL only (the triggers); on SQLite every batch reads the configuration.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from corral.shared.store.db import Database
from corral.shared.store.pools import PoolView, pool_view

MAX_ORGS = 10_000  # orgs whose pools a process keeps; past that it starts over


@dataclass(frozen=True)
class Kept:
    """The configuration a batch may be routed on, as of ``version``: the named profiles'
    auth modes, the orgs' active pools (rows of ROUTING_COLUMNS, in id order), each pool's
    routing view (breaker not applied) and slot counter as last seen, and the orgs' stored
    policies (:mod:`corral.shared.store.org_policies`). Not to be changed."""

    version: int
    profiles: Mapping[str, str]
    pools: Sequence[Any]
    views: Mapping[str, PoolView]
    counts: Mapping[str, int]
    policies: Mapping[str, tuple[Any, Any]]


class RoutingCache:
    """One process's kept configuration (shared by its intake loops)."""

    def __init__(self, max_orgs: int = MAX_ORGS) -> None:
        self._lock = threading.Lock()
        self._max_orgs = max_orgs
        self._version: int | None = None
        self._profiles: dict[str, str] = {}
        self._pools: dict[str, tuple[Any, ...]] = {}  # org: its active pools' rows
        self._policies: dict[str, tuple[Any, Any] | None] = {}  # org: its stored policy
        self._views: dict[str, PoolView] = {}
        self._counts: dict[str, int] = {}

    def kept(self, profiles: Collection[str], orgs: Collection[str]) -> Kept | None:
        """What is kept for a batch naming ``profiles`` and ``orgs``; None unless all of it
        is (a profile never seen, an org never read or one with a limit)."""
        with self._lock:
            if self._version is None:
                return None
            if not all(name in self._profiles for name in profiles):
                return None
            if not all(org in self._pools for org in orgs):
                return None
            pools = sorted((row for org in orgs for row in self._pools[org]), key=_pool_id)
            return Kept(
                self._version,
                {name: self._profiles[name] for name in profiles},
                pools,
                {row.id: self._views[row.id] for row in pools},
                {row.id: self._counts[row.id] for row in pools},
                {org: p for org in orgs if (p := self._policies[org]) is not None},
            )

    def remember(
        self,
        version: int,
        profiles: Mapping[str, str],
        orgs: Iterable[str],
        pools: Sequence[Any],
        policies: Mapping[str, tuple[Any, Any]],
    ) -> Mapping[str, PoolView]:
        """Keep a read made at ``version``: the named profiles that exist, and each of
        ``orgs``'s active pools (none of them has a limit). A read older than what is kept
        is dropped; a newer one replaces everything. The pools' routing views (breaker not
        applied), for the batch that read them."""
        views = {row.id: pool_view(row) for row in pools}
        with self._lock:
            if self._version is not None and version < self._version:
                return views
            if version != self._version or len(self._pools) >= self._max_orgs:
                self._clear()
                self._version = version
            self._profiles.update(profiles)
            by_org: dict[str, list[Any]] = {org: [] for org in orgs}
            for row in pools:
                by_org[row.org_id].append(row)
                self._counts[row.id] = row.slots_in_use
            self._pools.update({org: tuple(rows) for org, rows in by_org.items()})
            self._policies.update({org: policies.get(org) for org in by_org})
            self._views.update(views)
        return views

    def taken(self, pool_id: str, in_use: int) -> None:
        """A write of this process left ``pool_id`` with ``in_use`` slots taken."""
        with self._lock:
            if pool_id in self._counts:
                self._counts[pool_id] = in_use

    def forget(self) -> None:
        """Read everything again (a write found the kept configuration out of date)."""
        with self._lock:
            self._clear()

    def _clear(self) -> None:
        self._version = None
        self._profiles.clear()
        self._pools.clear()
        self._policies.clear()
        self._views.clear()
        self._counts.clear()


def _pool_id(row: Any) -> str:
    return str(row.id)


_caches: weakref.WeakKeyDictionary[Database, RoutingCache] = weakref.WeakKeyDictionary()
_caches_lock = threading.Lock()


def of(db: Database) -> RoutingCache:
    """The process's cache for ``db``."""
    with _caches_lock:
        cache = _caches.get(db)
        if cache is None:
            cache = _caches[db] = RoutingCache()
        return cache
