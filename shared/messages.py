"""Boundary models: the dispatch message, version 1.

Upstream services send this as the argument of Celery task ``corral.dispatch`` or as the
body of ``POST /v1/dispatch``. Unknown fields are refused (``extra="forbid"``), so a typo
is an error rather than a silently ignored setting.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Iterable, Mapping
from datetime import UTC, datetime
from typing import Annotated, Any, Literal, TypeVar
from urllib.parse import urlsplit

from pydantic import (
    AfterValidator,
    AliasChoices,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    StrictBool,
    ValidationError,
    field_validator,
    model_validator,
)

from corral.providers.base import Resources, ToolchainDemand
from corral.providers.capabilities import (
    REQUIREMENT_KINDS,
    RUNTIME_KINDS,
    CodeLanguage,
    is_requirement_kind,
)
from corral.providers.egress.rules import parse_host_rule
from corral.providers.registry import default_registry
from corral.shared import kits
from corral.shared.env_names import EnvMap, EnvRefusedError, check_env, check_env_names
from corral.shared.errors import CorralError
from corral.shared.keyring import is_sealed
from corral.shared.store.leases import LeaseSpec
from corral.shared.store.profiles import DEFAULT_PROFILE
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


MAX_ALLOWED_HOSTS = 256
MAX_PROXY_URL = 2048
MAX_CA_PEM = 65_536
MAX_SECRET_BINDINGS = 32
MAX_BINDING_VALUE = 8192
MAX_SECRET_ENV = 64
T = TypeVar("T", bound=Mapping[str, Any])
_HEADER_NAME = re.compile(r"^[A-Za-z0-9!#$%&'*+.^_`|~-]{1,128}$")
# A header value's characters as the egress proxy writes them (Latin-1): tab, visible
# characters and obs-text; never another control character.
_NOT_HEADER_TEXT = re.compile(r"[^\t\x20-\x7e\x80-\xff]")
_PEM_CERT = re.compile(r"-----BEGIN CERTIFICATE-----\s*[A-Za-z0-9+/=\s]+-----END CERTIFICATE-----")


def check_own_names(names: T) -> T:
    """``names`` unchanged, when each is an environment name a client may set and none is
    one of corral's own (``CORRAL_*``).

    Raises:
        EnvRefusedError: a name refused (:func:`~corral.shared.env_names.check_env_name`).
        ValueError: a name starts with ``CORRAL_``.
    """
    check_env_names(names)
    if any(name.startswith("CORRAL_") for name in names):
        raise ValueError(
            "a name starting with CORRAL_ is refused: corral's own environment variable names"
        )
    return names


def _host_entry(value: str) -> str:
    return str(parse_host_rule(value))


HostEntry = Annotated[str, AfterValidator(_host_entry)]


def check_credential_line(value: str) -> str:
    """``value`` unchanged, when it is one line of at most :data:`MAX_BINDING_VALUE`
    characters (a binding's value, a git input's credential).

    Raises:
        ValueError: it is longer, or not one line.
    """
    # The stored message holds the value sealed (a third larger) and is validated again
    # when routed: a sealed value was measured before it was sealed.
    if len(value) > MAX_BINDING_VALUE and not is_sealed(value):
        raise ValueError(f"at most {MAX_BINDING_VALUE} characters")
    if "\r" in value or "\n" in value:
        raise ValueError("must be one line: it goes into an HTTP header")
    return value


def check_binding_value(value: str) -> str:
    """``value`` unchanged, when it can be a secret binding's value (a named secret's is
    checked at provision, when it is read): one line the egress proxy can write into a
    header as it is.

    Raises:
        ValueError: it is longer than :data:`MAX_BINDING_VALUE`, not one line, or holds a
            control character or one beyond Latin-1.
    """
    check_credential_line(value)
    if _NOT_HEADER_TEXT.search(value):
        raise ValueError(
            "must be text an HTTP header can carry: no control characters, none beyond Latin-1"
        )
    return value


class SecretBindingRequest(_Message):
    """A credential the sandbox never sees (see docs/dispatch.md, secret bindings): its
    ``value`` in the message, or the name of a named ``secret`` (docs/secrets.md), read at
    provision and never carried by the message."""

    host: HostEntry = Field(
        description="host or host:port (one of allowed_hosts) whose plain-HTTP requests get "
        "the value"
    )
    value: NulFree | None = Field(
        default=None,
        min_length=1,
        repr=False,
        description=f"at most {MAX_BINDING_VALUE} characters, one line; or give secret",
    )
    secret: str | None = Field(
        default=None,
        pattern=IDENTIFIER,
        description="the name of a named secret of the org (else the deployment's) whose "
        "value is used, read when the sandbox is made; instead of value",
    )
    header: str | None = Field(
        default=None,
        pattern=_HEADER_NAME.pattern,
        description="only this request header gets the value (default: any header)",
    )

    @field_validator("value")
    @classmethod
    def _value(cls, value: str | None) -> str | None:
        return None if value is None else check_binding_value(value)

    @field_validator("host")
    @classmethod
    def _one_host(cls, value: str) -> str:
        network = parse_host_rule(value).network
        if network is not None and network.num_addresses > 1:
            raise ValueError(
                "must be a host name or one address, not a network: the value is put into "
                "requests to that one host (over HTTPS, with a certificate made for it)"
            )
        return value

    @model_validator(mode="after")
    def _value_or_secret(self) -> SecretBindingRequest:
        if (self.value is None) == (self.secret is None):
            raise ValueError("give exactly one of value and secret")
        return self


class EgressRequest(_Message):
    """The network a work item asks for; every field is enforced (docs/dispatch.md)."""

    allow_network: bool = Field(
        default=False,
        description="False: no network; the runner reaches the api through a Unix socket.",
    )
    allowed_hosts: tuple[HostEntry, ...] = Field(
        default=(),
        max_length=MAX_ALLOWED_HOSTS,
        description="with allow_network, the only destinations: host, host:port, IP or CIDR "
        "network; only pools whose provider enforces allowed_hosts take such items",
    )
    http_proxy: Printable | None = Field(default=None, max_length=MAX_PROXY_URL)
    https_proxy: Printable | None = Field(default=None, max_length=MAX_PROXY_URL)
    no_proxy: tuple[Printable, ...] = Field(default=(), max_length=MAX_ALLOWED_HOSTS)
    ca_cert_pem: NulFree | None = Field(default=None, max_length=MAX_CA_PEM, repr=False)
    secret_bindings: dict[str, SecretBindingRequest] = Field(
        default_factory=dict,
        max_length=MAX_SECRET_BINDINGS,
        description="env var name -> binding; the sandbox sees a placeholder only",
    )

    @field_validator("http_proxy", "https_proxy")
    @classmethod
    def _proxy_url(cls, value: str | None) -> str | None:
        if value is not None:
            parts = urlsplit(value)
            if parts.scheme not in ("http", "https") or not parts.hostname:
                raise ValueError("must be an http:// or https:// URL with a host")
        return value

    @field_validator("no_proxy")
    @classmethod
    def _no_proxy_entries(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        if any(not entry or len(entry) > 261 or "," in entry for entry in value):
            raise ValueError("each entry must be 1-261 characters without commas")
        return value

    @field_validator("ca_cert_pem")
    @classmethod
    def _pem(cls, value: str | None) -> str | None:
        if value is not None and not _PEM_CERT.search(value):
            raise ValueError(
                "must be PEM certificates (-----BEGIN CERTIFICATE----- ... "
                "-----END CERTIFICATE-----)"
            )
        return value

    @field_validator("secret_bindings")
    @classmethod
    def _binding_names(
        cls, value: dict[str, SecretBindingRequest]
    ) -> dict[str, SecretBindingRequest]:
        return check_own_names(value)

    @model_validator(mode="after")
    def _consistent(self) -> EgressRequest:
        network_only = {
            "allowed_hosts": self.allowed_hosts,
            "http_proxy": self.http_proxy,
            "https_proxy": self.https_proxy,
            "no_proxy": self.no_proxy,
            "secret_bindings": self.secret_bindings,
        }
        asked = [name for name, value in network_only.items() if value]
        if asked and not self.allow_network:
            raise ValueError(
                f"{', '.join(asked)} need allow_network: true (without it the sandbox has no "
                "network at all)"
            )
        if self.allowed_hosts and (self.http_proxy or self.https_proxy):
            raise ValueError(
                "http_proxy/https_proxy cannot be combined with allowed_hosts: corral enforces "
                "allowed_hosts itself (its egress proxy or the provider's policy); list the "
                "hosts the work needs instead"
            )
        allowed = set(self.allowed_hosts)
        if any(binding.host not in allowed for binding in self.secret_bindings.values()):
            raise ValueError("each secret binding's host must be one of allowed_hosts")
        return self

    @property
    def has_custom_egress(self) -> bool:
        return bool(
            self.allowed_hosts or self.http_proxy or self.https_proxy or self.no_proxy
        ) or bool(self.ca_cert_pem or self.secret_bindings)


SandboxFeature = Literal["pause-resume", "fs-snapshot", "exec-files"]
Priority = Literal["low", "normal", "high"]
GIT_SCHEMES = ("https", "http", "ssh", "git", "file")
# A branch, tag or commit: no leading '-' (never an option to git), no '..', no spaces.
GIT_REF = r"^[A-Za-z0-9._/+@][A-Za-z0-9._/+@-]{0,254}$"
_GIT_PATH = re.compile(r"[A-Za-z0-9._~/%+-]*")


class GitInput(_Message):
    """A repository whose ref is checked out into the workspace before post_acquire."""

    url: Printable = Field(
        min_length=1,
        max_length=2048,
        description="https://, http://, ssh://, git:// or file:// URL, with no user or password "
        "in it (it is stored and logged as it is) and no query or fragment",
    )
    ref: str = Field(pattern=GIT_REF, description="a branch, tag or commit id")
    secret: str | None = Field(
        default=None,
        pattern=IDENTIFIER,
        description="the name of a named secret of the org (else the deployment's): corral's "
        "egress proxy sends it as the checkout's HTTP Basic credential, for that repository's "
        "fetch alone and only until the checkout is done; the sandbox never sees it "
        "(https:// URLs only; docs/secrets.md#private-repositories)",
    )

    @field_validator("ref")
    @classmethod
    def _no_dots(cls, ref: str) -> str:
        if ".." in ref:
            raise ValueError("a git ref must not contain '..'")
        return ref

    @field_validator("url")
    @classmethod
    def _plain_url(cls, url: str) -> str:
        parts = urlsplit(url)
        if parts.scheme not in GIT_SCHEMES:
            raise ValueError(f"a git URL's scheme must be one of {', '.join(GIT_SCHEMES)}")
        # ssh://git@host/... names a login, not a secret; anything else may be a token.
        if parts.password is not None or (parts.username is not None and parts.scheme != "ssh"):
            raise ValueError(
                "a git URL must not carry credentials (it would be stored and logged in plain "
                "text); name a secret in inputs.git.secret instead (https:// URLs)"
            )
        if parts.query or parts.fragment or (parts.scheme != "file" and not parts.hostname):
            raise ValueError("a git URL needs a host (file:// excepted), and no query or fragment")
        return url

    @model_validator(mode="after")
    def _credential_over_https(self) -> GitInput:
        if self.secret is None:
            return self
        parts = urlsplit(self.url)
        if parts.scheme != "https":
            raise ValueError(
                "a git input with a secret needs an https:// URL: the credential is never "
                "sent in clear"
            )
        if not _GIT_PATH.fullmatch(parts.path):
            raise ValueError(
                "a git input with a secret needs a URL path of letters, digits and -._~/%+ "
                "alone: the credential applies to that repository's requests, matched exactly"
            )
        try:
            parse_host_rule(parts.netloc)
        except ValueError as exc:
            raise ValueError(f"a git input with a secret: its URL's host {exc}") from None
        return self


class WorkspaceInputs(_Message):
    """What the workspace starts with; the result bundle is made against it."""

    git: GitInput | None = None


class ReviewRequest(_Message):
    """Whether the result bundle waits for an admin's accept or reject."""

    required: bool = False


