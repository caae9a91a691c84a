"""The vercel provider: one Vercel Sandbox (a Firecracker microVM) per corral sandbox, through
the official ``vercel-sandbox`` SDK (its synchronous client, ``vercel.sandbox.sync``).

A sandbox is created *named after corral's sandbox id*, from the configured image or source
(a per-sandbox option may name others), with the spec's environment (the registration token
and control URL included) as the sandbox's ``env``, its vCPUs, a timeout capped at the
matrix's 18,000 s, ``persistent=false`` (a stopped sandbox keeps no snapshot) and up to five
tags (Vercel's limit): ``corral.managed``, ``corral.deployment``, ``corral.org-id``,
``corral.work-item-id`` and ``corral.pool-id``; the sandbox id is its name. Without network
its egress is limited to the control plane's host. corral's runner is then started detached
in it and dials out to the control URL.

``status`` reads the sandbox and, while it runs, its entry command (the session's first): a
runner that exited ends the sandbox's status with its exit code, though the microVM lives on
until it is terminated or its timeout stops it. ``terminate`` stops the session and destroys
the sandbox (not found counts as done). ``exec_command`` and the files go through the
running session itself, which never resumes a stopped sandbox. ``list_managed`` lists the
project's sandboxes by the ``corral.deployment`` tag (the API filters on one tag).

Credentials: the access token is the org's stored credential, else ``CORRAL_VERCEL_API_KEY``;
the team id and project id are deployment-wide configuration. The SDK sends the token as
``Authorization: Bearer`` and the team as ``?teamId=``; the project goes in each body or query.
The inventory, which has no org, uses ``CORRAL_VERCEL_API_KEY``. The API reports no CPU usage,
so active-cpu billing falls back to wall-clock (``cpu_estimated``)."""

from __future__ import annotations

import contextlib
import io
import logging
import math
import posixpath
import shlex
import ssl
import subprocess
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, TextIO, cast
from urllib.parse import urlsplit

import httpx2
from pydantic import SecretStr
from vercel.sandbox.sync import (
    GitSource,
    NetworkPolicy,
    NetworkPolicySubnets,
    SandboxApiError,
    SandboxCredentials,
    SandboxError,
    SandboxFilesystemWriteError,
    SandboxPathNotFoundError,
    SandboxQueryByCreatedAt,
    SandboxResources,
    SandboxResponseError,
    SandboxServiceOptions,
    SandboxStreamError,
    SandboxTerminalStateError,
    SnapshotSource,
    SyncSandbox,
    SyncSandboxClient,
    SyncSandboxRuntimeSession,
    TagFilter,
    TarballSource,
)
from vercel.sandbox.sync import SandboxTimeoutError as VercelTimeoutError

from corral.providers.base import (
    DEFAULT_DOWNLOAD_MAX_BYTES,
    DEFAULT_EXEC_OUTPUT_MAX_BYTES,
    ExecResult,
    ManagedSandbox,
    SandboxHandle,
    SandboxSpec,
    SandboxState,
    SandboxStatus,
    exit_status,
)
from corral.providers.configs.vercel import (
    MAX_SESSION_S,
    GitSourceConfig,
    SnapshotSourceConfig,
    SourceConfig,
    TarballSourceConfig,
    VercelProviderConfig,
    VercelProviderOptions,
)
from corral.providers.descriptors import BUILTIN
from corral.providers.egress.rules import vendor_allow_list
from corral.providers.errors import (
    InvalidProviderConfigError,
    ProviderTimeoutError,
    ProviderUnavailableError,
    SandboxCreateError,
    SandboxNotRunningError,
    SandboxPathError,
)
from corral.providers.size_limits import ExecOutput, OutputBuffer, copy_at_most, reads
from corral.providers.vendor import VendorProvider

__all__ = [
    "GitSourceConfig",
    "SnapshotSourceConfig",
    "SourceConfig",
    "TarballSourceConfig",
    "VercelProvider",
    "VercelProviderConfig",
    "VercelProviderOptions",
]

log = logging.getLogger(__name__)

PROVIDER_ID = "vercel"
DEPLOYMENT_TAG = "corral.deployment"
WORKDIR = "/vercel/sandbox"  # the sandbox's working directory, where files go
_PAGE = 50  # the SDK and the API page at most 50
_GONE = (404, 410)
_TLS_LOCK = threading.Lock()


