"""Routing as a table: which pool and queue a request gets, and why it gets none."""

from __future__ import annotations

import itertools
from typing import Any

import pytest

from corral.scheduler.errors import AuthModeRequiresLocalError, NoEligiblePoolError
from corral.scheduler.routing import Exhausted, Routed, Waiting, route, shortfalls
from corral.shared.messages import DispatchRequest
from corral.shared.store.models import AuthMode
from corral.shared.store.pools import PoolView

NPM_ONLY = {"runtimeKinds": ["npm"], "requirementKinds": []}
E2B_WITH_NPM = {"runtimeKinds": ["native", "npm", "python-pip"], "requirementKinds": ["git"]}
LOCAL_WITHOUT_HOST_BINARY = {"runtimeKinds": ["native"], "requirementKinds": ["git"]}
GPU_SUBSTRATE = {"runtimeKinds": ["native"], "requirementKinds": ["gpu", "git"]}
# Cloud pools that declare, through their capabilities, what some vendors' matrices say.
GPU_CLOUD = {"supports_gpu": True}
FIVE_HOUR_SESSIONS = {"max_session_duration_seconds": 18_000}
ALLOWED_HOSTS_SHORTFALL = (
    "enforced egress.allowed_hosts (its provider cannot restrict the network to listed hosts)"
)


def request(**fields: Any) -> DispatchRequest:
    message: dict[str, Any] = {
        "org": "acme",
        "project": "web",
        "profile": "default",
        "work": {"kind": "shell", "command": "true"},
    }
    return DispatchRequest.model_validate(message | fields)


def pool(
    provider_id: str,
    *,
    name: str | None = None,
    id: str | None = None,
    priority: int = 0,
    max_concurrent: int = 10,
    runtime_provides: dict[str, Any] | None = None,
    capabilities: dict[str, Any] | None = None,
) -> PoolView:
    name = name or f"{provider_id}-pool"
    return PoolView.build(
        id=id or f"id-{name}",
        name=name,
        org_id="acme",
        provider_id=provider_id,
        priority=priority,
        max_concurrent=max_concurrent,
        runtime_provides=runtime_provides,
        capabilities=capabilities,
    )


def routed(decision: Routed | Waiting) -> tuple[str, str]:
    assert isinstance(decision, Routed), decision
    return decision.pool.name, decision.queue


# --- who wins ------------------------------------------------------------------------------

