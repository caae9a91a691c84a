"""The daytona provider: one Daytona sandbox per corral sandbox, through the official ``daytona``
SDK.

A sandbox is made from a snapshot (default ``corral-runner``, which must contain corral's
runner) or an image, named after corral's sandbox id, with the spec's environment (the
registration token and control URL included) in its env vars, corral's labels and
``corral.deployment`` as its labels, and its auto-stop interval set from the work's timeout
(auto-delete follows a stop, at once by default). Image-based sandboxes get the spec's CPU and
memory (rounded up to whole cores and GiB) and the configured disk. Without network
(``allow_network=false``) its egress is limited to the control plane's address. Then the runner
starts detached, as the only command of the toolbox session ``corral-runner``, and dials out to
the control URL.

Status reads the sandbox's state, and for a started one the runner command's exit code, so a
runner that ended reads as ended; terminate deletes (gone counts as done); exec runs each
command in a session of its own (stdout and stderr apart); files go through the toolbox's file
API; logs are the runner command's output; ``list_managed`` lists by labels. Daytona's stop and
archive are not offered as pause: a stopped sandbox loses its processes.

The API key is the org's stored credential, else ``CORRAL_DAYTONA_API_KEY``
(:func:`corral.providers.credentials.resolve_credential`); the inventory, which has no org, uses
``CORRAL_DAYTONA_API_KEY``. One SDK client is kept per key.
"""

from __future__ import annotations

import contextlib
import hashlib
import ipaddress
import logging
import math
import posixpath
import shlex
import threading
import time
import uuid
from collections.abc import Callable, Generator, Iterator, Mapping, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, TypeVar, cast
from urllib.parse import urlsplit

import urllib3.exceptions
from daytona import (
    CreateSandboxFromImageParams,
    CreateSandboxFromSnapshotParams,
    Daytona,
    DaytonaAuthenticationError,
    DaytonaConfig,
    DaytonaConnectionError,
    DaytonaError,
    DaytonaForbiddenError,
    DaytonaNotFoundError,
    DaytonaRateLimitError,
    DaytonaTimeoutError,
    ListSandboxesQuery,
    Resources,
    Sandbox,
    SessionExecuteRequest,
)
from pydantic import SecretStr

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
from corral.providers.configs.daytona import DaytonaProviderConfig, DaytonaProviderOptions
from corral.providers.daytona.logs import follow_command_logs
from corral.providers.descriptors import BUILTIN
from corral.providers.errors import (
    InvalidProviderConfigError,
    ProviderError,
    ProviderTimeoutError,
    ProviderUnavailableError,
    SandboxCreateError,
    SandboxNotRunningError,
    SandboxPathError,
    TransientProviderError,
)
from corral.providers.size_limits import ExecOutput, copy_at_most, log_tail, refuse_larger
from corral.providers.vendor import VendorProvider

__all__ = ["DaytonaProvider", "DaytonaProviderConfig", "DaytonaProviderOptions"]

log = logging.getLogger(__name__)

PROVIDER_ID = "daytona"
DEPLOYMENT_LABEL = "corral.deployment"
RUNNER_SESSION = "corral-runner"
_PAGE = 100
_GRACE_S = 5.0  # how long past the SDK's own timeout a call may take before it is given up
_LOG_POLL_S = 0.5
_KILLED = (124, 137)  # timeout(1): TERM and KILL
_EXIT_POLL_S = 0.05  # how often an ended command's exit code is asked for

# Daytona's sandbox states, as corral's.
_GONE = frozenset({"destroyed", "destroying"})
_ENDED = frozenset({"stopped", "stopping", "archived", "archiving"})
_FAILED = frozenset({"error", "build_failed"})
_PAUSED = frozenset({"paused", "pausing"})
_LIVE = frozenset({"started", "resizing", "snapshotting", "forking"})

T = TypeVar("T")