class VercelProvider(VendorProvider):
    """Vercel Sandbox microVMs (dial-out runners, tag inventory, exec and files)."""

    id = PROVIDER_ID
    display_name = BUILTIN["vercel"].display_name
    vendor = "Vercel"
    api_name = "the Vercel Sandbox API"
    credential_noun = "access token"
    credential_hint = "; or check team_id and project_id in the vercel provider's configuration"
    config_model = VercelProviderConfig
    options_model = VercelProviderOptions
    config: VercelProviderConfig
    _tls: ssl.SSLContext | None = None  # built on first use, shared by the threads

    # -- contract ------------------------------------------------------------------------

    def provision(self, spec: SandboxSpec) -> SandboxHandle:
        options = self.parse_options(spec)
        assert isinstance(options, VercelProviderOptions)
        argv = options.command or shlex.split(self.config.runner_command)
        create = self._create_args(spec, options)
        making = self._sdk_errors("making a sandbox", spec.org_id, creating=True)
        with self._client(spec.org_id) as client, making:
            sandbox = self._find(client, spec.sandbox_id)
            if sandbox is None:
                sandbox = self._create(client, create)
            else:  # a second delivery of the same provision
                self._check_ours(sandbox)
            try:
                self._ensure_started(sandbox, argv)
            except Exception:
                _quietly(lambda: _end(sandbox))  # nothing half-made stays behind
                raise
        return self._handle(spec, spec.sandbox_id)

    def status(self, handle: SandboxHandle) -> SandboxStatus:
        with (
            self._client(handle.org_id) as client,
            self._sdk_errors("reading a sandbox", handle.org_id),
        ):
            sandbox = self._find(client, handle.external_id)
            if sandbox is None:
                return SandboxStatus(
                    state=SandboxState.TERMINATED, reason="sandbox no longer exists"
                )
            state = _vercel_status(sandbox)
            if state == "running":
                return self._entry_status(sandbox)
        return _STATUSES.get(state, SandboxStatus(state=SandboxState.RUNNING, reason=state))

    def terminate(self, handle: SandboxHandle) -> None:
        with (
            self._client(handle.org_id) as client,
            self._sdk_errors("ending a sandbox", handle.org_id),
        ):
            sandbox = self._find(client, handle.external_id)
            if sandbox is None:
                return
            _end(sandbox)

    def _probe(self, key: SecretStr, org_id: str | None) -> None:
        with self._client_with(key) as client, self._sdk_errors("listing sandboxes", org_id):
            next(iter(client.query_sandboxes(page_size=1)), None)

    # -- optional abilities ---------------------------------------------------------------

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
        argv = ["/bin/sh", "-c", command] if isinstance(command, str) else list(command)
        output = ExecOutput(max_output_bytes)
        started = time.monotonic()
        with (
            self._client(handle.org_id) as client,
            self._sdk_errors("running a command", handle.org_id),
        ):
            session = self._running_session(client, handle)
            # Each log record goes to its bounded buffer as it streams in (capture_output
            # would keep all of them).
            result = session.run_process(
                argv[0],
                argv[1:],
                cwd=cwd,
                env=dict(env or {}),
                kill_after=timeout_s,
                stdout=cast(TextIO, _Sink(output.stdout)),
                stderr=cast(TextIO, _Sink(output.stderr)),
            )
        duration = time.monotonic() - started
        if timeout_s is not None and result.returncode != 0 and duration >= timeout_s:
            raise ProviderTimeoutError(
                f"the command outlived its {timeout_s:g} s in sandbox {handle.external_id} "
                "and was killed"
            )
        return output.result(exit_code=result.returncode, duration_s=duration)

    def upload_file(self, handle: SandboxHandle, source: Path, target: str) -> None:
        destination = confine(target)
        data = source.read_bytes()
        with (
            self._client(handle.org_id) as client,
            self._sdk_errors("writing a file", handle.org_id),
        ):
            self._running_session(client, handle).fs.write_bytes(destination, data)

    def download_file(
        self,
        handle: SandboxHandle,
        source: str,
        target: Path,
        *,
        max_bytes: int = DEFAULT_DOWNLOAD_MAX_BYTES,
    ) -> None:
        origin = confine(source)
        with (
            self._client(handle.org_id) as client,
            self._sdk_errors("reading a file", handle.org_id),
        ):
            session = self._running_session(client, handle)
            try:
                # The SDK tells no size: the copy is read in chunks and stops one byte past
                # the limit (read_bytes would hold the whole file).
                with session.fs.open(origin, "rb") as reader:
                    copy_at_most(reads(reader.read), target, max_bytes, source)
            except SandboxPathNotFoundError as exc:
                raise SandboxPathError(f"{source!r} does not exist in the sandbox") from exc

    def list_managed(self) -> list[ManagedSandbox]:
        key = self._inventory_key()
        query = SandboxQueryByCreatedAt(tag=TagFilter(key=DEPLOYMENT_TAG, value=self.deployment))
        with self._client_with(key) as client, self._sdk_errors("listing sandboxes", None):
            listed = list(client.query_sandboxes(query=query, page_size=_PAGE))
        return [
            self._managed(sandbox)
            for sandbox in listed
            if (sandbox.tags or {}).get("corral.managed") == "true"
        ]

    # -- internals -----------------------------------------------------------------------

    @property
    def deployment(self) -> str:
        return self.config.deployment

    def _config_problem(self) -> str | None:
        absent = [k for k in ("team_id", "project_id") if not getattr(self.config, k)]
        if not absent:
            return None
        return (
            f"the vercel provider needs {' and '.join(absent)} in its configuration "
            '(CORRAL_PROVIDER_CONFIG, e.g. {"vercel": {"team_id": "team_...", '
            '"project_id": "prj_..."}})'
        )

    def _sdk_credentials(self, key: SecretStr) -> SandboxCredentials:
        missing = self._config_problem()
        if missing:
            raise InvalidProviderConfigError(missing)
        assert self.config.team_id and self.config.project_id
        return SandboxCredentials(
            token=key.get_secret_value(),
            team_id=self.config.team_id,
            project_id=self.config.project_id,
        )

    def _tls_context(self) -> ssl.SSLContext:
        """One TLS context for every call's client: building one reads the CA bundle, which
        costs more than a call to the API."""
        with _TLS_LOCK:
            if self._tls is None:
                self._tls = httpx2.create_ssl_context()
            return self._tls

    def _client(self, org_id: str) -> contextlib.AbstractContextManager[SyncSandboxClient]:
        """A client of the SDK for one call, with the org's token.

        Raises:
            InvalidProviderConfigError: team_id or project_id is not configured.
            CredentialMissingError: the org has no token, nor the environment.
        """
        missing = self._config_problem()
        if missing:
            raise InvalidProviderConfigError(missing)
        return self._client_with(self._api_key(org_id))

    @contextlib.contextmanager
    def _client_with(self, key: SecretStr) -> Iterator[SyncSandboxClient]:
        """A client of the SDK for one call, with the token ``key``."""
        credentials = self._sdk_credentials(key)
        options = SandboxServiceOptions(
            base_url=self.config.api_url,
            credentials_factory=lambda: credentials,
            region=self.config.region,
        )
        timeout, tls = self.config.request_timeout_s, self._tls_context()
        client = SyncSandboxClient.create(
            options=options,
            httpx_client_factory=lambda: httpx2.Client(timeout=timeout, verify=tls),
        )
        try:
            yield client
        finally:
            client.close()

    def _create_args(self, spec: SandboxSpec, options: VercelProviderOptions) -> dict[str, Any]:
        source = options.source or self.config.source
        cpu, memory_mb = spec.resources.cpu, spec.resources.memory_mb
        vcpus = self.config.vcpus
        if cpu is not None or memory_mb is not None:
            # Vercel sizes a sandbox by vCPUs alone, each with 2048 MB of memory.
            vcpus = max(math.ceil(cpu or 0), math.ceil((memory_mb or 0) / MEMORY_PER_VCPU_MB))
        args: dict[str, Any] = {
            "name": spec.sandbox_id,
            "image": options.image or self.config.image,
            "source": None if source is None else _sdk_source(source),
            "execution_time_limit": min(
                spec.resources.timeout_s or self.config.default_timeout_s, MAX_SESSION_S
            ),
            "resources": None if vcpus is None else SandboxResources(vcpus=vcpus),
            "persistent": False,
            "env": spec.sandbox_env(),
            "tags": _tags(spec, self.deployment),
            "region": self.config.region,
        }
        if not spec.egress.allow_network or spec.egress.restricted:
            args["network_policy"] = _control_plane_only(
                spec.control_url, spec.egress.allowed_hosts
            )
        return args

    def _create(self, client: SyncSandboxClient, args: dict[str, Any]) -> SyncSandbox:
        try:
            return client.create_sandbox(**args)
        except SandboxApiError as exc:
            if exc.status_code != 409:
                raise
        found = self._find(client, args["name"])  # made by a delivery running alongside
        if found is None:
            raise SandboxCreateError(f"Vercel refused sandbox name {args['name']!r} (409)")
        return found

    def _check_ours(self, sandbox: SyncSandbox) -> None:
        if (sandbox.tags or {}).get(DEPLOYMENT_TAG) != self.deployment:
            raise SandboxCreateError(
                f"a Vercel sandbox named {sandbox.name!r} exists and is not this deployment's "
                f"(tag {DEPLOYMENT_TAG} is not {self.deployment!r}); remove it or change "
                "the deployment name"
            )

    def _ensure_started(self, sandbox: SyncSandbox, argv: list[str]) -> None:
        """Start ``argv`` detached, unless the sandbox's session already runs a command."""
        session = sandbox.current_session
        if _vercel_status(sandbox) != "running" or session is None:
            return  # pending sandboxes are waited for by create; ended ones say so in status
        if session.query_processes():
            return
        session.create_process(
            argv[0], argv[1:], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )

    def _entry_status(self, sandbox: SyncSandbox) -> SandboxStatus:
        """A running sandbox's status by its entry command (the session's first)."""
        session = sandbox.current_session
        processes = [] if session is None else session.query_processes()
        if not processes:
            return SandboxStatus(state=SandboxState.READY, reason="no command started yet")
        entry = min(processes, key=lambda p: p.started_at)
        if entry.returncode is None:
            return SandboxStatus(state=SandboxState.RUNNING)
        return exit_status(entry.returncode)

    def _running_session(
        self, client: SyncSandboxClient, handle: SandboxHandle
    ) -> SyncSandboxRuntimeSession:
        sandbox = self._find(client, handle.external_id)
        session = None if sandbox is None else sandbox.current_session
        if sandbox is None or session is None or _vercel_status(sandbox) != "running":
            raise SandboxNotRunningError(f"sandbox {handle.external_id} is not running")
        return session

    @staticmethod
    def _find(client: SyncSandboxClient, name: str) -> SyncSandbox | None:
        try:
            return client.get_sandbox(name=name)
        except SandboxApiError as exc:
            if exc.status_code in _GONE:
                return None
            raise

    def _managed(self, sandbox: SyncSandbox) -> ManagedSandbox:
        tags = dict(sandbox.tags or {})
        labels = {**tags, "corral.sandbox-id": sandbox.name}
        handle = SandboxHandle(
            provider_id=self.id,
            external_id=sandbox.name,
            metadata={"org_id": tags.get("corral.org-id") or "unknown", "sandbox_id": sandbox.name},
        )
        created = sandbox.created_at
        return ManagedSandbox(
            handle=handle,
            sandbox_id=sandbox.name,
            labels=labels,
            started_at=None if created is None else datetime.fromtimestamp(created / 1000, UTC),
            state=_LISTED_STATES.get(str(sandbox.status)),
        )

    @contextlib.contextmanager
    def _sdk_errors(
        self, action: str, org_id: str | None, *, creating: bool = False
    ) -> Iterator[None]:
        """The SDK's exceptions as corral's provider errors, with what to do about them."""
        try:
            yield
        except SandboxApiError as exc:
            raise self.status_error(
                exc.status_code, action, org_id, str(exc), creating=creating
            ) from exc
        except SandboxFilesystemWriteError as exc:
            cause = exc.cause
            if isinstance(cause, SandboxApiError):
                raise self.status_error(
                    cause.status_code, action, org_id, str(cause), creating=creating
                ) from exc
            raise SandboxPathError(f"Vercel could not write the file while {action}") from exc
        except (SandboxError, httpx2.TransportError) as exc:
            raise _sdk_error(exc, action) from exc