# (auth mode, request fields, pools, expected pool name, expected queue)
ROUTES = [
    # Auth modes: local and host-session pin local pools, even below a higher-priority one.
    pytest.param(
        AuthMode.LOCAL,
        {},
        [pool("docker", priority=10), pool("local")],
        "local-pool",
        "provision.local",
        id="auth-local-pins-local-pool",
    ),
    pytest.param(
        AuthMode.HOST_SESSION,
        {},
        [pool("docker", priority=10), pool("local")],
        "local-pool",
        "provision.local",
        id="auth-host-session-pins-local-pool",
    ),
    pytest.param(
        AuthMode.BYOK,
        {},
        [pool("docker", priority=10), pool("local")],
        "docker-pool",
        "provision.docker",
        id="auth-byok-any-provider",
    ),
    pytest.param(
        AuthMode.METERED,
        {},
        [pool("local"), pool("e2b", priority=10)],
        "e2b-pool",
        "provision.e2b",
        id="auth-metered-any-provider",
    ),
    pytest.param(
        AuthMode.SHARED,
        {},
        [pool("local", priority=1), pool("kubernetes", priority=5)],
        "kubernetes-pool",
        "provision.kubernetes",
        id="auth-shared-any-provider",
    ),
    # Substrate: the runtime_provides override replaces the class default.
    pytest.param(
        AuthMode.BYOK,
        {"agent_card": {"runtimes": [{"kind": "npm"}]}},
        [pool("e2b", runtime_provides=E2B_WITH_NPM)],
        "e2b-pool",
        "provision.e2b",
        id="override-gives-e2b-npm",
    ),
    pytest.param(
        AuthMode.BYOK,
        {"agent_card": {"runtimes": [{"kind": "npm"}]}},
        [pool("e2b", priority=10), pool("docker")],
        "docker-pool",
        "provision.docker",
        id="e2b-default-lacks-npm-falls-to-docker",
    ),
    pytest.param(
        AuthMode.BYOK,
        {"agent_card": {"requires": [{"kind": "host-binary"}]}},
        [
            pool("local", name="bare", priority=10, runtime_provides=LOCAL_WITHOUT_HOST_BINARY),
            pool("local", name="stock"),
        ],
        "stock",
        "provision.local",
        id="override-drops-host-binary",
    ),
    pytest.param(
        AuthMode.BYOK,
        {"agent_card": {"requires": [{"kind": "toolchain:go"}]}},
        [pool("e2b", priority=10), pool("docker")],
        "docker-pool",
        "provision.docker",
        id="toolchain-go-class-default",
    ),
    # Capability-matrix override beats the class matrix.
    pytest.param(
        AuthMode.BYOK,
        {"resources": {"timeout_s": 36_000}},
        [pool("e2b", capabilities={"max_session_duration_seconds": 40_000})],
        "e2b-pool",
        "provision.e2b",
        id="override-raises-session-limit",
    ),
    pytest.param(
        AuthMode.BYOK,
        {"resources": {"cpu": 4}},
        [
            pool("docker", name="small", priority=10, capabilities={"max_vcpu": 2}),
            pool("docker", name="large", capabilities={"max_vcpu": 8}),
        ],
        "large",
        "provision.docker",
        id="override-max-vcpu",
    ),
    # GPU: a GPU item goes to a GPU-capable pool, on the .gpu queue.
    pytest.param(
        AuthMode.BYOK,
        {"resources": {"gpu": 1}},
        [pool("docker", priority=10), pool("e2b", capabilities=GPU_CLOUD)],
        "e2b-pool",
        "provision.e2b.gpu",
        id="gpu-resources-to-a-gpu-cloud",
    ),
    pytest.param(
        AuthMode.BYOK,
        {"resources": {"gpu": 1}},
        [pool("local", priority=10), pool("docker", capabilities={"supports_gpu": True})],
        "docker-pool",
        "provision.docker.gpu",
        id="gpu-via-capabilities-override",
    ),
    pytest.param(
        AuthMode.BYOK,
        {"agent_card": {"requires": [{"kind": "gpu"}]}},
        [pool("docker", priority=10), pool("kubernetes", runtime_provides=GPU_SUBSTRATE)],
        "kubernetes-pool",
        "provision.kubernetes.gpu",
        id="gpu-requirement-via-substrate",
    ),
    pytest.param(
        AuthMode.BYOK,
        {},
        [pool("e2b", capabilities=GPU_CLOUD)],
        "e2b-pool",
        "provision.e2b",
        id="no-gpu-needed-plain-queue-on-gpu-pool",
    ),
    # Resources, session length, os/arch/region, egress.
    pytest.param(
        AuthMode.BYOK,
        {"resources": {"memory_mb": 4096}},
        [
            pool("docker", name="tiny", priority=10, capabilities={"max_memory_mb": 1024}),
            pool("docker", name="roomy", capabilities={"max_memory_mb": 4096}),
        ],
        "roomy",
        "provision.docker",
        id="memory-within-max",
    ),
    pytest.param(
        AuthMode.BYOK,
        {"resources": {"timeout_s": 18_000}},
        [pool("e2b", capabilities=FIVE_HOUR_SESSIONS)],
        "e2b-pool",
        "provision.e2b",
        id="session-at-limit",
    ),
    pytest.param(
        AuthMode.BYOK,
        {"resources": {"timeout_s": 18_001}},
        [pool("e2b", priority=10, capabilities=FIVE_HOUR_SESSIONS), pool("docker")],
        "docker-pool",
        "provision.docker",
        id="session-over-limit-spills",
    ),
    pytest.param(
        AuthMode.BYOK,
        {"toolchain": {"os": "windows"}},
        [
            pool("docker", priority=10),
            pool("kubernetes", capabilities={"os": ["linux", "windows"]}),
        ],
        "kubernetes-pool",
        "provision.kubernetes",
        id="os-match",
    ),
    pytest.param(
        AuthMode.BYOK,
        {"arch": "arm64"},
        [pool("docker", priority=10), pool("e2b", capabilities={"arch": ["arm64"]})],
        "e2b-pool",
        "provision.e2b",
        id="arch-match",
    ),
    pytest.param(
        AuthMode.BYOK,
        {"region": "eu-west-1"},
        [pool("e2b")],
        "e2b-pool",
        "provision.e2b",
        id="region-wildcard",
    ),
    pytest.param(
        AuthMode.BYOK,
        {"region": "eu-west-1"},
        [
            pool("e2b", name="us", priority=10, capabilities={"regions": ["us-east-1"]}),
            pool("e2b", name="eu", capabilities={"regions": ["eu-west-1"]}),
        ],
        "eu",
        "provision.e2b",
        id="region-match",
    ),
    pytest.param(
        AuthMode.BYOK,
        {"egress": {"allow_network": True, "allowed_hosts": ["pypi.org"]}},
        [pool("modal", priority=10), pool("local")],
        "local-pool",
        "provision.local",
        id="custom-egress-only-where-enforced",
    ),
    pytest.param(
        AuthMode.BYOK,
        {"egress": {"allow_network": True}},
        [pool("local", priority=10), pool("docker")],
        "local-pool",
        "provision.local",
        id="plain-egress-any-pool",
    ),
    pytest.param(
        AuthMode.BYOK,
        {"sandbox_features": ["pause-resume"]},
        [
            pool("local", priority=10),
            pool("kubernetes", priority=5),
            pool("docker", priority=5),
            pool("e2b"),
        ],
        "e2b-pool",
        "provision.e2b",
        id="pause-resume-only-e2b",
    ),
    pytest.param(
        AuthMode.BYOK,
        {"sandbox_features": ["fs-snapshot", "pause-resume"]},
        [pool("kubernetes", priority=10), pool("daytona", priority=5), pool("e2b")],
        "e2b-pool",
        "provision.e2b",
        id="snapshot-and-pause-e2b",
    ),
    pytest.param(
        AuthMode.BYOK,
        {"sandbox_features": ["exec-files"]},
        [pool("kubernetes", priority=10), pool("e2b", priority=5), pool("daytona")],
        "daytona-pool",
        "provision.daytona",
        id="exec-files-passes-providers-without-files",
    ),
    pytest.param(
        AuthMode.BYOK,
        {"resources": {"gpu": 1}},
        [
            pool("e2b", priority=10),
            pool("kubernetes", runtime_provides={"requirementKinds": ["gpu"]}),
        ],
        "kubernetes-pool",
        "provision.kubernetes.gpu",
        id="gpu-kubernetes-pool",
    ),
    pytest.param(
        AuthMode.BYOK,
        {"agent_card": {"runtimes": [{"kind": "python-pip"}]}},
        [pool("kubernetes"), pool("e2b", priority=10)],
        "e2b-pool",
        "provision.e2b",
        id="python-pip-prefers-priority-e2b",
    ),
]


