"""Where an item goes: the routing gates, declared once, in the order every routing path
applies them.

The one-item path (:mod:`corral.scheduler.intake`: guarded updates, one item) and the batch
path (:mod:`corral.scheduler.batch`: a batch's rows at once) read the facts the same way
(:mod:`corral.scheduler.routing_config`) and hand them to :func:`decide`; neither orders the
gates itself. So an item gets the same answer whichever path routes it (an unknown profile
in an org at its limit is ``unknown_profile`` on both, not parked by one and refused by the
other; ``tests/unit/test_placement_paths.py``).

The gates, in order (:data:`GATES`), then :func:`~corral.scheduler.routing.route`:

1. network: the deployment gives the org's sandboxes network (``network_not_allowed``);
2. org policy: the image the item names and the region it asks for are the org's to use
   (``image_not_allowed``, ``region_not_allowed``; :mod:`corral.shared.store.org_policies`);
3. known profile (``unknown_profile``);
4. org room: the org's limit across its pools (the item waits);
5. org budget (``budget_exhausted``);
6. the provider the message names narrows the pools; then ``route()`` applies the pools'
   capabilities, breakers, slots and budgets, and passes by the pools that failed the item
   before (failover).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from corral.scheduler.errors import (
    BudgetExhaustedError,
    ImageNotAllowedError,
    NetworkNotAllowedError,
    RegionNotAllowedError,
    UnknownProfileError,
)
from corral.scheduler.routing import Exhausted, Routed, Waiting, route
from corral.shared.messages import DispatchRequest
from corral.shared.store.models import AuthMode
from corral.shared.store.org_policies import Policy
from corral.shared.store.pools import PoolView
from corral.shared.store.profiles import DEFAULT_PROFILE


@dataclass(frozen=True)
class Facts:
    """What the gates consult for one request, however the path read it."""

    auth_mode: str | None  # the named profile's; None: there is no such profile
    org_full: bool  # the org's limit across its pools is reached
    org_over_budget: str | None  # what the org's spent budget says, if one is spent
    pools: Sequence[PoolView]  # the org's active pools, their breakers applied
    in_use: Mapping[str, int]  # slots each pool has taken
    pools_over_budget: Mapping[str, str]
    network_allowed: bool  # the deployment gives the org's sandboxes network
    policy: Policy  # what the deployment lets the org's work ask for
    # The pools whose provider failed to make this item's sandbox (its earlier attempts'):
    # routing passes them by (failover; corral.shared.store.attempts). None for a new item.
    failed_pools: frozenset[str] = frozenset()


Gate = Callable[[DispatchRequest, Facts], Waiting | None]


def _network(request: DispatchRequest, facts: Facts) -> None:
    if request.egress.allow_network and not facts.network_allowed:
        raise NetworkNotAllowedError()


def _org_policy(request: DispatchRequest, facts: Facts) -> None:
    if request.image is not None:
        refusal = facts.policy.image_refusal(request.image)
        if refusal is not None:
            raise ImageNotAllowedError(refusal)
    if request.region is not None and not facts.policy.region_allowed(request.region):
        raise RegionNotAllowedError()


# `default` is corral's own name, not the client's: the error may say it.
NO_DEFAULT = (
    f"the model profile `{DEFAULT_PROFILE}` (field profile; a message that names none takes "
    "it) does not exist: the deployment admin creates it (`corral profiles create --name "
    f"{DEFAULT_PROFILE} --model MODEL --auth-mode byok`), or the message names an existing one"
)


def _known_profile(request: DispatchRequest, facts: Facts) -> None:
    if facts.auth_mode is None:
        raise UnknownProfileError(NO_DEFAULT if request.profile == DEFAULT_PROFILE else None)


def _org_room(request: DispatchRequest, facts: Facts) -> Waiting | None:
    # The org's limit across its pools: it waits like a full pool's item.
    return Waiting(pools=()) if facts.org_full else None


def _org_budget(request: DispatchRequest, facts: Facts) -> None:
    if facts.org_over_budget is not None:
        raise BudgetExhaustedError(facts.org_over_budget)


GATES: tuple[Gate, ...] = (_network, _org_policy, _known_profile, _org_room, _org_budget)


def decide(request: DispatchRequest, facts: Facts) -> Routed | Waiting | Exhausted:
    """Apply every gate in order, then choose a pool.

    Raises:
        DispatchError: the item's dispatch error (a gate's or ``route()``'s).
    """
    for gate in GATES:
        held = gate(request, facts)
        if held is not None:
            return held
    pools = facts.pools
    if request.provider is not None:
        pools = [pool for pool in pools if pool.provider_id == request.provider]
    assert facts.auth_mode is not None  # the profile gate passed
    return route(
        request,
        AuthMode(facts.auth_mode),
        pools,
        facts.in_use,
        facts.pools_over_budget,
        failed=facts.failed_pools,
    )