# Vercel's sandbox statuses but running (which asks the entry command) as corral's.
_STATUSES = {
    "pending": SandboxStatus(state=SandboxState.PROVISIONING, reason="pending"),
    "snapshotting": SandboxStatus(state=SandboxState.RUNNING, reason="snapshotting"),
    "stopping": SandboxStatus(state=SandboxState.TERMINATED, reason="stopping"),
    "stopped": SandboxStatus(state=SandboxState.TERMINATED, reason="stopped"),
    "failed": SandboxStatus(state=SandboxState.FAILED, reason="the sandbox failed"),
    "aborted": SandboxStatus(state=SandboxState.FAILED, reason="the sandbox was aborted"),
}
# What a listing tells without asking each sandbox's commands: ended ones only.
_LISTED_STATES = {
    "stopped": SandboxState.TERMINATED,
    "failed": SandboxState.FAILED,
    "aborted": SandboxState.FAILED,
}


class _Sink(io.TextIOBase):
    """A text stream ``run_process`` writes a command's output to, record by record, that
    keeps what fits in ``buffer``."""

    def __init__(self, buffer: OutputBuffer) -> None:
        super().__init__()
        self._buffer = buffer

    def writable(self) -> bool:
        return True

    def write(self, text: str) -> int:
        self._buffer.add(text)
        return len(text)