@pytest.mark.parametrize(("auth_mode", "fields", "pools", "pool_name", "queue"), ROUTES)
def test_routing_table(
    auth_mode: AuthMode,
    fields: dict[str, Any],
    pools: list[PoolView],
    pool_name: str,
    queue: str,
) -> None:
    assert routed(route(request(**fields), auth_mode, pools, {})) == (pool_name, queue)


# A pool whose capability matrix says supports_gpu (by its provider's class default, or any
# pool through a `capabilities` override) takes `resources.gpu` items, but not the same need
# spelled as `requires: [{kind: gpu}]`: the substrate check demands `gpu` among the
# requirement kinds as well. DispatchRequest.needs_gpu treats both spellings alike.


@pytest.mark.parametrize(
    ("gpu_pool", "queue"),
    [
        pytest.param(pool("modal"), "provision.modal.gpu", id="modal-class-default"),
        pytest.param(
            pool("e2b", capabilities=GPU_CLOUD), "provision.e2b.gpu", id="e2b-declares-a-gpu"
        ),
        pytest.param(
            pool("docker", capabilities={"supports_gpu": True}),
            "provision.docker.gpu",
            id="docker-capabilities-override",
        ),
    ],
)
def test_gpu_requirement_goes_to_a_gpu_capable_pool(gpu_pool: PoolView, queue: str) -> None:
    gpu_item = request(agent_card={"requires": [{"kind": "gpu"}]})
    assert routed(route(gpu_item, AuthMode.BYOK, [gpu_pool], {})) == (gpu_pool.name, queue)


# --- why none wins -------------------------------------------------------------------------