class DaytonaProvider(VendorProvider):
    """Daytona sandboxes (dial-out runners, toolbox exec and files, label inventory)."""

    id = PROVIDER_ID
    display_name = BUILTIN["daytona"].display_name
    vendor = "Daytona"
    api_name = "the Daytona API"
    config_model = DaytonaProviderConfig
    options_model = DaytonaProviderOptions
    config: DaytonaProviderConfig

    def __init__(self, config: DaytonaProviderConfig | Mapping[str, Any] | None = None) -> None:
        super().__init__(config)
        self._clients: dict[str, Daytona] = {}
        self._lock = threading.Lock()

    # -- contract ------------------------------------------------------------------------

    def provision(self, spec: SandboxSpec) -> SandboxHandle:
        options = self.parse_options(spec)
        assert isinstance(options, DaytonaProviderOptions)
        params = self._params(spec, options)  # every check before anything is made
        client = self._client(self._api_key(spec.org_id))
        existing = self._existing(client, spec)
        if existing is not None:  # a second delivery of the same provision
            return self._handle(spec, existing)
        source = _source(params)
        timeout = self.config.create_timeout_s
        with self._sdk_errors(f"creating a sandbox from {source}", spec.org_id, creating=True):
            sandbox = _in_own_thread(
                lambda: client.create(params, timeout=timeout), timeout, "creating a sandbox"
            )
        try:
            with self._sdk_errors("starting the runner", spec.org_id):
                self._start_runner(sandbox, shlex.join(options.command or self.config.command))
        except Exception:
            self._delete_quietly(sandbox)  # nothing half-made stays behind
            raise
        return self._handle(spec, sandbox.id)

    def status(self, handle: SandboxHandle) -> SandboxStatus:
        sandbox = self._get(self._client_for(handle), handle.external_id, handle.org_id)
        if sandbox is None:
            return SandboxStatus(state=SandboxState.TERMINATED, reason="sandbox no longer exists")
        state = _state(sandbox)
        if state == "started":
            return self._runner_status(sandbox, handle.org_id)
        return _status_of(state, sandbox.error_reason)

    def terminate(self, handle: SandboxHandle) -> None:
        sandbox = self._get(self._client_for(handle), handle.external_id, handle.org_id)
        if sandbox is None or _state(sandbox) in _GONE:
            return
        self._delete(sandbox, handle.org_id)

    def _probe(self, key: SecretStr, org_id: str | None) -> None:
        query = ListSandboxesQuery(limit=1)
        timeout = self.config.request_timeout_s
        with self._sdk_errors("listing sandboxes", org_id):
            next(iter(self._client(key).list(query, request_timeout=timeout)), None)

    def _api_description(self) -> str:
        return f"the Daytona API at {self.config.api_url}"

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
        sandbox = self._running(handle)
        line = command if isinstance(command, str) else shlex.join(command)
        session = f"corral-exec-{uuid.uuid4().hex[:12]}"
        request = SessionExecuteRequest(
            command=_shell_line(line, env, cwd, timeout_s), run_async=True
        )
        output = ExecOutput(max_output_bytes)
        started = time.monotonic()
        with self._sdk_errors("running a command", handle.org_id):
            sandbox.process.create_session(session, request_timeout=self.config.request_timeout_s)
            try:
                exit_code = self._follow(sandbox, session, request, output, timeout_s)
            finally:
                self._end_session(sandbox, session)
        if timeout_s and exit_code in _KILLED:
            raise ProviderTimeoutError(f"the command outlived its timeout of {timeout_s:g} s")
        return output.result(exit_code=exit_code, duration_s=time.monotonic() - started)

    def _follow(
        self,
        sandbox: Sandbox,
        session: str,
        request: SessionExecuteRequest,
        output: ExecOutput,
        timeout_s: float | None,
    ) -> int:
        """Start the command detached, follow its logs into ``output`` as they come (a
        command run to its end answers all of them at once), then read its exit code.

        Raises:
            ProviderTimeoutError: the logs outlived the command's timeout and a grace (a
                process it left behind holds its output open).
        """
        process = sandbox.process
        timeout = self.config.request_timeout_s
        command = process.execute_session_command(session, request, timeout=math.ceil(timeout))
        # timeout(1) ends the command, and so its logs; the grace covers a stream that hangs.
        deadline = None if timeout_s is None else time.monotonic() + timeout_s + timeout
        if not follow_command_logs(process, session, command.cmd_id, output, deadline):
            raise ProviderTimeoutError(f"the command's logs outlived its {timeout_s:g} s")
        deadline = time.monotonic() + timeout
        while True:  # the log ends as the command does; its exit code is recorded then
            code = process.get_session_command(session, command.cmd_id, timeout).exit_code
            if code is not None or time.monotonic() > deadline:
                return code if code is not None else -1
            time.sleep(_EXIT_POLL_S)

    def upload_file(self, handle: SandboxHandle, source: Path, target: str) -> None:
        destination = confine(target)
        sandbox = self._running(handle)
        with self._sdk_errors("uploading a file", handle.org_id):
            sandbox.fs.upload_file(str(source), destination, timeout=self._file_timeout())

    def download_file(
        self,
        handle: SandboxHandle,
        source: str,
        target: Path,
        *,
        max_bytes: int = DEFAULT_DOWNLOAD_MAX_BYTES,
    ) -> None:
        origin = confine(source)
        sandbox = self._running(handle)
        with self._sdk_errors("downloading a file", handle.org_id):
            try:
                info = sandbox.fs.get_file_info(
                    origin, request_timeout=self.config.request_timeout_s
                )
            except DaytonaNotFoundError as exc:
                raise SandboxPathError(f"{source!r} does not exist in the sandbox") from exc
            if info.is_dir:
                raise SandboxPathError(f"{source!r} is a directory, not a file")
            refuse_larger(source, info.size, max_bytes)
            # Streamed, and stopped one byte past the limit whatever the size said.
            chunks = cast(
                Generator[bytes, None, None],
                sandbox.fs.download_file_stream(origin, timeout=self._file_timeout()),
            )
            with contextlib.closing(chunks):
                copy_at_most(chunks, target, max_bytes, source)

    def stream_logs(self, handle: SandboxHandle, *, follow: bool = False) -> Iterator[str]:
        """The runner's output lines; with ``follow``, until the runner or the sandbox ends."""
        client = self._client_for(handle)
        seen, pending = 0, ""
        while True:
            ended, output = self._runner_output(client, handle)
            lines = (pending + output[seen:]).split("\n")
            seen, pending = max(seen, len(output)), lines.pop()
            yield from lines
            if ended or not follow:
                break
            time.sleep(_LOG_POLL_S)
        if pending:
            yield pending

    def end_log(self, handle: SandboxHandle, *, max_lines: int, max_bytes: int) -> str | None:
        """The end of the runner's output while the sandbox is started (the session command's
        log, which the SDK reads whole: Daytona keeps and bounds it); None once it is not."""
        _, output = self._runner_output(self._client_for(handle), handle)
        if not output:
            return None
        tail = output.encode(errors="replace")[-max_bytes:]
        return log_tail([tail], max_lines=max_lines, max_bytes=max_bytes)

    def list_managed(self) -> list[ManagedSandbox]:
        key = self._inventory_key()
        labels = {"corral.managed": "true", DEPLOYMENT_LABEL: self.config.deployment}
        query = ListSandboxesQuery(labels=labels, limit=_PAGE)
        timeout = self.config.request_timeout_s
        with self._sdk_errors("listing sandboxes", None):
            found = list(self._client(key).list(query, request_timeout=timeout))
        return [self._managed(sandbox) for sandbox in found if _state(sandbox) not in _GONE]

    # -- internals: making one ------------------------------------------------------------

    def _params(
        self, spec: SandboxSpec, options: DaytonaProviderOptions
    ) -> CreateSandboxFromSnapshotParams | CreateSandboxFromImageParams:
        """What the sandbox is made with. Raises InvalidProviderConfigError first."""
        timeout_s = spec.resources.timeout_s or self.config.default_timeout_s
        common: dict[str, Any] = {
            "name": spec.sandbox_id,
            "language": "python",
            "env_vars": spec.sandbox_env(),
            "labels": {**spec.managed_labels(), DEPLOYMENT_LABEL: self.config.deployment},
            "public": False,
            "auto_stop_interval": max(1, math.ceil(timeout_s / 60)),
            "auto_delete_interval": self.config.auto_delete_minutes,
            **_egress(spec),
        }
        image = options.image or (None if options.snapshot else spec.image or self.config.image)
        if image:
            resources = _resources(spec, options.disk_gb or self.config.disk_gb)
            return CreateSandboxFromImageParams(image=image, resources=resources, **common)
        snapshot = options.snapshot or self.config.snapshot
        return CreateSandboxFromSnapshotParams(snapshot=snapshot, **common)

    def _existing(self, client: Daytona, spec: SandboxSpec) -> str | None:
        """The id of the sandbox named after the spec's, if one is there and corral's."""
        sandbox = self._get(client, spec.sandbox_id, spec.org_id)
        if sandbox is None or _state(sandbox) in _GONE:
            return None
        labels = sandbox.labels or {}
        if labels.get("corral.sandbox-id") != spec.sandbox_id or (
            labels.get(DEPLOYMENT_LABEL) != self.config.deployment
        ):
            raise SandboxCreateError(
                f"a Daytona sandbox named {spec.sandbox_id!r} exists that this deployment did "
                "not make; delete it or use another deployment label"
            )
        return sandbox.id

    def _start_runner(self, sandbox: Sandbox, line: str) -> None:
        """The runner, detached: the one command of the session ``corral-runner``."""
        timeout = self.config.request_timeout_s
        sandbox.process.create_session(RUNNER_SESSION, request_timeout=timeout)
        sandbox.process.execute_session_command(
            RUNNER_SESSION,
            SessionExecuteRequest(command=line, run_async=True),
            timeout=math.ceil(timeout),
        )

    # -- internals: reading one -----------------------------------------------------------

    def _get(self, client: Daytona, id_or_name: str, org_id: str | None) -> Sandbox | None:
        """The sandbox by id or name; None when Daytona no longer has it."""
        with self._sdk_errors("reading a sandbox", org_id):
            try:
                return client.get(id_or_name, request_timeout=self.config.request_timeout_s)
            except DaytonaNotFoundError:
                return None

    def _running(self, handle: SandboxHandle) -> Sandbox:
        sandbox = self._get(self._client_for(handle), handle.external_id, handle.org_id)
        state = "gone" if sandbox is None else _state(sandbox)
        if sandbox is None or state != "started":
            raise SandboxNotRunningError(f"sandbox {handle.external_id} is not running ({state})")
        return sandbox

    def _runner_command(self, sandbox: Sandbox, org_id: str) -> Any | None:
        """The runner's command in its session; None when it has not been started."""
        timeout = self.config.request_timeout_s
        with self._sdk_errors("reading the runner's session", org_id):
            try:
                session = sandbox.process.get_session(RUNNER_SESSION, request_timeout=timeout)
            except DaytonaNotFoundError:
                return None
        return session.commands[0] if session.commands else None

    def _runner_status(self, sandbox: Sandbox, org_id: str) -> SandboxStatus:
        command = self._runner_command(sandbox, org_id)
        if command is None:
            return SandboxStatus(state=SandboxState.READY, reason="the runner has not started")
        if command.exit_code is None:
            return SandboxStatus(state=SandboxState.RUNNING)
        return exit_status(int(command.exit_code))

    def _runner_output(self, client: Daytona, handle: SandboxHandle) -> tuple[bool, str]:
        """Whether the runner (or its sandbox) has ended, and all it printed so far."""
        sandbox = self._get(client, handle.external_id, handle.org_id)
        if sandbox is None or _state(sandbox) != "started":
            return True, ""
        command = self._runner_command(sandbox, handle.org_id)
        if command is None:
            return False, ""
        timeout = self.config.request_timeout_s
        with self._sdk_errors("reading the runner's output", handle.org_id):
            logs = sandbox.process.get_session_command_logs(
                RUNNER_SESSION, command.id, request_timeout=timeout
            )
        return command.exit_code is not None, logs.output or ""

    def _managed(self, sandbox: Sandbox) -> ManagedSandbox:
        labels = {str(k): str(v) for k, v in (sandbox.labels or {}).items()}
        sandbox_id = labels.get("corral.sandbox-id", "")
        handle = SandboxHandle(
            provider_id=self.id,
            external_id=sandbox.id,
            metadata={"org_id": labels.get("corral.org-id", "unknown"), "sandbox_id": sandbox_id},
        )
        state = _state(sandbox)
        # A started sandbox's runner may have ended: only status() tells, so None.
        listed = None if state in _LIVE else _status_of(state, sandbox.error_reason).state
        return ManagedSandbox(
            handle=handle,
            sandbox_id=sandbox_id,
            labels=labels,
            started_at=_timestamp(sandbox.created_at),
            state=listed,
        )

    # -- internals: ending one ------------------------------------------------------------

    def _delete(self, sandbox: Sandbox, org_id: str | None) -> None:
        timeout = self.config.request_timeout_s
        with self._sdk_errors("deleting a sandbox", org_id):
            try:
                _in_own_thread(lambda: sandbox.delete(timeout), timeout, "deleting a sandbox")
            except DaytonaNotFoundError:
                return  # gone already: done

    def _delete_quietly(self, sandbox: Sandbox) -> None:
        try:
            self._delete(sandbox, None)
        except Exception:  # a cleanup path: the reaper's inventory catches what is left
            log.warning("could not delete a half-made sandbox", extra={"external_id": sandbox.id})

    def _end_session(self, sandbox: Sandbox, session: str) -> None:
        """Delete an exec's session, which kills what still runs in it."""
        with contextlib.suppress(DaytonaError):
            sandbox.process.delete_session(session, request_timeout=self.config.request_timeout_s)

    # -- internals: the SDK client ---------------------------------------------------------

    def _client_for(self, handle: SandboxHandle) -> Daytona:
        return self._client(self._api_key(handle.org_id))

    def _client(self, api_key: SecretStr) -> Daytona:
        """The SDK client for ``api_key``, made once (it holds a connection pool)."""
        secret = api_key.get_secret_value()
        digest = hashlib.sha256(secret.encode()).hexdigest()
        with self._lock:
            client = self._clients.get(digest)
            if client is None:
                config = DaytonaConfig(
                    api_key=secret, api_url=self.config.api_url, target=self.config.target
                )
                client = self._clients[digest] = Daytona(config)
            return client

    def close(self) -> None:
        """Close the SDK clients' connection pools (a provider dropped before its process
        ends, e.g. in tests; the SDK offers no close of its own)."""
        with self._lock:
            clients, self._clients = list(self._clients.values()), {}
        for client in clients:
            _close_client(client)

    def _file_timeout(self) -> int:
        return max(1, math.ceil(self.config.request_timeout_s))

    @contextlib.contextmanager
    def _sdk_errors(
        self, action: str, org_id: str | None, *, creating: bool = False
    ) -> Iterator[None]:
        """The SDK's exceptions as corral's provider errors, with what to do about them."""
        try:
            yield
        except DaytonaError as exc:
            status = exc.status_code or _class_status(exc)
            if status:
                raise self.status_error(
                    status, action, org_id, str(exc), creating=creating
                ) from exc
            raise _statusless(exc, action) from exc


