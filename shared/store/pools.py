"""Pools as routing and the provision path see them: capabilities derived, limits applied.

Both the scheduler (routing) and the provider workers (a sandbox's session limit) read a
pool through :func:`pool_view`, so they agree on what a pool offers.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, Protocol

from corral.providers.capabilities import (
    ENFORCEMENT_FIELDS,
    LEGACY_NETWORK_POLICY_FIELD,
    ProviderCapabilities,
    Substrate,
    derive_capabilities,
)
from corral.providers.errors import InvalidCapabilityOverrideError
from corral.providers.registry import default_registry


class PoolRecord(Protocol):
    """What :func:`pool_view` reads of a pool: a :class:`Pool`, or a row of routing's own
    read of the pools table (:data:`ROUTING_COLUMNS`)."""

    @property
    def id(self) -> str: ...
    @property
    def name(self) -> str: ...
    @property
    def org_id(self) -> str: ...
    @property
    def provider_id(self) -> str: ...
    @property
    def priority(self) -> int: ...
    @property
    def max_concurrent(self) -> int: ...
    @property
    def runtime_provides(self) -> Mapping[str, Any] | None: ...
    @property
    def capabilities(self) -> Mapping[str, Any] | None: ...
    @property
    def share_limit(self) -> int | None: ...


# What PoolView.build takes of a pool (the PoolRecord fields).
VIEW_COLUMNS = (
    "id",
    "name",
    "org_id",
    "provider_id",
    "priority",
    "max_concurrent",
    "runtime_provides",
    "capabilities",
    "share_limit",
)
# The columns routing reads of a pool: the view's, its slot counter, its breaker and its
# lease policy (not its sandbox config, rate card or warm settings).
ROUTING_COLUMNS = (
    *VIEW_COLUMNS,
    "slots_in_use",
    "breaker_state",
    "breaker_opened_at",
    "breaker_probe_at",
    "lease",
)


class ProvisionPool(PoolRecord, Protocol):
    """What the provision path reads of a pool: a :class:`Pool`, or the :class:`PoolRow` a
    claim answers with."""

    @property
    def sandbox_config(self) -> Mapping[str, Any]: ...
    @property
    def breaker_state(self) -> str: ...
    @property
    def breaker_failures(self) -> int: ...
    @property
    def warm_min(self) -> int: ...
    @property
    def warm_schedule(self) -> Sequence[Mapping[str, Any]] | None: ...


# The columns of a ProvisionPool.
PROVISION_COLUMNS = (
    *VIEW_COLUMNS,
    "sandbox_config",
    "breaker_state",
    "breaker_failures",
    "warm_min",
    "warm_schedule",
)


@dataclass(frozen=True)
class PoolRow:
    """A pool's :data:`PROVISION_COLUMNS` as a plain record, read by a claim statement (an ORM
    :class:`Pool` built from the same row costs about ten times as much)."""

    id: str
    name: str
    org_id: str
    provider_id: str
    priority: int
    max_concurrent: int
    runtime_provides: Mapping[str, Any] | None
    capabilities: Mapping[str, Any] | None
    share_limit: int | None
    sandbox_config: Mapping[str, Any]
    breaker_state: str
    breaker_failures: int
    warm_min: int
    warm_schedule: Sequence[Mapping[str, Any]] | None


@dataclass(frozen=True)
class PoolView:
    """What routing needs to know of a pool, with its capabilities already derived."""

    id: str
    name: str
    org_id: str
    provider_id: str
    priority: int
    max_concurrent: int
    substrate: Substrate
    capabilities: ProviderCapabilities
    # Its circuit breaker, as routing sees it now (corral.shared.store.breaker): route, skip, probe.
    breaker: str = "route"
    # Its share of a shared capacity as read (corral.shared.store.shares); None: none.
    share_limit: int | None = None
    # Why it offers no substrate: its stored runtime_provides does not parse (written around
    # the admin api, or valid for an older version). Empty when it does.
    problem: str = ""

    @classmethod
    def build(
        cls,
        *,
        id: str,
        name: str,
        org_id: str,
        provider_id: str,
        priority: int,
        max_concurrent: int,
        runtime_provides: Mapping[str, Any] | None = None,
        capabilities: Mapping[str, Any] | None = None,
        share_limit: int | None = None,
        breaker: str = "route",
    ) -> PoolView:
        """Derive capabilities: the pool's overrides first, else the provider class default.
        A malformed ``runtime_provides`` makes a pool that offers nothing and says why
        (``problem``): routing passes it over with that reason, its slots still count."""
        defaults = default_registry.capabilities_of(provider_id)
        matrix = defaults
        if capabilities:
            overrides = {
                key: value
                for key, value in capabilities.items()
                if key not in ENFORCEMENT_FIELDS and key != LEGACY_NETWORK_POLICY_FIELD
            }
            matrix = ProviderCapabilities.model_validate({**defaults.model_dump(), **overrides})
        try:
            substrate, problem = derive_capabilities(defaults, runtime_provides), ""
        except InvalidCapabilityOverrideError as exc:
            substrate, problem = Substrate(), str(exc)
        return cls(
            id=id,
            name=name,
            org_id=org_id,
            provider_id=provider_id,
            priority=priority,
            max_concurrent=max_concurrent,
            substrate=substrate,
            capabilities=matrix,
            breaker=breaker,
            share_limit=share_limit,
            problem=problem,
        )

    @property
    def slot_limit(self) -> int:
        """The most slots it may hold: its max_concurrent, its provider's declared limit and
        its share of a shared capacity, the lowest of them."""
        limits = (self.max_concurrent, self.capabilities.max_concurrent, self.share_limit)
        return min(limit for limit in limits if limit is not None)

    def describe(self) -> str:
        return f"{self.name} ({self.provider_id})"


def pool_view(pool: PoolRecord, *, breaker: str = "route") -> PoolView:
    """The routing view of ``pool``: its capabilities with its overrides applied, and what
    its circuit breaker lets through (:func:`corral.shared.store.breaker.gate`)."""
    return PoolView.build(
        id=pool.id,
        name=pool.name,
        org_id=pool.org_id,
        provider_id=pool.provider_id,
        priority=pool.priority,
        max_concurrent=pool.max_concurrent,
        runtime_provides=pool.runtime_provides,
        capabilities=pool.capabilities,
        share_limit=pool.share_limit,
        breaker=breaker,
    )


def session_limit_s(pool: PoolRecord, timeout_s: int | None) -> int | None:
    """The shortest of the work's timeout, the pool's and the provider's max session length."""
    limits = [
        timeout_s,
        pool_view(pool).capabilities.max_session_duration_seconds,
        default_registry.capabilities_of(pool.provider_id).max_session_duration_seconds,
    ]
    known = [limit for limit in limits if limit is not None]
    return min(known) if known else None


class SlottedPool(PoolRecord, Protocol):
    """A pool with its slot counter and shared capacity: a :class:`Pool` row."""

    @property
    def slots_in_use(self) -> int: ...
    @property
    def capacity_id(self) -> str | None: ...


def waiting_room(pool: SlottedPool, *, breaker: str = "route") -> int:
    """The slots ``pool`` has free for its waiting items: within its share on a shared
    capacity (its division's); elsewhere within its own limit, a share there only closing it
    to fresh arrivals while items wait (:func:`corral.shared.store.slots.close`)."""
    view = pool_view(pool, breaker=breaker)
    if pool.capacity_id is None:
        view = replace(view, share_limit=None)
    return view.slot_limit - pool.slots_in_use
