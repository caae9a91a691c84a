"""Boundary models: the dispatch message, version 1.

Upstream services send this as the argument of Celery task ``corral.dispatch`` or as the
body of ``POST /v1/dispatch``. Unknown fields are refused (``extra="forbid"``), so a typo
is an error rather than a silently ignored setting.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from providers.base import Resources, ToolchainDemand
from providers.capabilities import REQUIREMENT_KINDS, RUNTIME_KINDS, is_requirement_kind

IDENTIFIER = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$"


class _Message(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class RuntimeRef(_Message):
    kind: str

    @field_validator("kind")
    @classmethod
    def _known(cls, kind: str) -> str:
        if kind not in RUNTIME_KINDS:
            known = ", ".join(sorted(RUNTIME_KINDS))
            raise ValueError(f"unknown runtime kind {kind!r}; known: {known}")
        return kind


class Requirement(_Message):
    kind: str

    @field_validator("kind")
    @classmethod
    def _known(cls, kind: str) -> str:
        if not is_requirement_kind(kind):
            raise ValueError(
                f"unknown requirement kind {kind!r}; known: "
                f"{', '.join(sorted(REQUIREMENT_KINDS))}, or toolchain:<name>"
            )
        return kind


class AgentCard(_Message):
    """What the agent needs from its sandbox."""

    runtimes: tuple[RuntimeRef, ...] = ()
    requires: tuple[Requirement, ...] = ()

    @property
    def runtime_kinds(self) -> frozenset[str]:
        return frozenset(r.kind for r in self.runtimes)

    @property
    def requirement_kinds(self) -> frozenset[str]:
        return frozenset(r.kind for r in self.requires)


class ShellWork(_Message):
    """A command run with ``/bin/sh -c``."""

    kind: Literal["shell"] = "shell"
    command: str = Field(min_length=1, max_length=100_000)


class CodeWork(_Message):
    """Python code defining ``main(**arguments)``; its return value is the JSON result."""

    kind: Literal["code"] = "code"
    language: Literal["python"] = "python"
    code: str = Field(min_length=1, max_length=1_000_000)
    arguments: dict[str, Any] = Field(default_factory=dict)


Work = Annotated[ShellWork | CodeWork, Field(discriminator="kind")]


class EgressRequest(_Message):
    """The network a work item asks for."""

    allow_network: bool = Field(
        default=False,
        description="False: no network; the runner reaches the api through a Unix socket.",
    )
    allowed_hosts: tuple[str, ...] = Field(
        default=(),
        description="A custom egress policy; only pools that support custom network policies "
        "take such items.",
    )


SandboxFeature = Literal["pause-resume", "fs-snapshot"]


class DispatchRequest(_Message):
    """A request to run one piece of work in a sandbox (dispatch message v1)."""

    version: Literal[1] = 1
    org: str = Field(pattern=IDENTIFIER)
    project: str = Field(pattern=IDENTIFIER)
    profile: str = Field(pattern=IDENTIFIER, description="name of a model profile")
    agent_card: AgentCard = Field(default_factory=AgentCard)
    work: Work
    toolchain: ToolchainDemand = Field(default_factory=ToolchainDemand)
    resources: Resources = Field(default_factory=Resources)
    env: dict[str, str] = Field(default_factory=dict)
    egress: EgressRequest = Field(default_factory=EgressRequest)
    provider: str | None = Field(
        default=None, pattern=IDENTIFIER, description="only pools of this provider"
    )
    region: str | None = None
    arch: str | None = None
    sandbox_features: tuple[SandboxFeature, ...] = Field(
        default=(),
        description="sandbox abilities the work relies on: pause-resume (it may be paused "
        "while it waits), fs-snapshot (its filesystem may be snapshotted)",
    )
    idempotency_key: str | None = Field(default=None, min_length=1, max_length=255)

    @property
    def needs_gpu(self) -> bool:
        return self.resources.gpu > 0 or "gpu" in self.agent_card.requirement_kinds


def field_errors(error: ValidationError) -> list[dict[str, str]]:
    """Validation errors as ``{"field": "work.command", "message": ...}``, values left out."""
    return [
        {"field": ".".join(str(part) for part in e["loc"]) or "(message)", "message": _message(e)}
        for e in error.errors(include_input=False, include_url=False)
    ]


def _message(error: Any) -> str:
    # pydantic quotes the offending value in a few messages; say what was expected instead.
    context = error.get("ctx") or {}
    if error["type"] == "union_tag_invalid":
        expected = context.get("expected_tags", "")
        return f"unknown {context.get('discriminator', 'tag')}; expected one of {expected}"
    if error["type"] == "literal_error":
        return f"expected {context.get('expected', 'another value')}"
    return str(error["msg"]).removeprefix("Value error, ")


def describe_field_errors(errors: list[dict[str, str]]) -> str:
    return "; ".join(f"{e['field']}: {e['message']}" for e in errors)
