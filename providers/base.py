"""The sandbox provider contract.

A provider starts and stops sandboxes (:class:`SandboxProvider`). Everything else a
provider may do — stream logs, run commands, move files, pause, list what it owns, report
capacity — is a separate small protocol (``Supports*``), and callers ask
``isinstance(provider, SupportsExec)`` rather than checking a provider's name. What a
provider declares in its capabilities must match the protocols it implements; the contract
suite in ``tests/contract`` checks both ways.
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, ClassVar, Protocol, runtime_checkable

from pydantic import BaseModel, ConfigDict, Field, SecretStr, field_validator, model_validator

from corral.providers.capabilities import ProviderCapabilities
from corral.providers.config import ProviderConfig, ProviderOptions, default_state_dir, parse_model
from corral.providers.descriptors import declared_capabilities
from corral.shared.text import INT32_MAX, NulFree, Printable

if TYPE_CHECKING:  # the resolver brings cryptography; the base needs only its type
    from corral.providers.credentials import CredentialResolver


class _Frozen(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


# A GPU type as a deployment names it on its pools (a100, h100-80gb, l4): lower case.
GpuType = Annotated[str, Field(pattern=r"^[a-z0-9][a-z0-9._-]{0,31}$")]


class Resources(_Frozen):
    """What a sandbox may use. ``None`` leaves the provider's default in force."""

    cpu: float | None = Field(default=None, gt=0, le=1_000_000, description="vCPUs")
    memory_mb: int | None = Field(default=None, gt=0, le=INT32_MAX)
    timeout_s: int | None = Field(
        default=None, gt=0, le=INT32_MAX, description="hard deadline from start"
    )
    gpu: int = Field(default=0, ge=0, le=INT32_MAX, description="number of GPUs")
    gpu_types: tuple[GpuType, ...] = Field(
        default=(),
        max_length=8,
        description="the GPU types the work accepts, the most wanted first: routing takes "
        "the first type a qualifying pool with room has (pools declare theirs in their "
        "capabilities' gpu_types); needs gpu > 0",
    )

    @model_validator(mode="after")
    def _types_need_gpus(self) -> Resources:
        if self.gpu_types and self.gpu == 0:
            raise ValueError("gpu_types needs gpu > 0 (how many GPUs of those types)")
        if len(set(self.gpu_types)) != len(self.gpu_types):
            raise ValueError("gpu_types lists a type twice")
        return self


class ToolchainDemand(_Frozen):
    """Toolchain steps the runner inside the box executes; provision() only carries them."""

    # Commands and env values reach a process's argv and environment: no NUL there.
    kits: tuple[Printable, ...] = ()
    os: Printable = "linux"
    install_commands: tuple[NulFree, ...] = ()
    post_acquire: tuple[NulFree, ...] = ()
    pre_release: tuple[NulFree, ...] = ()
    env: dict[Printable, NulFree] = Field(default_factory=dict)


class SecretBinding(_Frozen):
    """A credential the sandbox never sees: its env var holds ``placeholder``, and corral's
    egress proxy puts ``value`` in its place in the headers of requests to ``host`` (only
    ``header`` when given), plain HTTP and HTTPS alike (it terminates the host's TLS).

    A checkout binding (``checkout_requests``: the git input's credential) has no env var:
    it applies inside TLS, to those ``(method, request target)`` pairs alone, until the
    runner says the checkout is done."""

    host: str
    value: SecretStr
    header: str | None = None
    checkout_requests: tuple[tuple[str, str], ...] = ()

    @staticmethod
    def placeholder_for(name: str) -> str:
        return f"corral-secret-binding:{name}"


# Where the CA bundle arrives in the sandbox's environment; the runner writes it to a file
# and points SSL_CERT_FILE, REQUESTS_CA_BUNDLE and NODE_EXTRA_CA_CERTS at it.
CA_CERT_VARIABLE = "CORRAL_CA_CERT_PEM"
PROXY_VARIABLES = ("HTTP_PROXY", "HTTPS_PROXY", "http_proxy", "https_proxy")