def _vercel_status(sandbox: SyncSandbox) -> str:
    """The sandbox's status, its current session's first (as the SDK reads it)."""
    session = sandbox.current_session
    status = session.status if session is not None and session.status else sandbox.status
    return str(status) if status is not None else "unknown"


MEMORY_PER_VCPU_MB = 2048


def _tags(spec: SandboxSpec, deployment: str) -> dict[str, str]:
    """Vercel allows five tags: corral's marks and attribution, the sandbox id being the
    sandbox's name. The spec's other labels (its project) are not carried."""
    labels = spec.managed_labels()
    tags = {"corral.managed": "true", DEPLOYMENT_TAG: deployment}
    for key in ("corral.org-id", "corral.work-item-id", "corral.pool-id"):
        if key in labels:
            tags[key] = labels[key]
    return tags


def _sdk_source(source: GitSourceConfig | TarballSourceConfig | SnapshotSourceConfig) -> Any:
    if isinstance(source, GitSourceConfig):
        password = source.password.get_secret_value() if source.password else None
        return GitSource(
            url=source.url,
            revision=source.revision,
            depth=source.depth,
            username=source.username,
            password=password,
        )
    if isinstance(source, TarballSourceConfig):
        return TarballSource(url=source.url)
    return SnapshotSource(snapshot_id=source.snapshot_id)