# -- helpers --------------------------------------------------------------------------------


def _close_client(client: Daytona) -> None:
    """Close what the SDK's client holds open: its httpx client and its API clients' urllib3
    pools (private attributes of the SDK: what is not there is skipped)."""
    http = getattr(client, "_http_client", None)
    if http is not None:
        http.close()
    for name in ("_api_client", "_toolbox_api_client"):
        rest = getattr(getattr(client, name, None), "rest_client", None)
        pools = getattr(rest, "pool_manager", None)
        if pools is not None:
            pools.clear()


def confine(path: str) -> str:
    """``path`` relative to the sandbox's work directory (where Daytona resolves relative
    paths), or SandboxPathError."""
    normal = posixpath.normpath(path) if path else ""
    if not normal or normal == "." or posixpath.isabs(normal) or normal.split("/")[0] == "..":
        raise SandboxPathError(
            f"path {path!r} is outside the sandbox work directory; use a path relative to it"
        )
    return normal


def _shell_line(
    line: str, env: Mapping[str, str] | None, cwd: str | None, timeout_s: float | None
) -> str:
    """``line`` for a session's shell: through ``/bin/sh -c``, with its env, in ``cwd``, under
    ``timeout(1)`` (TERM, then KILL a second later)."""
    argv: list[str] = []
    if timeout_s:
        argv += ["timeout", "-k", "1", f"{timeout_s:g}"]
    if env:
        argv += ["env", *(f"{key}={value}" for key, value in env.items())]
    argv += ["/bin/sh", "-c", line]
    prefix = f"cd -- {shlex.quote(cwd)} && " if cwd else ""
    return prefix + shlex.join(argv)