class Egress(_Frozen):
    """Outbound network policy of a sandbox."""

    allow_network: bool = Field(
        default=False,
        description="False: no network at all; the runner reaches the control plane through "
        "a Unix socket mounted into the sandbox.",
    )
    allowed_hosts: tuple[str, ...] = Field(
        default=(),
        description="with allow_network: the only destinations (corral.providers.egress.rules); "
        "only providers whose matrix says enforces_allowed_hosts get such specs",
    )
    http_proxy: str | None = None
    https_proxy: str | None = None
    no_proxy: tuple[str, ...] = ()
    ca_cert_pem: SecretStr | None = None
    secret_bindings: dict[str, SecretBinding] = Field(default_factory=dict)

    @property
    def restricted(self) -> bool:
        """Network, but only to the listed hosts (through corral's proxy where it runs one)."""
        return self.allow_network and bool(self.allowed_hosts)

    def proxy_env(self, http_proxy: str | None, https_proxy: str | None) -> dict[str, str]:
        """HTTP(S)_PROXY and NO_PROXY, upper and lower case, for the given proxies."""
        env: dict[str, str] = {}
        for name, value in (("HTTP_PROXY", http_proxy), ("HTTPS_PROXY", https_proxy)):
            if value:
                env[name] = env[name.lower()] = value
        if self.no_proxy:
            env["NO_PROXY"] = env["no_proxy"] = ",".join(self.no_proxy)
        return env

    def sandbox_env(self) -> dict[str, str]:
        """What the egress puts in the sandbox's environment: the proxies asked for, the CA
        bundle (for the runner to write), and each secret binding's placeholder."""
        env = self.proxy_env(self.http_proxy, self.https_proxy)
        if self.ca_cert_pem is not None:
            env[CA_CERT_VARIABLE] = self.ca_cert_pem.get_secret_value()
        for name, binding in self.secret_bindings.items():
            if not binding.checkout_requests:
                env[name] = SecretBinding.placeholder_for(name)
        return env

    @property
    def proxied(self) -> bool:
        """Whether only corral's egress proxy may be the way out, where a provider runs it:
        allowed hosts to enforce, or bindings to put in."""
        return self.restricted or (self.allow_network and bool(self.secret_bindings))


class SandboxSpec(_Frozen):
    """Everything a provider needs to start one sandbox for one work item."""

    work_item_id: str
    sandbox_id: str
    org_id: str
    project_id: str
    registration_token: SecretStr
    control_url: str
    env: dict[str, str] = Field(default_factory=dict)
    # The work's own image (a dispatch's `image`), for providers whose matrix says
    # supports_item_image; routing sends such items nowhere else.
    image: str | None = None
    resources: Resources = Field(default_factory=Resources)
    pool_id: str | None = None
    # The pool's sandbox_config: the provider's options model, checked when the pool was made.
    provider_options: dict[str, Any] = Field(default_factory=dict)
    toolchain: ToolchainDemand = Field(default_factory=ToolchainDemand)
    egress: Egress = Field(default_factory=Egress)
    labels: dict[str, str] = Field(default_factory=dict, description="attribution labels")

    @field_validator("sandbox_id", "work_item_id", "org_id")
    @classmethod
    def _label_safe(cls, value: str) -> str:
        # These ids become labels, file names and Kubernetes names.
        if (
            not value
            or len(value) > 63
            or not value[0].isalnum()
            or not all(c.isalnum() or c in "-_." for c in value)
        ):
            raise ValueError(
                "must be 1-63 characters of letters, digits, '-', '_' or '.', "
                "starting with a letter or digit"
            )
        return value

    def sandbox_env(self) -> dict[str, str]:
        """The environment the sandbox's entrypoint receives, and nothing else.

        The toolchain env, the spec's env, the egress's (proxies, CA bundle, secret
        bindings' placeholders), then corral's own variables, which win.
        """
        env = {**self.toolchain.env, **self.env, **self.egress.sandbox_env()}
        env["CORRAL_CONTROL_URL"] = self.control_url
        env["CORRAL_REGISTRATION_TOKEN"] = self.registration_token.get_secret_value()
        env["CORRAL_SANDBOX_ID"] = self.sandbox_id
        return env

    def work_env(self) -> dict[str, str]:
        """The work's own environment (the toolchain env, then the spec's env), without
        corral's control variables: what a code interpreter gives the code. (Routing sends a
        code interpreter no item with egress settings: no runner would apply them.)"""
        return {**self.toolchain.env, **self.env}

    def managed_labels(self) -> dict[str, str]:
        """Labels that mark a sandbox as corral's and attribute it."""
        labels = dict(self.labels)
        labels.update(
            {
                "corral.managed": "true",
                "corral.sandbox-id": self.sandbox_id,
                "corral.org-id": self.org_id,
                "corral.work-item-id": self.work_item_id,
            }
        )
        if self.pool_id:
            labels["corral.pool-id"] = self.pool_id
        return labels


