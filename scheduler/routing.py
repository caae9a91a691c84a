"""Routing: which pool takes a work item, and on which queue (docs/architecture.md §4).

The decision is a pure function of the request, its model profile, the org's candidate
pools and how many slots each pool has in use; the database part lives in
:mod:`corral.scheduler.intake`. Steps:

1. auth-mode pin: ``local`` and ``host-session`` profiles only use ``local`` pools;
2. the pools of the org that are active (and of the requested provider) — the caller's query;
3. substrate and capability-matrix match (runtime/requirement kinds, GPU, os/arch, region,
   resources within maxVCpu/maxMemoryMb, session length, enforced egress (allowed hosts,
   secret bindings), the work's kind: a code interpreter takes ``code`` items without
   shell steps alone; an interactive session needs a provider that runs commands and moves
   files from outside: ``exec-files``);
4. the highest-priority qualifying pool with a free slot whose circuit breaker lets work
   through (:mod:`corral.shared.store.breaker`; an open one is passed by like a full one, a
   half-open one takes one probe), among the pools of the first GPU type the item lists
   (``resources.gpu_types``) that has such a pool, then the next type's; ties go to the
   lower pool name, then id, so that the same inputs always give the same pool; the pools
   whose provider already failed to make the item's sandbox (failover,
   :mod:`corral.shared.store.attempts`) are passed by too, and when they are all the
   qualifying pools there is nowhere left to go (:class:`Exhausted`);
5. the queue named from the winner's capability class
   (:func:`corral.shared.broker.queues.provision_queue`).

Qualifying pools that are all full mean *wait*, not fail.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass

from corral.providers.capabilities import ProviderCapabilities
from corral.scheduler.errors import (
    AuthModeRequiresLocalError,
    BudgetExhaustedError,
    NoEligiblePoolError,
)
from corral.shared.broker.queues import provision_queue
from corral.shared.messages import CodeWork, DispatchRequest
from corral.shared.store.breaker import SKIP
from corral.shared.store.models import AuthMode
from corral.shared.store.pools import PoolView

LOCAL_PIN = "the auth-mode pin (not a local pool)"
NODE = "toolchain:node"


@dataclass(frozen=True)
class Routed:
    """The item goes to ``pool`` through ``queue``. ``passed_full``: the qualifying pools
    passed by before it because their slot counters said full (the decision depended on
    those counters; a router that may have read them stale must route it again)."""

    pool: PoolView
    queue: str
    passed_full: frozenset[str] = frozenset()


@dataclass(frozen=True)
class Waiting:
    """Every qualifying pool is full; the item waits for a slot. ``passed_full``: as for
    :class:`Routed` (the pools found full by their counters)."""

    pools: tuple[PoolView, ...]
    passed_full: frozenset[str] = frozenset()


@dataclass(frozen=True)
class Exhausted:
    """Every qualifying pool has failed to make the item's sandbox: failover has nowhere
    left to go, and the item fails with its last pool's error. ``pools``: those pools."""

    pools: tuple[PoolView, ...]


def shortfalls(request: DispatchRequest, pool: PoolView) -> list[str]:
    """What ``pool`` lacks for ``request``, in words; empty when it qualifies."""
    if pool.problem:
        return [pool.problem]
    matrix = pool.capabilities
    card = request.agent_card
    lacking = pool.substrate.missing(card.runtime_kinds, card.requirement_kinds - {"gpu"})
    resources = request.resources
    lacking += _gpu_shortfalls(request, pool)
    lacking += _unsized(request, pool)
    if (
        resources.cpu is not None
        and matrix.max_vcpu is not None
        and resources.cpu > matrix.max_vcpu
    ):
        lacking.append(f"{resources.cpu} vCPU (max {matrix.max_vcpu})")
    if (
        resources.memory_mb is not None
        and matrix.max_memory_mb is not None
        and resources.memory_mb > matrix.max_memory_mb
    ):
        lacking.append(f"{resources.memory_mb} MB memory (max {matrix.max_memory_mb})")
    session_max = matrix.max_session_duration_seconds
    if (
        resources.timeout_s is not None
        and session_max is not None
        and resources.timeout_s > session_max
    ):
        lacking.append(f"a {resources.timeout_s}s session (max {session_max}s)")
    if request.toolchain.os not in matrix.os:
        lacking.append(f"os {request.toolchain.os}")
    if request.arch is not None and request.arch not in matrix.arch:
        lacking.append(f"arch {request.arch}")
    if request.region is not None and not ({"*", request.region} & set(matrix.regions)):
        lacking.append(f"region {request.region}")
    lacking += _egress_shortfalls(request, matrix)
    if "pause-resume" in request.sandbox_features and not matrix.supports_pause_resume:
        lacking.append("pause/resume")
    if "fs-snapshot" in request.sandbox_features and not matrix.supports_fs_snapshot:
        lacking.append("filesystem snapshots")
    if "exec-files" in request.sandbox_features and not matrix.supports_exec_files:
        lacking.append("commands and files from outside (interactive sessions)")
    if request.image is not None and not matrix.supports_item_image:
        lacking.append("an image of the work's own")
    lacking += _work_shortfalls(request, pool)
    return lacking