def _resources(spec: SandboxSpec, disk_gb: int | None) -> Resources | None:
    """The spec's CPU and memory in Daytona's units (whole cores, GiB), rounded up."""
    wanted = spec.resources
    resources = Resources(
        cpu=math.ceil(wanted.cpu) if wanted.cpu else None,
        memory=math.ceil(wanted.memory_mb / 1024) if wanted.memory_mb else None,
        disk=disk_gb,
        gpu=wanted.gpu or None,
    )
    if all(value is None for value in (resources.cpu, resources.memory, resources.disk)):
        return None if resources.gpu is None else resources
    return resources


def _egress(spec: SandboxSpec) -> dict[str, str]:
    """Daytona's egress limits for a sandbox without network: the control plane alone (the
    runner must reach it), as a CIDR for an address, as an allowed domain for a name."""
    if spec.egress.allow_network:
        return {}
    split = urlsplit(spec.control_url)
    host = split.hostname
    if not host or split.scheme not in ("http", "https"):
        raise InvalidProviderConfigError(
            "a sandbox without network on Daytona needs an http(s) CORRAL_CONTROL_URL that "
            "Daytona can reach (the runner dials out to it)"
        )
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return {"domain_allow_list": host}
    return {"network_allow_list": f"{address}/{address.max_prefixlen}"}


