"""The capability matrix matches the reference tables, and overrides are validated."""

from __future__ import annotations

import pytest

from corral.providers.capabilities import UNDECLARED, derive_capabilities
from corral.providers.descriptors import BUILTIN
from corral.providers.errors import InvalidCapabilityOverrideError
from corral.providers.registry import default_registry

# The reference matrix's columns, in its order; a provider is checked against its column
# once corral has it (a column alone is not a provider).
REFERENCE = ["local", "docker", "kubernetes", "e2b", "daytona", "modal", "vercel"]
BUILTINS = [provider_id for provider_id in REFERENCE if provider_id in BUILTIN]
# Code interpreters run code items through an execute-code API: no column of the reference.
CODE_INTERPRETERS = {"agentrun"}


def providers_with_requirement(kind: str) -> set[str]:
    return {
        provider_id
        for provider_id, descriptor in BUILTIN.items()
        if kind in descriptor.capabilities.substrate.requirement_kinds
    }


def test_every_builtin_provider_is_a_column_of_the_reference() -> None:
    assert set(BUILTIN) <= set(REFERENCE) | CODE_INTERPRETERS
    assert {"local", "docker", "kubernetes", "e2b"} <= set(BUILTIN)


def test_code_interpreters_run_code_alone_and_every_other_provider_both_kinds() -> None:
    for provider_id, descriptor in BUILTIN.items():
        expected = ("code",) if provider_id in CODE_INTERPRETERS else ("shell", "code")
        assert descriptor.capabilities.work_kinds == expected, provider_id
    agentrun = BUILTIN["agentrun"].capabilities
    assert agentrun.max_session_duration_seconds == 30  # the execute call's hard timeout
    assert agentrun.billing_model == "wall-clock"
    assert not (agentrun.supports_pause_resume or agentrun.supports_fs_snapshot)
    assert agentrun.substrate.runtime_kinds == {"python-pip"}
    assert agentrun.substrate.requirement_kinds == frozenset()


@pytest.mark.parametrize(
    ("kind", "providers"),
    [
        ("persistent-storage", {"local", "docker", "kubernetes"}),
        ("long-running", {"local", "docker", "kubernetes", "e2b"}),
        ("workarea", {"local", "docker", "kubernetes"}),
        ("host-binary", {"local"}),
        ("gpu", set()),  # only an operator's override declares a GPU
        ("git", set(REFERENCE)),
        ("full-history-clone", set(REFERENCE)),
        ("network-egress", set(REFERENCE)),
        ("toolchain:go", {"local", "docker", "kubernetes"}),
        ("toolchain:node", {"local", "docker", "kubernetes", "vercel"}),
    ],
)
def test_requirement_defaults_follow_the_reference(kind: str, providers: set[str]) -> None:
    assert providers_with_requirement(kind) == providers & set(BUILTINS)


def test_host_binary_runtime_is_local_only() -> None:
    with_host_binary = {
        provider_id
        for provider_id, descriptor in BUILTIN.items()
        if "host-binary" in descriptor.capabilities.substrate.runtime_kinds
    }
    assert with_host_binary == {"local"}


MATRIX = {
    # field: values for local, docker, kubernetes, e2b, daytona, modal, vercel
    "transport_model": ["either"] * 3 + ["dial-in"] * 4,
    "supports_fs_snapshot": [False] * 3 + [True] * 4,
    "supports_pause_resume": [False, False, False, True, False, False, False],
    "supports_capacity_query": [True] * 3 + [False] * 4,
    "supports_gpu": [False] * 5 + [True, False],
    "supports_exec_files": [True, True, False, False, True, False, True],
    "enforces_allowed_hosts": [True, True, True, True, False, False, True],
    "enforces_secret_bindings": [True, True] + [False] * 5,
    "idle_cost_model": ["zero", "zero", "metered", "zero", "storage-only", "metered", "metered"],
    "billing_model": ["fixed"] * 3 + ["wall-clock"] * 3 + ["active-cpu"],
    "max_session_duration_seconds": [None] * 6 + [18_000],
    "egress_default": ["allow-all"] * 7,
}


@pytest.mark.parametrize("field", sorted(MATRIX))
def test_capability_matrix_matches_the_reference_table(field: str) -> None:
    declared = [getattr(BUILTIN[p].capabilities, field) for p in BUILTINS]
    assert declared == [MATRIX[field][REFERENCE.index(p)] for p in BUILTINS]


def test_override_wins_over_the_class_default() -> None:
    override = {"runtimeKinds": ["npm"], "requirementKinds": ["gpu", "toolchain:rust"]}
    substrate = derive_capabilities(BUILTIN["e2b"].capabilities, override)
    assert substrate.runtime_kinds == {"npm"}
    assert substrate.requirement_kinds == {"gpu", "toolchain:rust"}


def test_snake_case_override_keys_are_accepted() -> None:
    substrate = derive_capabilities(
        BUILTIN["local"].capabilities, {"runtime_kinds": [], "requirement_kinds": ["git"]}
    )
    assert substrate.requirement_kinds == {"git"}


def test_class_default_applies_without_override() -> None:
    docker = BUILTIN["docker"].capabilities
    assert derive_capabilities(docker) == docker.substrate


def test_an_unknown_provider_has_an_empty_substrate_and_no_extras() -> None:
    capabilities = default_registry.capabilities_of("acme-cloud")
    assert capabilities == UNDECLARED
    assert capabilities.substrate.runtime_kinds == frozenset()
    assert capabilities.substrate.requirement_kinds == frozenset()
    assert not capabilities.supports_gpu and not capabilities.supports_pause_resume


@pytest.mark.parametrize(
    ("override", "named"),
    [
        ({"runtimeKinds": ["cobol"]}, "runtimeKinds: unknown runtime kind(s); known: a2a"),
        ({"requirementKinds": ["quantum"]}, "requirementKinds: unknown requirement kind(s)"),
        ({"requirementKinds": ["toolchain:"]}, "requirementKinds: unknown requirement kind(s)"),
        ({"runtimeKinds": ["npm"], "extra": True}, "extra: unknown key"),
        (["npm"], "got list"),
        ({"runtimeKinds": "npm"}, "runtimeKinds"),
    ],
)
def test_malformed_overrides_name_where_and_why(override: object, named: str) -> None:
    with pytest.raises(InvalidCapabilityOverrideError) as raised:
        derive_capabilities(BUILTIN["local"].capabilities, override)
    assert named in str(raised.value)
    for kind in ("cobol", "quantum", "'toolchain:'"):  # the kinds themselves are not quoted
        assert kind not in str(raised.value)
    assert raised.value.code == "invalid_capability_override"


def test_missing_lists_what_a_substrate_lacks() -> None:
    substrate = derive_capabilities(BUILTIN["e2b"].capabilities)
    assert substrate.missing(["npm", "python-pip"], ["gpu", "git"]) == [
        "runtime npm",
        "requirement gpu",
    ]