def _gpu_shortfalls(request: DispatchRequest, pool: PoolView) -> list[str]:
    """A GPU is satisfied by the matrix (supports_gpu) or by a substrate that lists gpu; a
    GPU type only by a pool whose matrix lists it."""
    matrix, wanted = pool.capabilities, request.resources.gpu_types
    lacking = []
    if request.needs_gpu and not (matrix.supports_gpu or "gpu" in pool.substrate.requirement_kinds):
        lacking.append("requirement gpu")
    if wanted and not set(wanted) & set(matrix.gpu_types):
        lacking.append(f"a GPU of type {' or '.join(wanted)}")
    return lacking


def _egress_shortfalls(request: DispatchRequest, matrix: ProviderCapabilities) -> list[str]:
    """Egress a pool's provider cannot enforce is never given as the whole network."""
    lacking = []
    if request.egress.allowed_hosts and not matrix.enforces_allowed_hosts:
        lacking.append(
            "enforced egress.allowed_hosts (its provider cannot restrict the network to "
            "listed hosts)"
        )
    if request.egress.secret_bindings and not matrix.enforces_secret_bindings:
        lacking.append(
            "egress.secret_bindings (they need corral's egress proxy, which its provider "
            "does not run)"
        )
    git = request.inputs.git
    if git is not None and git.secret is not None and not matrix.enforces_secret_bindings:
        lacking.append(
            "inputs.git.secret (the credential is put in by corral's egress proxy, which its "
            "provider does not run)"
        )
    egress = request.egress
    settings = egress.http_proxy or egress.https_proxy or egress.no_proxy or egress.ca_cert_pem
    if settings and "shell" not in matrix.work_kinds:
        lacking.append(
            "egress proxy or CA settings (a code interpreter runs no runner to apply them)"
        )
    return lacking


def _unsized(request: DispatchRequest, pool: PoolView) -> list[str]:
    """A cpu or memory request where the provider cannot size a sandbox by it, unless the
    pool declares the fixed size its sandboxes have (max_vcpu, max_memory_mb)."""
    matrix, resources = pool.capabilities, request.resources
    lacking = []
    if resources.cpu is not None and "cpu" not in matrix.sized_resources and not matrix.max_vcpu:
        lacking.append("sandboxes sized by resources.cpu")
    if (
        resources.memory_mb is not None
        and "memory" not in matrix.sized_resources
        and not matrix.max_memory_mb
    ):
        lacking.append("sandboxes sized by resources.memory_mb")
    return lacking


def _work_shortfalls(request: DispatchRequest, pool: PoolView) -> list[str]:
    """A code interpreter runs ``code`` work alone: no shell work, and no shell steps.
    Code runs only in a language the pool's matrix lists; javascript needs node."""
    lacking = []
    work, work_kinds = request.work, pool.capabilities.work_kinds
    if work.kind not in work_kinds:
        lacking.append(f"work of kind {work.kind}")
    elif isinstance(work, CodeWork):
        if work.language not in pool.capabilities.code_languages:
            lacking.append(f"{work.language} code")
        if work.language == "javascript" and NODE not in pool.substrate.requirement_kinds:
            lacking.append(f"requirement {NODE} (javascript code runs with node)")
    toolchain = request.toolchain
    steps = toolchain.install_commands or toolchain.post_acquire or toolchain.pre_release
    if "shell" not in work_kinds and (steps or toolchain.kits):
        lacking.append("shell steps (kits, install_commands, post_acquire, pre_release)")
    # Inputs and bundles are the runner's doing; a code interpreter runs no runner.
    if "shell" not in work_kinds and (request.collects_bundle or request.inputs.git):
        lacking.append("a workspace of its own (inputs, a result bundle)")
    return lacking