# (auth mode, request fields, pools, error, fragments the message must contain)
REFUSALS = [
    pytest.param(
        AuthMode.LOCAL,
        {},
        [pool("docker")],
        AuthModeRequiresLocalError,
        ["profile default", "auth mode local", "pools considered", "docker-pool (docker)"],
        id="auth-local-only-docker",
    ),
    pytest.param(
        AuthMode.HOST_SESSION,
        {},
        [pool("e2b"), pool("kubernetes")],
        AuthModeRequiresLocalError,
        [
            "profile default",
            "auth mode host-session",
            "pools considered",
            "e2b-pool (e2b)",
            "kubernetes-pool (kubernetes)",
        ],
        id="auth-host-session-only-cloud",
    ),
    pytest.param(
        AuthMode.BYOK,
        {"agent_card": {"runtimes": [{"kind": "npm"}]}},
        [pool("e2b")],
        NoEligiblePoolError,
        ["runtime npm", "pools considered", "e2b-pool (e2b)"],
        id="e2b-default-lacks-npm",
    ),
    pytest.param(
        AuthMode.BYOK,
        {"agent_card": {"runtimes": [{"kind": "python-pip"}]}},
        [pool("e2b", runtime_provides=NPM_ONLY)],
        NoEligiblePoolError,
        ["runtime python-pip"],
        id="override-replaces-not-merges",
    ),
    pytest.param(
        AuthMode.LOCAL,
        {"agent_card": {"requires": [{"kind": "host-binary"}]}},
        [pool("local", runtime_provides=LOCAL_WITHOUT_HOST_BINARY)],
        NoEligiblePoolError,
        ["requirement host-binary", "local-pool (local)"],
        id="local-override-without-host-binary",
    ),
    pytest.param(
        AuthMode.BYOK,
        {"resources": {"gpu": 1}},
        [pool("docker"), pool("local")],
        NoEligiblePoolError,
        ["requirement gpu", "pools considered"],
        id="gpu-resources-none",
    ),
    pytest.param(
        AuthMode.BYOK,
        {"agent_card": {"requires": [{"kind": "gpu"}]}},
        [pool("kubernetes")],
        NoEligiblePoolError,
        ["requirement gpu", "pools considered"],
        id="gpu-requirement-none",
    ),
    pytest.param(
        AuthMode.BYOK,
        {"resources": {"cpu": 4}},
        [pool("docker", capabilities={"max_vcpu": 2})],
        NoEligiblePoolError,
        ["4.0 vCPU (max 2.0)"],
        id="cpu-over-max-vcpu",
    ),
    pytest.param(
        AuthMode.BYOK,
        {"resources": {"memory_mb": 8192}},
        [pool("docker", capabilities={"max_memory_mb": 2048})],
        NoEligiblePoolError,
        ["8192 MB memory (max 2048)"],
        id="memory-over-max",
    ),
    pytest.param(
        AuthMode.BYOK,
        {"resources": {"timeout_s": 18_001}},
        [pool("e2b", capabilities=FIVE_HOUR_SESSIONS)],
        NoEligiblePoolError,
        ["a 18001s session (max 18000s)"],
        id="session-too-long",
    ),
    pytest.param(
        AuthMode.BYOK,
        {"toolchain": {"os": "windows"}},
        [pool("docker")],
        NoEligiblePoolError,
        ["os windows"],
        id="os-mismatch",
    ),
    pytest.param(
        AuthMode.BYOK,
        {"arch": "arm64"},
        [pool("kubernetes")],
        NoEligiblePoolError,
        ["arch arm64"],
        id="arch-mismatch",
    ),
    pytest.param(
        AuthMode.BYOK,
        {"region": "eu-west-1"},
        [pool("e2b", capabilities={"regions": ["us-east-1"]})],
        NoEligiblePoolError,
        ["region eu-west-1"],
        id="region-mismatch",
    ),
    pytest.param(
        AuthMode.BYOK,
        {"egress": {"allow_network": True, "allowed_hosts": ["pypi.org"]}},
        [pool("modal"), pool("daytona"), pool("modal", name="gpu", capabilities=GPU_CLOUD)],
        NoEligiblePoolError,
        ["enforced egress.allowed_hosts", "daytona-pool (daytona)", "gpu (modal)"],
        id="custom-egress-needs-enforcement",
    ),
    pytest.param(
        AuthMode.BYOK,
        {"sandbox_features": ["pause-resume"]},
        [pool("local"), pool("docker"), pool("kubernetes"), pool("modal")],
        NoEligiblePoolError,
        ["pause/resume", "kubernetes-pool (kubernetes)", "modal-pool (modal)"],
        id="pause-resume-needs-e2b",
    ),
    pytest.param(
        AuthMode.BYOK,
        {"sandbox_features": ["exec-files"]},
        [pool("kubernetes"), pool("modal"), pool("e2b")],
        NoEligiblePoolError,
        ["commands and files from outside (interactive sessions)", "modal-pool (modal)"],
        id="exec-files-needs-a-provider-with-both",
    ),
    pytest.param(
        AuthMode.BYOK,
        {"agent_card": {"runtimes": [{"kind": "npm"}]}},
        [pool("e2b")],
        NoEligiblePoolError,
        ["runtime npm"],
        id="e2b-has-no-node-toolchain",
    ),
    pytest.param(
        AuthMode.BYOK,
        {},
        [],
        NoEligiblePoolError,
        ["org acme", "`corral pools create`"],
        id="no-pools",
    ),
    pytest.param(
        AuthMode.BYOK,
        {"provider": "docker"},
        [],
        NoEligiblePoolError,
        ["of provider docker", "`corral pools create`"],
        id="no-pools-of-provider",
    ),
    pytest.param(
        AuthMode.LOCAL,
        {},
        [],
        NoEligiblePoolError,
        ["`corral pools create`"],
        id="no-pools-local-auth",
    ),
]