class SandboxHandle(_Frozen):
    """How to find a sandbox again: the provider, its own id, and metadata."""

    provider_id: str
    external_id: str
    metadata: dict[str, Any] = Field(default_factory=dict)

    @field_validator("metadata")
    @classmethod
    def _carries_org(cls, value: dict[str, Any]) -> dict[str, Any]:
        if not value.get("org_id"):
            raise ValueError("metadata must carry org_id (credentials are resolved by it)")
        return value

    @property
    def org_id(self) -> str:
        return str(self.metadata["org_id"])


class SandboxState(enum.StrEnum):
    PROVISIONING = "provisioning"
    READY = "ready"
    RUNNING = "running"
    TERMINATED = "terminated"
    FAILED = "failed"

    @property
    def is_final(self) -> bool:
        return self in (SandboxState.TERMINATED, SandboxState.FAILED)


class SandboxStatus(_Frozen):
    """A sandbox's state, with the reason and exit code when it has ended."""

    state: SandboxState
    reason: str | None = None
    exit_code: int | None = None


def exit_status(
    exit_code: int | None, *, out_of_memory: bool = False, detail: str | None = None
) -> SandboxStatus:
    """The status of a sandbox whose entrypoint ended: 0 is a clean end, anything else a
    failure, with its cause in words (out of memory, the signal that killed it, the code)."""
    if exit_code == 0 and not out_of_memory:
        return SandboxStatus(state=SandboxState.TERMINATED, reason="exited", exit_code=0)
    if out_of_memory:
        reason = "killed: out of memory"
    elif exit_code is not None and exit_code > 128:
        reason = f"killed by signal {exit_code - 128} (exit code {exit_code})"
    else:
        reason = f"exited with code {exit_code}"
    if detail:
        reason += f": {detail}"
    return SandboxStatus(state=SandboxState.FAILED, reason=reason, exit_code=exit_code)


# What a provider keeps of an exec's stdout, and of its stderr, and the largest file it
# copies out, when the caller names no limit (the session api's own defaults).
DEFAULT_EXEC_OUTPUT_MAX_BYTES = 1024 * 1024
DEFAULT_DOWNLOAD_MAX_BYTES = 16 * 1024 * 1024


class ExecResult(_Frozen):
    """What a one-shot command in a sandbox did. Non-zero exits are results, not errors.

    ``truncated``: stdout or stderr printed more than the call's ``max_output_bytes``, and
    only that much of it is here."""

    stdout: str
    stderr: str
    exit_code: int
    duration_s: float
    truncated: bool = False


class CodeRun(_Frozen):
    """What a code work item did at a code interpreter (:class:`SupportsCodeInterpreter`).

    ``result`` is the JSON value ``main(**arguments)`` returned (None without one);
    ``exit_code`` is 0 when ``main`` returned a result and non-zero otherwise, with ``error``
    saying why (``main`` raised, the code defines no ``main``, the value is not JSON);
    ``timed_out`` when the interpreter's hard timeout stopped it. ``stdout`` and ``stderr``
    are what the code printed, without corral's result line.
    """

    stdout: str
    stderr: str
    exit_code: int
    duration_s: float
    result: Any = None
    error: str | None = None
    timed_out: bool = False