def _source(params: CreateSandboxFromSnapshotParams | CreateSandboxFromImageParams) -> str:
    if isinstance(params, CreateSandboxFromImageParams):
        return f"image {params.image!r}"
    return f"snapshot {params.snapshot!r}" if params.snapshot else "Daytona's default snapshot"


def _state(sandbox: Sandbox) -> str:
    state = sandbox.state
    return str(getattr(state, "value", state) or "unknown")


def _status_of(state: str, error_reason: str | None) -> SandboxStatus:
    """corral's status for a Daytona state other than ``started``."""
    if state in _GONE:
        return SandboxStatus(state=SandboxState.TERMINATED, reason="sandbox deleted")
    if state in _ENDED:
        return SandboxStatus(state=SandboxState.TERMINATED, reason=f"sandbox {state}")
    if state in _FAILED:
        reason = f"sandbox {state}" + (f": {error_reason}" if error_reason else "")
        return SandboxStatus(state=SandboxState.FAILED, reason=reason)
    if state in _PAUSED:
        return SandboxStatus(state=SandboxState.READY, reason=f"sandbox {state}")
    if state in _LIVE:
        return SandboxStatus(state=SandboxState.RUNNING)
    return SandboxStatus(state=SandboxState.PROVISIONING, reason=f"sandbox {state}")


