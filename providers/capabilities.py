"""What providers can do: the capability matrix and the substrate they offer.

The scheduler routes on these values alone, never on a provider's name, so declare them
accurately: an over-declared ability fails at session time instead of at routing time.

Two parts:

* the capability matrix (:class:`ProviderCapabilities`): transport, snapshots, limits,
  billing, GPU, networking;
* the substrate (:class:`Substrate`): which agent-card ``runtimes[].kind`` and
  ``requires[].kind`` values a pool satisfies. A pool may override it
  (``runtime_provides``); otherwise the provider class default applies.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from typing import Any, Literal

from pydantic import AliasChoices, BaseModel, ConfigDict, Field, ValidationError, field_validator

from corral.providers.errors import InvalidCapabilityOverrideError

TransportModel = Literal["dial-in", "dial-out", "either"]
IdleCostModel = Literal["zero", "storage-only", "metered"]
BillingModel = Literal["fixed", "wall-clock", "active-cpu"]
WorkKind = Literal["shell", "code"]
CodeLanguage = Literal["python", "javascript"]
SizedResource = Literal["cpu", "memory"]
EgressDefault = Literal["allow-all", "deny-all"]

# What a provider's code does (to a sandbox's egress; commands and files from outside), not a
# setting: a pool cannot override these (an override could only claim what is not there).
ENFORCEMENT_FIELDS = frozenset(
    {"enforces_allowed_hosts", "enforces_secret_bindings", "supports_exec_files"}
)
# The name the allowed-hosts field had before it was enforced; stored pool overrides with
# it are read without it.
LEGACY_NETWORK_POLICY_FIELD = "supports_custom_network_policy"

RUNTIME_KINDS: frozenset[str] = frozenset(
    {
        "native",  # binary process
        "npm",  # Node.js / npm package
        "python-pip",  # Python pip package
        "http",  # HTTP service
        "mcp-server",  # MCP protocol server
        "a2a-protocol",  # A2A protocol agent
        "host-binary",  # host-installed binary (local only)
        "workarea",  # persistent filesystem workarea
        "vendor-hosted",  # external SaaS, no local compute
        "langchain-runnable",  # LangChain runnable
    }
)

REQUIREMENT_KINDS: frozenset[str] = frozenset(
    {
        "persistent-storage",
        "long-running",
        "workarea",
        "host-binary",
        "network-egress",
        "gpu",
        "git",
        "full-history-clone",
    }
)

# Besides the closed set, any `toolchain:<name>` is a requirement kind.
TOOLCHAIN_KIND = re.compile(r"^toolchain:[a-z0-9][a-z0-9._+-]{0,62}$")


def is_requirement_kind(kind: str) -> bool:
    return kind in REQUIREMENT_KINDS or bool(TOOLCHAIN_KIND.match(kind))


class Substrate(BaseModel):
    """The agent-card kinds a pool satisfies.

    Accepts the camelCase keys used in pool JSON (``runtimeKinds``, ``requirementKinds``)
    as well as snake_case.
    """

    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)

    runtime_kinds: frozenset[str] = Field(
        default=frozenset(), validation_alias=AliasChoices("runtime_kinds", "runtimeKinds")
    )
    requirement_kinds: frozenset[str] = Field(
        default=frozenset(),
        validation_alias=AliasChoices("requirement_kinds", "requirementKinds"),
    )

    @field_validator("runtime_kinds")
    @classmethod
    def _known_runtime_kinds(cls, kinds: frozenset[str]) -> frozenset[str]:
        unknown = sorted(kinds - RUNTIME_KINDS)
        if unknown:
            # Not quoted: these come from api clients too, whose values are never echoed.
            raise ValueError(f"unknown runtime kind(s); known: {', '.join(sorted(RUNTIME_KINDS))}")
        return kinds

    @field_validator("requirement_kinds")
    @classmethod
    def _known_requirement_kinds(cls, kinds: frozenset[str]) -> frozenset[str]:
        unknown = sorted(k for k in kinds if not is_requirement_kind(k))
        if unknown:
            raise ValueError(
                f"unknown requirement kind(s); known: {', '.join(sorted(REQUIREMENT_KINDS))}, "
                "or toolchain:<name>"
            )
        return kinds

    def missing(self, runtime_kinds: Iterable[str], requirement_kinds: Iterable[str]) -> list[str]:
        """The requested kinds this substrate lacks, as ``runtime X`` / ``requirement Y``."""
        lacking = [f"runtime {k}" for k in sorted(set(runtime_kinds) - self.runtime_kinds)]
        lacking += [
            f"requirement {k}" for k in sorted(set(requirement_kinds) - self.requirement_kinds)
        ]
        return lacking


class ProviderCapabilities(BaseModel):
    """A provider's capability matrix plus its default substrate. Every field is declared."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    transport_model: TransportModel
    supports_fs_snapshot: bool
    supports_pause_resume: bool
    supports_capacity_query: bool
    max_concurrent: int | None
    max_session_duration_seconds: int | None
    regions: tuple[str, ...]
    os: tuple[str, ...]
    arch: tuple[str, ...]
    idle_cost_model: IdleCostModel
    billing_model: BillingModel
    max_vcpu: float | None
    max_memory_mb: int | None
    supports_gpu: bool
    gpu_types: tuple[str, ...] = Field(
        default=(),
        description="the GPU types its sandboxes have (a pool declares its own: a100, h100, "
        "...); an item listing resources.gpu_types goes only to a pool with one of them",
    )
    enforces_allowed_hosts: bool = Field(
        description="restricts a sandbox's egress to a dispatch's `egress.allowed_hosts` "
        "(corral's egress proxy, a NetworkPolicy or the vendor's allow-list); routing sends "
        "items with allowed_hosts nowhere else"
    )
    enforces_secret_bindings: bool = Field(
        description="runs corral's egress proxy, which substitutes `egress.secret_bindings` "
        "on the way out; routing sends items with secret bindings nowhere else"
    )
    supports_item_image: bool = Field(
        default=False, description="honours a dispatch's own `image` (SandboxSpec.image)"
    )
    supports_exec_files: bool = Field(
        default=False,
        description="runs commands in a live sandbox and moves files in and out of it "
        "(SupportsExec and SupportsFiles): what an interactive session (POST /v1/sessions) "
        "needs; routing sends sessions nowhere else",
    )
    egress_default: EgressDefault
    is_a2a_remote: bool
    work_kinds: tuple[WorkKind, ...] = Field(
        default=("shell", "code"),
        min_length=1,
        description="the dispatch work kinds its sandboxes run; a code interpreter "
        "(SupportsCodeInterpreter) runs code alone",
    )
    sized_resources: tuple[SizedResource, ...] = Field(
        default=("cpu", "memory"),
        description="the resources it sizes each sandbox by (resources.cpu, "
        "resources.memory_mb); an item asking for another goes only where the matrix "
        "declares a max_vcpu / max_memory_mb it fits in (a fixed sandbox size)",
    )
    code_languages: tuple[CodeLanguage, ...] = Field(
        default=("python", "javascript"),
        description="the languages of `code` work it runs (javascript also needs the "
        "substrate's toolchain:node: the runner runs it with the sandbox's node)",
    )
    substrate: Substrate