_NUMBER = re.compile(r"\s*[-+]?[0-9.]+(e[-+]?[0-9]+)?\s*", re.IGNORECASE)
EXPIRY_FORMAT = "an ISO-8601 date and time with its UTC offset, e.g. 2030-01-01T12:00:00Z"


def _expiry_text(value: Any) -> Any:
    """``expires_at`` as sent: a datetime a Celery sender passed as one arrives in kombu's
    JSON form (``{"__type__": "datetime", "__value__": "..."}``), read as its value; a
    number is refused (seconds since when, in which zone, is a guess)."""
    if isinstance(value, dict) and value.get("__type__") == "datetime":
        inner = value.get("__value__")
        return inner if isinstance(inner, str) else value
    if isinstance(value, int | float) or (isinstance(value, str) and _NUMBER.fullmatch(value)):
        raise ValueError(f"expected {EXPIRY_FORMAT}")
    return value


def _in_utc(value: datetime) -> datetime:
    """The instant in UTC, as it is stored and compared; one without an offset (whose
    instant depends on where it is read) is refused."""
    if value.tzinfo is None or value.utcoffset() is None:
        raise ValueError(f"has no UTC offset: expected {EXPIRY_FORMAT}")
    try:
        return value.astimezone(UTC)
    except OverflowError:  # 9999-12-31T23:59:59-01:00 is past year 9999 in UTC
        raise ValueError("out of range: at most 9999-12-31T23:59:59Z") from None


