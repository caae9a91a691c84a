"""Boundary models: the dispatch message, version 1.

Upstream services send this as the argument of Celery task ``corral.dispatch`` or as the
body of ``POST /v1/dispatch``. Unknown fields are refused (``extra="forbid"``), so a typo
is an error rather than a silently ignored setting.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Iterable, Mapping
from typing import Annotated, Any, Literal

from pydantic import AliasChoices, BaseModel, ConfigDict, Field, ValidationError, field_validator

from corral.providers.base import Resources, ToolchainDemand
from corral.providers.capabilities import (
    REQUIREMENT_KINDS,
    RUNTIME_KINDS,
    CodeLanguage,
    is_requirement_kind,
)
from corral.providers.registry import default_registry
from corral.shared import kits
from corral.shared.text import IDENTIFIER, NulFree, Printable


class _Message(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class RuntimeRef(_Message):
    kind: str

    @field_validator("kind")
    @classmethod
    def _known(cls, kind: str) -> str:
        if kind not in RUNTIME_KINDS:
            known = ", ".join(sorted(RUNTIME_KINDS))
            raise ValueError(f"unknown runtime kind; known: {known}")
        return kind


class Requirement(_Message):
    kind: str

    @field_validator("kind")
    @classmethod
    def _known(cls, kind: str) -> str:
        if not is_requirement_kind(kind):
            raise ValueError(
                f"unknown requirement kind; known: {', '.join(sorted(REQUIREMENT_KINDS))}, "
                "or toolchain:<name>"
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
    command: NulFree = Field(min_length=1, max_length=100_000)


class CodeWork(_Message):
    """Code defining ``main``; its return value is the JSON result. Python's ``main`` is
    called as ``main(**arguments)``; JavaScript's (Node.js, CommonJS, may be async) as
    ``main(arguments)``, and needs a pool whose substrate has ``toolchain:node``."""

    kind: Literal["code"] = "code"
    language: CodeLanguage = "python"
    code: NulFree = Field(min_length=1, max_length=1_000_000)
    arguments: dict[str, Any] = Field(default_factory=dict)


Work = Annotated[ShellWork | CodeWork, Field(discriminator="kind")]


class EgressRequest(_Message):
    """The network a work item asks for."""

    allow_network: bool = Field(
        default=False,
        description="False: no network; the runner reaches the api through a Unix socket.",
    )
    allowed_hosts: tuple[Printable, ...] = Field(
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
    env: dict[Printable, NulFree] = Field(default_factory=dict)
    egress: EgressRequest = Field(default_factory=EgressRequest)
    provider: str | None = Field(
        default=None,
        pattern=IDENTIFIER,
        description="only pools of this provider (one corral has: see `corral providers list`)",
    )
    image: Printable | None = Field(
        default=None,
        min_length=1,
        max_length=512,
        description="an image of the work's own (routed only to pools whose provider "
        "honours one: docker, kubernetes)",
    )
    region: Printable | None = Field(default=None, max_length=255)
    arch: Printable | None = Field(default=None, max_length=255)
    sandbox_features: tuple[SandboxFeature, ...] = Field(
        default=(),
        description="sandbox abilities the work relies on: pause-resume (it may be paused "
        "while it waits), fs-snapshot (its filesystem may be snapshotted)",
    )
    idempotency_key: Printable | None = Field(default=None, min_length=1, max_length=255)

    @field_validator("toolchain")
    @classmethod
    def _known_kits(cls, value: ToolchainDemand) -> ToolchainDemand:
        # Resolved here so that an unknown kit is an invalid message, never a silent skip.
        if not value.kits:
            return value  # the catalogue is not read (a broken one stops kits alone)
        try:
            kits.current().resolve(value.kits)
        except kits.KitError as exc:
            raise ValueError(f"toolchain.kits: {exc}") from exc
        return value

    @field_validator("provider")
    @classmethod
    def _known_provider(cls, value: str | None) -> str | None:
        if value is not None and not default_registry.is_known(value):
            raise ValueError(
                f"unknown provider; known providers: {', '.join(default_registry.known_ids())}"
            )
        return value

    @property
    def needs_gpu(self) -> bool:
        return self.resources.gpu > 0 or "gpu" in self.agent_card.requirement_kinds


# An unknown key of a model is named when it looks like a field name (a typo is easier to
# fix when it is named); any other key a client chose (an env name, a map key) is shown as *.
_FIELD_NAME = re.compile(r"[a-z][a-z0-9_]{0,31}")
HIDDEN = "*"


def field_errors(
    error: ValidationError, model: type[BaseModel] | None = None
) -> list[dict[str, str]]:
    """Validation errors as ``{"field": "work.command", "message": ...}``, values left out.

    A field path keeps list positions and the words of ``model``'s schema (default: the
    dispatch message); other keys, chosen by the client, are shown as ``*``.
    """
    known = model_names(model or DispatchRequest)
    return [
        {
            "field": field_path(e["loc"], known, unknown_key=e["type"] == "extra_forbidden"),
            "message": error_message(e),
        }
        for e in error.errors(include_url=False)
    ]


def field_path(loc: Iterable[Any], names: frozenset[str], *, unknown_key: bool = False) -> str:
    """``loc`` as a dotted path of known words, positions and ``*`` for anything else."""
    parts = [str(part) for part in loc]
    shown = [
        part if part in names or part.isdigit() or part == "[key]" else HIDDEN for part in parts
    ]
    if unknown_key and parts and _FIELD_NAME.fullmatch(parts[-1]):
        shown[-1] = parts[-1]
    return ".".join(shown) or "(message)"


def schema_names(schema: Any) -> frozenset[str]:
    """Every property and parameter name and every enumerated string of a JSON schema (or
    an OpenAPI document): the words a field path may show without quoting a client."""
    names: set[str] = set()
    stack = [schema]
    while stack:
        node = stack.pop()
        if isinstance(node, list):
            stack.extend(node)
            continue
        if not isinstance(node, Mapping):
            continue
        properties = node.get("properties")
        if isinstance(properties, Mapping):
            names.update(str(key) for key in properties)
        if isinstance(node.get("name"), str) and "in" in node:  # an OpenAPI parameter
            names.add(node["name"])
        names.update(v for v in [*node.get("enum", ()), node.get("const")] if isinstance(v, str))
        stack.extend(node.values())
    return frozenset(names)


@functools.cache
def model_names(model: type[BaseModel]) -> frozenset[str]:
    """The words of ``model``'s schema, and the aliases its fields accept."""
    names = set(schema_names(model.model_json_schema()))
    for info in model.model_fields.values():
        alias = info.validation_alias
        choices = alias.choices if isinstance(alias, AliasChoices) else [alias]
        names.update(choice for choice in choices if isinstance(choice, str))
    return frozenset(names)


def error_message(error: Any) -> str:
    """The message of one pydantic error, in words that never quote the value."""
    # pydantic quotes the offending value in a few messages; say what was expected instead.
    context = error.get("ctx") or {}
    if error["type"] == "union_tag_invalid":
        expected = context.get("expected_tags", "")
        return f"unknown {context.get('discriminator', 'tag')}; expected one of {expected}"
    if error["type"] == "literal_error":
        return f"expected {context.get('expected', 'another value')}"
    message = str(error["msg"]).removeprefix("Value error, ")
    if _quotes(message, error.get("input")):  # a validator that quotes what it refused
        return f"invalid value ({error['type']})"
    return message


def _quotes(message: str, value: Any) -> bool:
    values = value[:50] if isinstance(value, list | tuple) else [value]
    return any(
        quoted in message
        for text in values
        if isinstance(text, str) and text
        for quoted in (repr(text), f"'{text}'", f'"{text}"')
    )


def describe_field_errors(errors: list[dict[str, str]]) -> str:
    return "; ".join(f"{e['field']}: {e['message']}" for e in errors)