class ProviderHealth(_Frozen):
    healthy: bool
    message: str


class Capacity(_Frozen):
    """Free room at the provider. ``limit`` is None when the provider sets none."""

    limit: int | None
    in_use: int

    @property
    def available(self) -> int | None:
        return None if self.limit is None else max(self.limit - self.in_use, 0)


class ManagedSandbox(_Frozen):
    """A sandbox the provider holds for corral, found by its labels."""

    handle: SandboxHandle
    sandbox_id: str
    labels: dict[str, str]
    started_at: datetime | None = None
    state: SandboxState | None = Field(
        default=None,
        description="where it is, when the listing tells (e.g. an exited container still "
        "present); None: ask status()",
    )


class SandboxUsage(_Frozen):
    """What a sandbox consumed, as far as its provider measures it."""

    cpu_seconds: float | None = Field(default=None, ge=0)


class SandboxProvider(ABC):
    """Starts and stops sandboxes. Subclasses set the ClassVars and the four methods.

    A provider instance is shared by the threads of one worker process; implementations
    keep per-sandbox state outside the instance (on the provider's side or on disk) so that
    a restarted worker can pick up where the last one left off.
    """

    id: ClassVar[str]
    display_name: ClassVar[str]
    config_model: ClassVar[type[ProviderConfig]] = ProviderConfig
    options_model: ClassVar[type[ProviderOptions]] = ProviderOptions
    # Whether a sandbox without network can be given the api's Unix socket (same host).
    # Providers that cannot restrict the network to the control plane themselves (e.g.
    # with a network policy) instead, and get ``http(s)://`` control URLs.
    mounts_api_socket: ClassVar[bool] = False
    # Whether a networked sandbox never has a network of its own either (corral's egress
    # proxy is its only way out), so that it too is given the api's Unix socket.
    egress_through_proxy: ClassVar[bool] = False
    # What a provider that is not built in can do (built-in ones are described in
    # corral.providers.descriptors). None: nothing optional, an empty substrate.
    default_capabilities: ClassVar[ProviderCapabilities | None] = None

    def __init__(self, config: ProviderConfig | Mapping[str, Any] | None = None) -> None:
        self.config = parse_model(
            self.config_model, config, what=f"configuration for provider {self.id}"
        )
        # Where org credentials are looked up; the runtime hands in one backed by the
        # database. None: the environment fallback alone.
        self.credentials: CredentialResolver | None = None
        # Where a provider that keeps files on this host keeps them; the runtime hands in
        # the deployment's CORRAL_STATE_DIR.
        self.state_dir = default_state_dir()
        # What the deployment opened to corral's egress proxy (CORRAL_EGRESS_OPEN_NETWORKS):
        # every other loopback, private or link-local address stays closed to sandboxes.
        self.egress_open_networks: tuple[str, ...] = ()
        # The CA bundle corral's egress proxy also trusts where it terminates a bound host's
        # TLS (CORRAL_EGRESS_UPSTREAM_CA_FILE), beside the system's store.
        self.egress_upstream_ca_file: Path | None = None

    def use_egress_openings(self, networks: tuple[str, ...]) -> None:
        """Let corral's egress proxy reach ``networks`` (host rules) although closed by
        default; the deployment's setting, handed in by the runtime."""
        self.egress_open_networks = tuple(networks)

    def use_egress_upstream_ca(self, path: Path | None) -> None:
        """Have corral's egress proxy trust the CA bundle at ``path`` too, when it checks a
        bound host's certificate; the deployment's setting, handed in by the runtime."""
        self.egress_upstream_ca_file = path

    def use_state_dir(self, state_dir: Path) -> None:
        """Keep this host's files (if any) under ``state_dir``. Called before first use."""
        self.state_dir = state_dir

    def use_credentials(self, resolver: CredentialResolver) -> None:
        """Resolve org credentials through ``resolver`` (stored ones, then the environment)."""
        self.credentials = resolver

    @property
    def capabilities(self) -> ProviderCapabilities:
        """What this provider can do: its class defaults, with the configured
        ``max_concurrent`` when its config has one."""
        defaults = declared_capabilities(type(self))
        if "max_concurrent" not in type(self.config).model_fields:
            return defaults
        limit = getattr(self.config, "max_concurrent", None)
        return defaults.model_copy(update={"max_concurrent": limit})

    def parse_options(self, spec: SandboxSpec) -> ProviderOptions:
        """Validate ``spec.provider_options``; call before allocating anything.

        Raises:
            InvalidProviderConfigError: naming each unknown or invalid option.
        """
        return parse_model(
            self.options_model, spec.provider_options, what=f"options for provider {self.id}"
        )

    def _handle(self, spec: SandboxSpec, external_id: str) -> SandboxHandle:
        metadata = {"org_id": spec.org_id, "sandbox_id": spec.sandbox_id}
        return SandboxHandle(provider_id=self.id, external_id=external_id, metadata=metadata)

    @abstractmethod
    def provision(self, spec: SandboxSpec) -> SandboxHandle:
        """Allocate and start a sandbox whose entrypoint gets ``spec.sandbox_env()``.

        Raises:
            InvalidProviderConfigError: bad provider options (nothing was allocated).
            CapacityExhaustedError: no free capacity; retry later.
            CredentialMissingError: the org has no credential for this provider.
            SandboxCreateError: the provider refused to create it.
            ProviderUnavailableError: the provider could not be reached.
        """

    @abstractmethod
    def status(self, handle: SandboxHandle) -> SandboxStatus:
        """Where the sandbox is now. A sandbox the provider no longer knows is terminated.

        Raises:
            ProviderUnavailableError: the provider could not be reached.
        """

    @abstractmethod
    def terminate(self, handle: SandboxHandle) -> None:
        """Stop the sandbox and release what it holds. Idempotent: safe in cleanup paths.

        Raises:
            ProviderUnavailableError: the provider could not be reached (nothing changed).
        """

    @abstractmethod
    def health_check(self, org_id: str | None = None) -> ProviderHealth:
        """Whether the provider can provision right now, with a human-readable message.

        A provider that calls an API makes one authenticated, read-only call: with
        ``org_id``, with that org's credential (stored, else the environment's); without,
        with the deployment's. No credential at all is unhealthy, never healthy. Providers
        without credentials ignore ``org_id``."""