Expiry = Annotated[datetime, BeforeValidator(_expiry_text), AfterValidator(_in_utc)]


class DispatchRequest(_Message):
    """A request to run one piece of work in a sandbox (dispatch message v1)."""

    version: Literal[1] = 1
    org: str = Field(pattern=IDENTIFIER)
    project: str = Field(pattern=IDENTIFIER)
    profile: str = Field(
        default=DEFAULT_PROFILE,
        pattern=IDENTIFIER,
        description="name of a model profile (a model and its auth mode, which the deployment "
        "makes: `corral profiles create`); the work gets its model in CORRAL_MODEL. Default: "
        "`default`",
    )
    agent_card: AgentCard = Field(default_factory=AgentCard)
    work: Work
    toolchain: ToolchainDemand = Field(default_factory=ToolchainDemand)
    resources: Resources = Field(default_factory=Resources)
    env: EnvMap = Field(default_factory=dict)
    secret_env: dict[str, Annotated[str, Field(pattern=IDENTIFIER)]] = Field(
        default_factory=dict,
        max_length=MAX_SECRET_ENV,
        description="env var name -> the name of a named secret of the org (else the "
        "deployment's): the work gets its value in that variable, read when the runner "
        "claims the item; the message never carries it (docs/secrets.md)",
    )
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
        "while it waits), fs-snapshot (its filesystem may be snapshotted), exec-files "
        "(commands run in it and files moved in and out from outside, as in an interactive "
        "session)",
    )
    idempotency_key: Printable | None = Field(default=None, min_length=1, max_length=255)
    priority: Priority = Field(
        default="normal",
        description="among the org's items waiting for the same pools: high before normal "
        "before low, each class a head start of CORRAL_PRIORITY_AGING_S of waiting over the "
        "next, so no class starves (docs/architecture.md §4, admission order)",
    )
    inputs: WorkspaceInputs = Field(
        default_factory=WorkspaceInputs,
        description="what is put into the workspace before post_acquire (a git checkout)",
    )
    bundle: bool = Field(
        default=False,
        description="collect what the work changed in its workspace as a result bundle "
        "(GET /v1/work-items/{id}/bundle)",
    )
    review: ReviewRequest = Field(
        default_factory=ReviewRequest,
        description="required: the bundle is held as review_requested until accepted or "
        "rejected (implies bundle)",
    )
    lease: LeaseSpec | None = Field(
        default=None,
        description="how many sandboxes the item may get and which ends give it another "
        "(max_attempts, retry_on_work_failed, on_heartbeat_lost, back-off); a field left "
        "out is its pool's, then the deployment's (docs/dispatch.md#lease)",
    )
    failover: StrictBool = Field(
        default=True,
        description="a pool whose provider cannot make the item's sandbox hands it to the next "
        "qualifying pool, and a provider failing transiently past the retries sends it back "
        "to waiting; false: the item fails on its pool's provision failure "
        "(docs/dispatch.md#failover)",
    )
    expires_at: Expiry | None = Field(
        default=None,
        description=f"when the item stops being worth running: not final by then, it fails "
        f"as expired, whatever its state (a running sandbox is ended as at its deadline); "
        f"already past when it arrives: a dispatch error, expired. {EXPIRY_FORMAT[0].upper()}"
        f"{EXPIRY_FORMAT[1:]}; one without an offset is refused (docs/dispatch.md#expiry)",
    )

    @property
    def collects_bundle(self) -> bool:
        return self.bundle or self.review.required

    @field_validator("toolchain")
    @classmethod
    def _toolchain_env(cls, value: ToolchainDemand) -> ToolchainDemand:
        # ToolchainDemand is the providers' model (a layer below this rule): checked here.
        try:
            check_env(value.env)
        except EnvRefusedError as exc:
            raise ValueError(f"toolchain.env: {exc}") from exc
        return value

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

    @field_validator("secret_env")
    @classmethod
    def _secret_env_names(cls, value: dict[str, str]) -> dict[str, str]:
        return check_own_names(value)

    @model_validator(mode="after")
    def _bindings_apart_from_env(self) -> DispatchRequest:
        names = set(self.egress.secret_bindings)
        if names & (set(self.env) | set(self.toolchain.env)):
            raise ValueError(
                "a secret binding's name is also in env or toolchain.env: the sandbox would "
                "see the value; give it only as a binding"
            )
        named = set(self.secret_env)
        if named & (set(self.env) | set(self.toolchain.env) | names):
            raise ValueError(
                "a secret_env name is also in env, toolchain.env or egress.secret_bindings: "
                "each variable has one source"
            )
        return self

    @property
    def secret_refs(self) -> dict[str, str]:
        """The named secrets the message refers to, by the field that names each
        (``secret_env.NAME``, ``egress.secret_bindings.NAME``, ``inputs.git.secret``)."""
        refs = {f"secret_env.{var}": name for var, name in self.secret_env.items()}
        refs.update(
            (f"egress.secret_bindings.{var}", name) for var, name in self.binding_secrets.items()
        )
        git = self.inputs.git
        if git is not None and git.secret is not None:
            refs["inputs.git.secret"] = git.secret
        return refs

    @property
    def binding_secrets(self) -> dict[str, str]:
        """Each secret binding that names a secret: binding name -> secret name."""
        return {
            var: binding.secret
            for var, binding in self.egress.secret_bindings.items()
            if binding.secret is not None
        }

    @model_validator(mode="after")
    def _reachable_input(self) -> DispatchRequest:
        git = self.inputs.git
        if git is not None and not git.url.startswith("file:") and not self.egress.allow_network:
            raise ValueError(
                "inputs.git: a repository fetched over the network needs "
                "egress.allow_network: true (without it the checkout could only fail)"
            )
        return self

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


class StoredMessageError(CorralError, ValueError):
    """an item's stored message no longer validates: the deployment's rules changed since
    it was accepted (a kit dropped from the catalogue, say)"""

    code = "invalid_message"


def stored_request(payload: Mapping[str, Any]) -> DispatchRequest:
    """The request of an item's stored message (its values opened), validated again as it
    is read to be run.

    Raises:
        StoredMessageError: it no longer validates; it names the fields, never a value.
    """
    try:
        return DispatchRequest.model_validate(payload)
    except ValidationError as exc:
        problems = describe_field_errors(field_errors(exc))
    # Not chained: a ValidationError's text quotes the opened values, secrets included, and
    # a traceback that logged it would carry them.
    raise StoredMessageError(
        f"the item's message no longer validates under this deployment's rules (they changed "
        f"since it was accepted): {problems}; dispatch it again as they are now"
    )