@pytest.mark.parametrize(("auth_mode", "fields", "pools", "error", "fragments"), REFUSALS)
def test_refusal_table(
    auth_mode: AuthMode,
    fields: dict[str, Any],
    pools: list[PoolView],
    error: type[Exception],
    fragments: list[str],
) -> None:
    with pytest.raises(error) as raised:
        route(request(**fields), auth_mode, pools, {})
    assert type(raised.value) is error
    for fragment in fragments:
        assert fragment in str(raised.value)


def test_shortfalls_lists_every_gap_and_nothing_for_a_fit() -> None:
    demanding = request(
        agent_card={"runtimes": [{"kind": "npm"}]},
        resources={"timeout_s": 20_000},
        arch="arm64",
        egress={"allow_network": True, "allowed_hosts": ["example.com"]},
    )
    assert shortfalls(demanding, pool("daytona")) == [
        "runtime npm",
        "arch arm64",
        ALLOWED_HOSTS_SHORTFALL,
    ]
    capped = pool("e2b", runtime_provides=E2B_WITH_NPM, capabilities=FIVE_HOUR_SESSIONS)
    assert shortfalls(demanding, capped) == ["a 20000s session (max 18000s)", "arch arm64"]
    assert shortfalls(request(), pool("local")) == []


# --- capacity ------------------------------------------------------------------------------


def test_full_highest_priority_pool_spills_to_the_next() -> None:
    first = pool("docker", name="first", priority=10, max_concurrent=2)
    second = pool("docker", name="second", priority=5, max_concurrent=2)
    third = pool("docker", name="third", priority=1)
    decision = route(request(), AuthMode.BYOK, [third, second, first], {first.id: 2})
    assert routed(decision) == ("second", "provision.docker")
    # The decision says which counters it rested on: a router on stale ones routes again.
    assert isinstance(decision, Routed) and decision.passed_full == {first.id}
    decision = route(request(), AuthMode.BYOK, [third, second, first], {first.id: 1})
    assert routed(decision) == ("first", "provision.docker")
    assert isinstance(decision, Routed) and decision.passed_full == frozenset()


def test_all_qualifying_pools_full_means_waiting() -> None:
    high = pool("docker", name="high", priority=10, max_concurrent=1)
    low = pool("local", name="low", priority=1, max_concurrent=3)
    unfit = pool("e2b", name="unfit", priority=20)  # lacks npm, so not a pool to wait for
    npm_item = request(agent_card={"runtimes": [{"kind": "npm"}]})
    decision = route(npm_item, AuthMode.BYOK, [low, unfit, high], {high.id: 1, low.id: 3})
    assert isinstance(decision, Waiting)
    assert [p.name for p in decision.pools] == ["high", "low"]
    assert decision.passed_full == {high.id, low.id}