def matrix(**fields: Any) -> ProviderCapabilities:
    """One column of the matrix; the fields no column varies default here."""
    base: dict[str, Any] = {
        "supports_fs_snapshot": False,
        "supports_pause_resume": False,
        "supports_capacity_query": False,
        "max_concurrent": None,
        "max_session_duration_seconds": None,
        "regions": ("*",),
        "os": ("linux",),
        "arch": ("x86_64",),
        "max_vcpu": None,
        "max_memory_mb": None,
        "supports_gpu": False,
        "enforces_allowed_hosts": False,
        "enforces_secret_bindings": False,
        "egress_default": "allow-all",
        "is_a2a_remote": False,
    }
    return ProviderCapabilities.model_validate(base | fields)


SELF_HOSTED_RUNTIMES = frozenset(
    {
        "native",
        "npm",
        "python-pip",
        "http",
        "mcp-server",
        "a2a-protocol",
        "workarea",
        "vendor-hosted",
        "langchain-runnable",
    }
)
# Cloud sandboxes boot from a bare template: no Node toolchain and no persistent workarea
# unless an operator bakes them in and declares a runtime_provides override.
CLOUD_RUNTIMES = frozenset(
    {
        "native",
        "python-pip",
        "http",
        "mcp-server",
        "a2a-protocol",
        "vendor-hosted",
        "langchain-runnable",
    }
)
EVERYWHERE = frozenset({"network-egress", "git", "full-history-clone"})
SELF_HOSTED_REQUIREMENTS = EVERYWHERE | {
    "persistent-storage",
    "long-running",
    "workarea",
    "toolchain:go",
    "toolchain:node",
}

# What a provider that declares nothing gets: nothing optional and an empty substrate, so
# nothing is routed to it on the strength of a guess.
UNDECLARED = matrix(
    transport_model="dial-out",
    idle_cost_model="zero",
    billing_model="wall-clock",
    substrate=Substrate(),
)


def parse_substrate_override(override: object) -> Substrate:
    """Validate a pool's ``runtime_provides`` value.

    Raises:
        InvalidCapabilityOverrideError: not an object, unknown keys, or unknown kinds; the
            message names them.
    """
    if isinstance(override, Substrate):
        return override
    if not isinstance(override, Mapping):
        raise InvalidCapabilityOverrideError(
            "runtime_provides must be an object with runtimeKinds and requirementKinds lists, "
            f"got {type(override).__name__}"
        )
    try:
        return Substrate.model_validate(dict(override))
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(map(str, e['loc'])) or 'runtime_provides'}: "
            + (
                "unknown key, expected runtimeKinds or requirementKinds"
                if e["type"] == "extra_forbidden"
                else e["msg"].removeprefix("Value error, ")
            )
            for e in exc.errors()
        )
        raise InvalidCapabilityOverrideError(
            f"invalid runtime_provides override: {problems}"
        ) from exc


def derive_capabilities(defaults: ProviderCapabilities, override: object = None) -> Substrate:
    """The substrate a pool offers: its ``runtime_provides`` override when it is not None,
    else its provider's default (``defaults``, the provider's declared matrix).

    Raises:
        InvalidCapabilityOverrideError: when the override is malformed.
    """
    if override is not None:
        return parse_substrate_override(override)
    return defaults.substrate