def _timestamp(value: str | None) -> datetime | None:
    if not value:
        return None
    try:
        moment = datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError:
        return None
    return moment if moment.tzinfo else moment.replace(tzinfo=UTC)


def _in_own_thread(call: Callable[[], T], limit_s: float, action: str) -> T:
    """``call()`` in a thread of its own, given up ``_GRACE_S`` after ``limit_s``.

    The SDK times out create and delete with SIGALRM when called from the main thread, and
    otherwise by raising asynchronously in the calling thread; either would reach into the
    caller's (pytest-timeout's alarm, a Celery pool thread), a thread of its own does not.

    An error is handed over in no reference cycle: what the SDK's frames in its traceback hold
    (the socket of a response whose close the SDK's timeout cut short) goes when the error does,
    not at some later garbage collection."""
    outcome: dict[str, Any] = {}
    thread = threading.Thread(
        target=_run_into, args=(call, outcome), name="daytona-call", daemon=True
    )
    thread.start()
    thread.join(limit_s + _GRACE_S)
    if thread.is_alive():
        raise ProviderTimeoutError(f"Daytona did not answer in {limit_s:g} s while {action}")
    if "error" in outcome:
        raise outcome.pop("error")  # not left in `outcome`: its traceback holds this frame
    return cast(T, outcome["result"])