def test_the_pools_that_failed_an_item_are_passed_by_and_then_there_is_nowhere_left() -> None:
    high = pool("docker", name="high", priority=10)
    low = pool("local", name="low", priority=1, max_concurrent=1)
    unfit = pool("e2b", name="unfit", priority=20)  # lacks npm: never a pool to fail over to
    npm_item = request(agent_card={"runtimes": [{"kind": "npm"}]})
    pools = [unfit, low, high]
    assert routed(route(npm_item, AuthMode.BYOK, pools, {}))[0] == "high"
    assert routed(route(npm_item, AuthMode.BYOK, pools, {}, failed={high.id}))[0] == "low"
    # The pool left is full: the item waits for it, not for the one that failed it.
    waiting = route(npm_item, AuthMode.BYOK, pools, {low.id: 1}, failed={high.id})
    assert isinstance(waiting, Waiting) and [p.name for p in waiting.pools] == ["low"]
    exhausted = route(npm_item, AuthMode.BYOK, pools, {}, failed={high.id, low.id})
    assert isinstance(exhausted, Exhausted)
    assert [p.name for p in exhausted.pools] == ["high", "low"]


def test_provider_matrix_max_concurrent_also_caps() -> None:
    capped = pool(
        "docker", name="capped", priority=10, max_concurrent=5, capabilities={"max_concurrent": 2}
    )
    assert capped.slot_limit == 2
    assert routed(route(request(), AuthMode.BYOK, [capped], {capped.id: 1}))[0] == "capped"
    assert isinstance(route(request(), AuthMode.BYOK, [capped], {capped.id: 2}), Waiting)
    spare = pool("docker", name="spare")
    assert routed(route(request(), AuthMode.BYOK, [capped, spare], {capped.id: 2}))[0] == "spare"


def test_pool_limit_below_the_matrix_limit_wins() -> None:
    small = pool("docker", max_concurrent=1, capabilities={"max_concurrent": 50})
    assert small.slot_limit == 1
    assert isinstance(route(request(), AuthMode.BYOK, [small], {small.id: 1}), Waiting)


# --- ties ----------------------------------------------------------------------------------

TIED = [
    pool("docker", name="charlie", id="p-1", priority=5),
    pool("docker", name="alpha", id="p-9", priority=5),
    pool("docker", name="alpha", id="p-3", priority=5),
    pool("docker", name="bravo", id="p-0", priority=5),
    pool("docker", name="aardvark", id="p-5", priority=4),  # lower priority: never first
]


def test_ties_break_by_name_then_id_whatever_the_input_order() -> None:
    for order in itertools.permutations(TIED):
        decision = route(request(), AuthMode.BYOK, list(order), {})
        assert isinstance(decision, Routed)
        chosen = (decision.pool.name, decision.pool.id)
        assert chosen == ("alpha", "p-3"), [p.id for p in order]


def test_tie_order_also_governs_spill_over() -> None:
    in_use = {"p-3": 10, "p-9": 10}  # both "alpha" pools full
    decision = route(request(), AuthMode.BYOK, list(reversed(TIED)), in_use)
    assert isinstance(decision, Routed)
    assert (decision.pool.name, decision.pool.id) == ("bravo", "p-0")
    full = {p.id: p.slot_limit for p in TIED}
    waiting = route(request(), AuthMode.BYOK, TIED, full)
    assert isinstance(waiting, Waiting)
    assert [p.id for p in waiting.pools] == ["p-3", "p-9", "p-0", "p-1", "p-5"]


def test_an_item_with_its_own_image_goes_only_where_the_image_is_honoured() -> None:
    with_image = request(image="registry.local/work:1")
    assert "an image of the work's own" in shortfalls(with_image, pool("local"))
    assert "an image of the work's own" in shortfalls(with_image, pool("e2b"))
    assert shortfalls(with_image, pool("docker")) == []
    assert shortfalls(with_image, pool("kubernetes")) == []
    decision = route(with_image, AuthMode.BYOK, [pool("local", priority=9), pool("docker")], {})
    assert routed(decision) == ("docker-pool", "provision.docker")


CODE_WORK = {"kind": "code", "code": "def main():\n    return 1\n"}


def test_a_code_interpreter_takes_code_items_and_no_shell_work() -> None:
    code_item = request(work=CODE_WORK)
    assert shortfalls(code_item, pool("agentrun")) == []
    assert shortfalls(request(), pool("agentrun")) == ["work of kind shell"]
    # Every other built-in runs both kinds, as before the field existed.
    for provider_id in ("local", "docker", "kubernetes", "e2b"):
        assert shortfalls(request(), pool(provider_id)) == []
        assert shortfalls(code_item, pool(provider_id)) == []