@runtime_checkable
class SupportsLogs(Protocol):
    def stream_logs(self, handle: SandboxHandle, *, follow: bool = False) -> Iterator[str]:
        """Yield the sandbox's output lines; with ``follow``, until the sandbox ends."""
        ...


@runtime_checkable
class SupportsExec(Protocol):
    def exec_command(
        self,
        handle: SandboxHandle,
        command: str | Sequence[str],
        *,
        env: Mapping[str, str] | None = None,
        cwd: str | None = None,
        timeout_s: float | None = None,
        max_output_bytes: int = DEFAULT_EXEC_OUTPUT_MAX_BYTES,
    ) -> ExecResult:
        """Run one command in the sandbox. A string runs through ``/bin/sh -c``.

        Of stdout, and of stderr, at most ``max_output_bytes`` are kept while the command
        runs (UTF-8, never cut inside a character); what it prints past that is read and
        dropped, the command runs on to its end (or its timeout), and the result says
        ``truncated``. A provider never holds more of a command's output than that.

        Raises:
            SandboxNotRunningError: the sandbox has ended.
            ProviderTimeoutError: the command outlived ``timeout_s`` (it was killed).
        """
        ...


@runtime_checkable
class SupportsFiles(Protocol):
    def upload_file(self, handle: SandboxHandle, source: Path, target: str) -> None:
        """Copy a local file into the sandbox; relative targets are under the work dir."""
        ...

    def download_file(
        self,
        handle: SandboxHandle,
        source: str,
        target: Path,
        *,
        max_bytes: int = DEFAULT_DOWNLOAD_MAX_BYTES,
    ) -> None:
        """Copy a file out of the sandbox to a local path, if it is at most ``max_bytes``.

        A provider refuses a larger file before copying where the sandbox tells its size,
        and stops copying at ``max_bytes + 1`` bytes in any case (a file that grows, or a
        size that lies): ``target`` then holds at most that much, for the caller to remove.

        Raises:
            FileTooLargeError: the file is larger than ``max_bytes``.
            SandboxPathError: ``source`` is outside the sandbox's work directory, or no
                regular file.
            FileNotFoundError: there is no such file (providers that can tell).
        """
        ...