def _control_plane_only(control_url: str, allowed_hosts: tuple[str, ...]) -> NetworkPolicy:
    """Egress for a sandbox without network or with allowed hosts: the control plane's host,
    which the runner must reach, the allowed host names and networks (Vercel has no ports),
    and nothing else.

    Raises:
        InvalidProviderConfigError: no http(s) control URL, or an allowed host with a port.
    """
    host = urlsplit(control_url).hostname
    if not host or not control_url.startswith(("http://", "https://")):
        raise InvalidProviderConfigError(
            "a sandbox without network on Vercel needs an http(s) CORRAL_CONTROL_URL that "
            "Vercel can reach (the runner dials out to it)"
        )
    names, networks = vendor_allow_list(allowed_hosts, "Vercel")
    subnets = NetworkPolicySubnets(allow=networks) if networks else None
    return NetworkPolicy.custom(allow={name: () for name in (host, *names)}, subnets=subnets)


def confine(path: str) -> str:
    """``path`` inside the sandbox's work directory, or SandboxPathError."""
    joined = posixpath.normpath(posixpath.join(WORKDIR, path))
    if not path or path.startswith("/") or not joined.startswith(WORKDIR + "/"):
        raise SandboxPathError(
            f"path {path!r} is outside the sandbox work directory; use a path relative to it"
        )
    return joined


def _end(sandbox: SyncSandbox) -> None:
    """Stop the sandbox's session if it may run, then destroy the sandbox and its snapshots
    (as the SDK's own cleanup does)."""
    if _vercel_status(sandbox) in ("pending", "running", "snapshotting"):
        _ignoring_gone(sandbox.stop)
    _ignoring_gone(lambda: sandbox.destroy(delete_orphan_snapshots=True))


def _ignoring_gone(call: Any) -> None:
    """Run an end-of-life call; a sandbox or session already gone or stopped is done."""
    try:
        call()
    except SandboxApiError as exc:
        if exc.status_code not in (*_GONE, 409, 422):
            raise


def _quietly(call: Any) -> None:
    try:
        call()
    except Exception:  # a cleanup path: the reaper's inventory sweep catches what is left
        log.warning("cleanup of a half-made Vercel sandbox failed", exc_info=True)


def _sdk_error(exc: Exception, action: str) -> Exception:
    """corral's error for an SDK failure that carries no HTTP status."""
    if isinstance(exc, SandboxStreamError):
        if exc.code == "sandbox_stream_closed":
            return ProviderUnavailableError(f"Vercel lost the sandbox while {action}")
        return SandboxNotRunningError(f"the sandbox ended while {action} ({exc.code})")
    for kind, error, what in _STATUSLESS:
        if isinstance(exc, kind):
            return error(f"Vercel {what} while {action}: {exc}")
    return SandboxCreateError(f"Vercel failed while {action}: {exc}")


# The SDK's failures without a status, in the order they are told apart.
_STATUSLESS: tuple[tuple[type[Exception], type[Exception], str], ...] = (
    (SandboxTerminalStateError, SandboxCreateError, "ended the sandbox"),
    (VercelTimeoutError, ProviderTimeoutError, "timed out"),
    (httpx2.TimeoutException, ProviderTimeoutError, "did not answer in time"),
    (SandboxResponseError, ProviderUnavailableError, "answered oddly"),
    (httpx2.TransportError, ProviderUnavailableError, "could not be reached"),
)