def test_a_code_interpreter_takes_no_item_with_shell_steps() -> None:
    with_steps = request(work=CODE_WORK, toolchain={"install_commands": ["pip install x"]})
    assert shortfalls(with_steps, pool("agentrun")) == [
        "shell steps (kits, install_commands, post_acquire, pre_release)"
    ]
    assert shortfalls(with_steps, pool("local")) == []


def test_a_code_item_longer_than_the_interpreters_hard_timeout_goes_elsewhere() -> None:
    long_item = request(work=CODE_WORK, resources={"timeout_s": 31})
    assert shortfalls(long_item, pool("agentrun")) == ["a 31s session (max 30s)"]
    assert shortfalls(request(work=CODE_WORK, resources={"timeout_s": 30}), pool("agentrun")) == []
    decision = route(long_item, AuthMode.BYOK, [pool("agentrun", priority=9), pool("docker")], {})
    assert routed(decision) == ("docker-pool", "provision.docker")


def test_shell_work_is_never_routed_to_a_code_interpreter_pool() -> None:
    decision = route(request(), AuthMode.BYOK, [pool("agentrun", priority=9), pool("local")], {})
    assert routed(decision) == ("local-pool", "provision.local")
    with pytest.raises(NoEligiblePoolError, match="work of kind shell"):
        route(request(), AuthMode.BYOK, [pool("agentrun")], {})
    code_decision = route(
        request(work=CODE_WORK), AuthMode.BYOK, [pool("agentrun", priority=9), pool("local")], {}
    )
    assert routed(code_decision) == ("agentrun-pool", "provision.agentrun")


def test_a_pool_may_narrow_its_work_kinds_through_its_capabilities() -> None:
    code_only_local = pool("local", capabilities={"work_kinds": ["code"]})
    assert shortfalls(request(), code_only_local) == ["work of kind shell"]
    assert shortfalls(request(work=CODE_WORK), code_only_local) == []


def test_a_code_interpreter_takes_no_item_with_a_workspace_input_or_bundle() -> None:
    git = {"git": {"url": "file:///srv/repo.git", "ref": "main"}}
    for fields in ({"bundle": True}, {"review": {"required": True}}, {"inputs": git}):
        item = request(work=CODE_WORK, **fields)
        assert shortfalls(item, pool("agentrun")) == [
            "a workspace of its own (inputs, a result bundle)"
        ]
        assert shortfalls(item, pool("local")) == []


JS_WORK = {"kind": "code", "language": "javascript", "code": "function main() { return 1; }"}


def test_javascript_code_needs_a_pool_with_node() -> None:
    js_item = request(work=JS_WORK)
    # Self-hosted substrates list toolchain:node (vercel's too); e2b, daytona, modal do not.
    for provider_id in ("local", "docker", "kubernetes", "vercel"):
        assert shortfalls(js_item, pool(provider_id)) == []
    for provider_id in ("e2b", "daytona", "modal"):
        assert shortfalls(js_item, pool(provider_id)) == [
            "requirement toolchain:node (javascript code runs with node)"
        ]
    without_node = pool("local", runtime_provides={"runtimeKinds": ["native"]})
    with pytest.raises(NoEligiblePoolError) as refused:
        route(js_item, AuthMode.BYOK, [without_node, pool("e2b")], {})
    assert "toolchain:node (javascript code runs with node)" in refused.value.message
    assert "local-pool" in refused.value.message and "e2b-pool" in refused.value.message
    decision = route(js_item, AuthMode.BYOK, [pool("e2b", priority=9), pool("local")], {})
    assert routed(decision) == ("local-pool", "provision.local")


def test_javascript_code_is_not_routed_to_the_python_only_code_interpreter() -> None:
    # AgentRun's inline program is Python; even a pool that claims node gets no javascript.
    with_node = pool(
        "agentrun", runtime_provides={"runtimeKinds": [], "requirementKinds": ["toolchain:node"]}
    )
    assert shortfalls(request(work=JS_WORK), with_node) == ["javascript code"]
    assert shortfalls(request(work=CODE_WORK), with_node) == []