def route(
    request: DispatchRequest,
    auth_mode: AuthMode,
    pools: Sequence[PoolView],
    in_use: Mapping[str, int],
    over_budget: Mapping[str, str] | None = None,
    *,
    failed: Collection[str] = (),
) -> Routed | Waiting | Exhausted:
    """Choose a pool for ``request`` among the org's active ``pools``.

    ``pools`` are the org's active pools (already narrowed to ``request.provider`` when
    set); ``in_use`` maps pool id to the slots it has taken; ``over_budget`` maps the pools
    whose budget is spent to what it says (:mod:`corral.shared.store.budgets`): they are passed by.
    ``failed``: the pools whose provider failed to make this item's sandbox before (its
    earlier attempts'): passed by; :class:`Exhausted` when no other pool qualifies.

    Raises:
        AuthModeRequiresLocalError: the profile pins local and no local pool qualifies.
        NoEligiblePoolError: no pool qualifies; the message names what was missing.
        BudgetExhaustedError: every qualifying pool is over its budget.
    """
    over_budget = over_budget or {}
    qualifying, rejected = [], []
    for pool in pools:
        lacking = shortfalls(request, pool)
        if auth_mode.pins_local and pool.provider_id != "local":
            lacking = [LOCAL_PIN, *lacking]
        if lacking:
            rejected.append((pool, lacking))
        else:
            qualifying.append(pool)
    if not qualifying:
        raise _no_pool_error(request, auth_mode, rejected)
    # The GPU types the item lists, most wanted first, then the pools' own order.
    qualifying.sort(key=lambda p: (_gpu_rank(request, p), -p.priority, p.name, p.id))
    untried = [pool for pool in qualifying if pool.id not in failed]
    if not untried:
        return Exhausted(tuple(qualifying))
    full: set[str] = set()
    for pool in untried:
        if pool.breaker == SKIP or pool.id in over_budget:
            continue
        if in_use.get(pool.id, 0) >= pool.slot_limit:
            full.add(pool.id)
            continue
        queue = provision_queue(pool.provider_id, gpu=request.needs_gpu)
        return Routed(pool=pool, queue=queue, passed_full=frozenset(full))
    if all(pool.id in over_budget for pool in untried):
        raise BudgetExhaustedError("; ".join(over_budget[pool.id] for pool in untried))
    return Waiting(pools=tuple(untried), passed_full=frozenset(full))


def _gpu_rank(request: DispatchRequest, pool: PoolView) -> int:
    """The place, in the item's ``gpu_types``, of the first type ``pool`` has (0: none
    asked)."""
    wanted = request.resources.gpu_types
    return min((wanted.index(t) for t in pool.capabilities.gpu_types if t in wanted), default=0)


def _no_pool_error(
    request: DispatchRequest,
    auth_mode: AuthMode,
    rejected: list[tuple[PoolView, list[str]]],
) -> NoEligiblePoolError | AuthModeRequiresLocalError:
    considered = "; ".join(
        f"{pool.describe()} lacks {', '.join(lacking)}" for pool, lacking in rejected
    )
    scope = f"of provider {request.provider} " if request.provider else ""
    if not rejected:
        return NoEligiblePoolError(
            f"org {request.org} has no active pool {scope}to run this item; "
            "create one with `corral pools create`"
        )
    if auth_mode.pins_local and (
        not any(pool.provider_id == "local" for pool, _ in rejected)
        or any(lacking == [LOCAL_PIN] for _, lacking in rejected)
    ):
        return AuthModeRequiresLocalError(
            f"profile {request.profile} uses auth mode {auth_mode.value}, which only local "
            f"pools may run, and org {request.org} has no active local pool {scope}that "
            f"qualifies; pools considered: {considered}"
        )
    needed = sorted({item for _, lacking in rejected for item in lacking if item != LOCAL_PIN})
    return NoEligiblePoolError(
        f"no active pool {scope}for org {request.org} provides {', '.join(needed)}; "
        f"pools considered: {considered}"
    )