def _run_into(call: Callable[[], Any], outcome: dict[str, Any]) -> None:
    """``call()``'s result, or its error, into ``outcome`` (for :func:`_in_own_thread`)."""
    try:
        outcome["result"] = call()
    except BaseException as exc:  # handed to the caller
        outcome["error"] = exc
        # Its traceback holds this frame: no cycle back to it, even when it comes too late
        # for the caller to take it out of `outcome`.
        del outcome


# The SDK's exceptions raised without a status (by the client itself), by the one they mean.
_CLASS_STATUS: tuple[tuple[type[DaytonaError], int], ...] = (
    (DaytonaAuthenticationError, 401),
    (DaytonaForbiddenError, 403),
    (DaytonaNotFoundError, 404),
    (DaytonaRateLimitError, 429),
)


def _class_status(exc: DaytonaError) -> int:
    return next((status for kind, status in _CLASS_STATUS if isinstance(exc, kind)), 0)


def _statusless(exc: DaytonaError, action: str) -> ProviderError:
    """corral's error for an SDK error without an HTTP status: its class's, else a
    transport failure's, else a refusal."""
    if isinstance(exc, DaytonaTimeoutError):
        return ProviderTimeoutError(f"Daytona timed out while {action}: {exc}")
    transport: type[TransientProviderError] | None = ProviderUnavailableError
    if not isinstance(exc, DaytonaConnectionError):
        transport = _transport_failure(exc)
    if transport is not None:
        return transport(f"Daytona could not be reached while {action}: {exc}")
    return SandboxCreateError(f"Daytona refused {action} (no status): {exc}")


def _transport_failure(exc: BaseException) -> type[TransientProviderError] | None:
    """For an SDK error without a status, what its cause says: a timeout, another network
    failure (e.g. urllib3's MaxRetryError after the client's own retries), or None."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, urllib3.exceptions.MaxRetryError) and current.reason:
            current = current.reason
        if isinstance(current, TimeoutError | urllib3.exceptions.TimeoutError):
            return ProviderTimeoutError
        if isinstance(current, OSError | urllib3.exceptions.HTTPError):
            return ProviderUnavailableError
        current = current.__cause__ or current.__context__
    return None