def test_cpu_and_memory_go_only_where_a_sandbox_is_sized_by_them() -> None:
    sized = request(resources={"cpu": 2, "memory_mb": 2048})
    # E2B and AgentRun sandboxes have their template's size: not per item.
    assert shortfalls(sized, pool("e2b")) == [
        "sandboxes sized by resources.cpu",
        "sandboxes sized by resources.memory_mb",
    ]
    assert shortfalls(request(resources={"timeout_s": 60}), pool("e2b")) == []
    for provider_id in ("local", "docker", "kubernetes", "modal", "daytona", "vercel"):
        assert shortfalls(sized, pool(provider_id)) == []
    # A pool that declares its template's size takes what fits in it.
    declared = pool("e2b", capabilities={"max_vcpu": 2, "max_memory_mb": 4096})
    assert shortfalls(sized, declared) == []
    decision = route(sized, AuthMode.BYOK, [pool("e2b", priority=9), pool("modal")], {})
    assert routed(decision) == ("modal-pool", "provision.modal")


# --- GPU types -----------------------------------------------------------------------------

GPU_ITEM = {"resources": {"gpu": 1, "gpu_types": ["h100", "a100"]}}


def _gpu_pool(name: str, types: list[str], *, priority: int = 0, slots: int = 1) -> PoolView:
    return pool(
        "kubernetes",
        name=name,
        priority=priority,
        max_concurrent=slots,
        capabilities={"supports_gpu": True, "gpu_types": types},
    )


def test_an_item_takes_the_first_gpu_type_it_lists_that_has_room() -> None:
    a100 = _gpu_pool("a100s", ["a100"], priority=10)  # a higher priority, a less wanted type
    h100 = _gpu_pool("h100s", ["h100"])
    item = request(**GPU_ITEM)
    assert routed(route(item, AuthMode.BYOK, [a100, h100], {}))[0] == "h100s"
    # The h100s full: the next type, not a wait.
    assert routed(route(item, AuthMode.BYOK, [a100, h100], {h100.id: 1}))[0] == "a100s"
    both_full = route(item, AuthMode.BYOK, [a100, h100], {h100.id: 1, a100.id: 1})
    assert isinstance(both_full, Waiting)
    assert [p.name for p in both_full.pools] == ["h100s", "a100s"]


def test_a_pool_of_no_listed_gpu_type_does_not_qualify() -> None:
    l4 = _gpu_pool("l4s", ["l4"])
    untyped = pool("kubernetes", name="untyped", capabilities=GPU_CLOUD)
    with pytest.raises(NoEligiblePoolError, match="a GPU of type h100 or a100"):
        route(request(**GPU_ITEM), AuthMode.BYOK, [l4, untyped], {})
    # Without types asked, any GPU pool does, by priority as before.
    assert routed(route(request(resources={"gpu": 1}), AuthMode.BYOK, [l4], {}))[0] == "l4s"


@pytest.mark.parametrize(
    ("resources", "said"),
    [
        ({"gpu_types": ["a100"]}, "gpu_types needs gpu > 0"),
        ({"gpu": 1, "gpu_types": ["a100", "a100"]}, "lists a type twice"),
        ({"gpu": 1, "gpu_types": ["A100!"]}, "gpu_types"),
        ({"gpu": 1, "gpu_types": [f"t{n}" for n in range(9)]}, "gpu_types"),
    ],
)
def test_gpu_types_are_checked_in_the_message(resources: dict[str, Any], said: str) -> None:
    with pytest.raises(ValueError, match=said):
        request(resources=resources)


def test_a_pool_whose_stored_override_does_not_parse_is_passed_over_with_why() -> None:
    # Stored around the admin api or by an older version: the pool offers nothing and says
    # why; the org's other pools still route, and building its view raises nothing.
    broken = pool("docker", name="broken", priority=10, runtime_provides={"runtimes": ["python"]})
    assert broken.problem.startswith("invalid runtime_provides override: runtimes: unknown key")
    assert shortfalls(request(), broken) == [broken.problem]
    decision = route(request(), AuthMode.BYOK, [broken, pool("docker")], {})
    assert routed(decision) == ("docker-pool", "provision.docker")
    with pytest.raises(NoEligiblePoolError) as refused:
        route(request(), AuthMode.BYOK, [broken], {})
    assert "runtimes: unknown key" in str(refused.value)