@runtime_checkable
class SupportsPauseResume(Protocol):
    def pause(self, handle: SandboxHandle) -> None: ...

    def resume(self, handle: SandboxHandle) -> None: ...


@runtime_checkable
class SupportsInventory(Protocol):
    def list_managed(self) -> list[ManagedSandbox]:
        """The sandboxes this deployment holds, found by corral's labels: the live ones and
        those that ended but are still present (with their ``state``, where known)."""
        ...


@runtime_checkable
class SupportsUsage(Protocol):
    def usage(self, handle: SandboxHandle) -> SandboxUsage:
        """What the sandbox has consumed so far; asked just before it is terminated, for
        active-cpu billing. Fields the provider cannot measure are None."""
        ...


# What corral asks of a sandbox's own log when it ends before its runner reported: the
# last lines, and at most this many bytes of them (corral.shared.end_logs keeps less).
END_LOG_MAX_LINES = 40
END_LOG_MAX_BYTES = 16 * 1024


@runtime_checkable
class SupportsEndLog(Protocol):
    def end_log(self, handle: SandboxHandle, *, max_lines: int, max_bytes: int) -> str | None:
        """The end of the provider's own log of the sandbox (its entrypoint's stdout and
        stderr, bubblewrap's or the container's, the pod's): at most its last ``max_lines``
        lines and, of those, at most the last ``max_bytes`` bytes, as text; None when the
        provider no longer has it. Raw: corral cleans, redacts and bounds it again.

        Asked when a sandbox ends before its runner reported, just before it is
        terminated, from a thread the caller stops waiting on after a short time: it never
        reads more than a bounded amount, whatever the sandbox printed.

        Raises:
            ProviderUnavailableError: the provider could not be reached.
        """
        ...


@runtime_checkable
class SupportsCapacityQuery(Protocol):
    def capacity(self) -> Capacity: ...


@runtime_checkable
class SupportsCodeInterpreter(Protocol):
    """A provider that executes code itself through the vendor's execute-code API, with no
    runner: the provider worker hands it a ``code`` work item and records the outcome.
    Its matrix says ``work_kinds=("code",)``, so routing sends it nothing else."""

    def run_code(
        self,
        spec: SandboxSpec,
        code: str,
        arguments: Mapping[str, Any],
        *,
        timeout_s: float,
        on_execute: Callable[[SandboxHandle], None] | None = None,
    ) -> CodeRun:
        """Run ``code``'s ``main(**arguments)`` in a sandbox (or context) made for ``spec``,
        with ``spec.work_env()`` and at most ``timeout_s`` seconds (capped at the vendor's
        hard timeout), then end the sandbox, whatever happened.

        The code is wrapped as :func:`corral.runner.inline_code.program` does: the same
        semantics as the runner's code items. ``on_execute`` is called with the sandbox's
        handle just before the execute call is sent: the point after which the code may
        have run. If it raises, nothing is executed, the sandbox is ended and the
        exception propagates.

        Raises:
            TransientProviderError: the vendor failed before the execute call was sent.
            PermanentProviderError: a credential or configuration problem, before the
                execute call; or (:class:`~corral.providers.errors.ExecutionOutcomeUnknownError`)
                the execute call failed after it was sent, so the code may have run and
                must not run again.
        """
        ...
