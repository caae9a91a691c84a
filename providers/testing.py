"""An in-memory provider for unit tests: records every call, and fails or hangs on request.

Use it instead of ``unittest.mock``::

    provider = InMemoryProvider()
    provider.fail_transiently(2)      # the next two provisions raise ProviderUnavailableError
    handle = provider.provision(spec) # the third succeeds
    assert [c.method for c in provider.calls] == ["provision"] * 3

Sandboxes live in a dict. Options (``SandboxSpec.provider_options``) can make a sandbox
print log lines or finish with an exit code. Commands run by ``exec_command`` are
interpreted, not executed: ``echo ARGS``, ``cat FILE`` and ``env`` work; anything else
answers exit code 127, as a shell would for an unknown command.
"""

from __future__ import annotations

import shlex
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path, PurePosixPath
from typing import Any

from pydantic import Field

from corral.providers.base import (
    DEFAULT_DOWNLOAD_MAX_BYTES,
    DEFAULT_EXEC_OUTPUT_MAX_BYTES,
    Capacity,
    CodeRun,
    ExecResult,
    ManagedSandbox,
    ProviderHealth,
    SandboxHandle,
    SandboxProvider,
    SandboxSpec,
    SandboxState,
    SandboxStatus,
    SandboxUsage,
)
from corral.providers.capabilities import ProviderCapabilities
from corral.providers.config import ProviderConfig, ProviderOptions
from corral.providers.descriptors import BUILTIN
from corral.providers.errors import (
    CapacityExhaustedError,
    ExecutionOutcomeUnknownError,
    ProviderTimeoutError,
    ProviderUnavailableError,
    RateLimitedError,
    SandboxCreateError,
    SandboxNotRunningError,
    SandboxPathError,
)
from corral.providers.size_limits import ExecOutput, log_tail, refuse_larger
from corral.runner import inline_code


class InMemoryProviderConfig(ProviderConfig):
    max_concurrent: int | None = Field(default=None, gt=0)
    hang_timeout_s: float = Field(
        default=30.0, gt=0, description="how long a hung provision waits before timing out"
    )


class InMemoryProviderOptions(ProviderOptions):
    log_lines: tuple[str, ...] = ()
    exit_code: int | None = Field(
        default=None, description="finish at once with this exit code instead of running"
    )


@dataclass(frozen=True)
class Call:
    """One recorded call: the method name and its main argument."""

    method: str
    target: str


@dataclass
class _Box:
    spec: SandboxSpec
    state: SandboxState = SandboxState.RUNNING
    exit_code: int | None = None
    paused: bool = False
    files: dict[str, bytes] = field(default_factory=dict)
    logs: list[str] = field(default_factory=list)
    started_at: datetime = field(default_factory=lambda: datetime.now(UTC))
    cpu_seconds: float | None = None


class InMemoryProvider(SandboxProvider):
    """A provider whose sandboxes are dict entries; every ability is implemented."""

    id = "in-memory"
    display_name = "In-memory (tests)"
    config_model = InMemoryProviderConfig
    options_model = InMemoryProviderOptions
    mounts_api_socket = True
    config: InMemoryProviderConfig

    def __init__(self, config: InMemoryProviderConfig | Mapping[str, Any] | None = None) -> None:
        super().__init__(config)
        self.calls: list[Call] = []
        self.boxes: dict[str, _Box] = {}
        self._lock = threading.Lock()
        self._transient_failures = 0
        self._rate_limited = 0
        self._permanent_failure: str | None = None
        self._release = threading.Event()
        self._release.set()
        self._end_logs_answer = threading.Event()
        self._end_logs_answer.set()

    # -- steering ------------------------------------------------------------------------

    def fail_transiently(self, times: int) -> None:
        """The next ``times`` provisions raise ProviderUnavailableError."""
        self._transient_failures = times

    def rate_limit(self, times: int) -> None:
        """The next ``times`` provisions raise RateLimitedError, as a vendor's 429."""
        self._rate_limited = times

    def fail_permanently(self, message: str = "refused by the in-memory provider") -> None:
        """Every provision from now on raises SandboxCreateError with ``message``."""
        self._permanent_failure = message

    def recover(self) -> None:
        """Provisions work again (after :meth:`fail_permanently`)."""
        self._permanent_failure = None

    def hang(self) -> None:
        """Provisions block until :meth:`release` (or time out after ``hang_timeout_s``)."""
        self._release.clear()

    def release(self) -> None:
        self._release.set()

    def hang_end_logs(self) -> None:
        """Reads of end logs block until :meth:`release_end_logs` (or time out after
        ``hang_timeout_s``), as a provider that does not answer."""
        self._end_logs_answer.clear()

    def release_end_logs(self) -> None:
        self._end_logs_answer.set()

    def finish(self, handle: SandboxHandle, exit_code: int = 0) -> None:
        """Make the sandbox end on its own, as if its entrypoint exited."""
        box = self.boxes[handle.external_id]
        box.exit_code = exit_code
        box.state = SandboxState.TERMINATED if exit_code == 0 else SandboxState.FAILED

    def use_cpu(self, handle: SandboxHandle, cpu_seconds: float | None) -> None:
        """Set the CPU seconds :meth:`usage` reports (None: not measured)."""
        self.boxes[handle.external_id].cpu_seconds = cpu_seconds

    def adopt(self, spec: SandboxSpec) -> SandboxHandle:
        """Hold a sandbox corral never asked for (as if made by hand or by a lost worker)."""
        with self._lock:
            self.boxes[spec.sandbox_id] = _Box(spec=spec)
        return self._handle(spec, spec.sandbox_id)

    def vanish(self, handle: SandboxHandle) -> None:
        """Lose the sandbox without being asked, as a provider does when a host dies."""
        with self._lock:
            self.boxes.pop(handle.external_id, None)

    def methods(self) -> list[str]:
        return [call.method for call in self.calls]

    # -- contract ------------------------------------------------------------------------

    @property
    def capabilities(self) -> ProviderCapabilities:
        # Declares every ability it implements, and a substrate as broad as local's.
        return BUILTIN["local"].capabilities.model_copy(
            update={
                "supports_pause_resume": True,
                "supports_capacity_query": True,
                "max_concurrent": self.config.max_concurrent,
            }
        )

    def provision(self, spec: SandboxSpec) -> SandboxHandle:
        self._record("provision", spec.sandbox_id)
        options = self.parse_options(spec)
        assert isinstance(options, InMemoryProviderOptions)
        if not self._release.wait(self.config.hang_timeout_s):
            raise ProviderTimeoutError("the in-memory provider hung and timed out")
        with self._lock:
            self._raise_requested_failure()
            if spec.sandbox_id in self.boxes:
                return self._handle(spec, spec.sandbox_id)
            if (
                self.config.max_concurrent is not None
                and self._live() >= self.config.max_concurrent
            ):
                raise CapacityExhaustedError(
                    f"in-memory provider is at its limit of {self.config.max_concurrent}"
                )
            box = _Box(spec=spec, logs=list(options.log_lines))
            self.boxes[spec.sandbox_id] = box
        if options.exit_code is not None:
            self.finish(self._handle(spec, spec.sandbox_id), options.exit_code)
        return self._handle(spec, spec.sandbox_id)

    def status(self, handle: SandboxHandle) -> SandboxStatus:
        self._record("status", handle.external_id)
        box = self.boxes.get(handle.external_id)
        if box is None:
            return SandboxStatus(state=SandboxState.TERMINATED, reason="sandbox no longer exists")
        if box.paused:
            return SandboxStatus(state=SandboxState.READY, reason="paused")
        reason = None if box.exit_code is None else f"exited with code {box.exit_code}"
        return SandboxStatus(state=box.state, reason=reason, exit_code=box.exit_code)

    def terminate(self, handle: SandboxHandle) -> None:
        self._record("terminate", handle.external_id)
        with self._lock:
            self.boxes.pop(handle.external_id, None)

    def health_check(self, org_id: str | None = None) -> ProviderHealth:
        self._record("health_check", "")
        return ProviderHealth(healthy=True, message=f"{len(self.boxes)} sandboxes in memory")

    # -- optional abilities ---------------------------------------------------------------

    def stream_logs(self, handle: SandboxHandle, *, follow: bool = False) -> Iterator[str]:
        self._record("stream_logs", handle.external_id)
        box = self.boxes.get(handle.external_id)
        yield from (box.logs if box else [])

    def end_log(self, handle: SandboxHandle, *, max_lines: int, max_bytes: int) -> str | None:
        """The sandbox's log lines (its ``log_lines`` option), their end."""
        self._record("end_log", handle.external_id)
        if not self._end_logs_answer.wait(self.config.hang_timeout_s):
            raise ProviderTimeoutError("the in-memory provider hung and timed out")
        box = self.boxes.get(handle.external_id)
        if box is None:
            return None
        text = "".join(f"{line}\n" for line in box.logs).encode()
        return log_tail([text[-max_bytes:]], max_lines=max_lines, max_bytes=max_bytes)

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
        self._record("exec_command", handle.external_id)
        box = self._running(handle)
        argv = shlex.split(command) if isinstance(command, str) else list(command)
        started = time.monotonic()
        stdout, stderr, code = self._interpret(box, argv, dict(env or {}))
        output = ExecOutput(max_output_bytes)
        output.stdout.add(stdout)
        output.stderr.add(stderr)
        return output.result(exit_code=code, duration_s=time.monotonic() - started)

    def upload_file(self, handle: SandboxHandle, source: Path, target: str) -> None:
        self._record("upload_file", handle.external_id)
        self._running(handle).files[_normalise(target)] = source.read_bytes()

    def download_file(
        self,
        handle: SandboxHandle,
        source: str,
        target: Path,
        *,
        max_bytes: int = DEFAULT_DOWNLOAD_MAX_BYTES,
    ) -> None:
        self._record("download_file", handle.external_id)
        files = self._running(handle).files
        key = _normalise(source)
        if key not in files:
            raise FileNotFoundError(f"no file {source!r} in sandbox {handle.external_id}")
        refuse_larger(source, len(files[key]), max_bytes)
        target.write_bytes(files[key])

    def pause(self, handle: SandboxHandle) -> None:
        self._record("pause", handle.external_id)
        self._running(handle).paused = True

    def resume(self, handle: SandboxHandle) -> None:
        self._record("resume", handle.external_id)
        box = self.boxes.get(handle.external_id)
        if box is None:
            raise SandboxNotRunningError(f"sandbox {handle.external_id} no longer exists")
        box.paused = False

    def list_managed(self) -> list[ManagedSandbox]:
        self._record("list_managed", "")
        return [
            ManagedSandbox(
                handle=self._handle(box.spec, sandbox_id),
                sandbox_id=sandbox_id,
                labels=box.spec.managed_labels(),
                started_at=box.started_at,
                state=box.state,
            )
            for sandbox_id, box in list(self.boxes.items())
        ]

    def usage(self, handle: SandboxHandle) -> SandboxUsage:
        self._record("usage", handle.external_id)
        box = self.boxes.get(handle.external_id)
        return SandboxUsage(cpu_seconds=box.cpu_seconds if box else None)

    def capacity(self) -> Capacity:
        self._record("capacity", "")
        return Capacity(limit=self.config.max_concurrent, in_use=self._live())

    # -- internals -----------------------------------------------------------------------

    def _record(self, method: str, target: str) -> None:
        self.calls.append(Call(method, target))

    def _raise_requested_failure(self) -> None:
        if self._permanent_failure is not None:
            raise SandboxCreateError(self._permanent_failure)
        if self._rate_limited > 0:
            self._rate_limited -= 1
            raise RateLimitedError("the in-memory provider refused for its rate limit (as told)")
        if self._transient_failures > 0:
            self._transient_failures -= 1
            raise ProviderUnavailableError("the in-memory provider is unavailable (as told)")

    def _live(self) -> int:
        return sum(1 for box in self.boxes.values() if box.state is SandboxState.RUNNING)

    def _running(self, handle: SandboxHandle) -> _Box:
        box = self.boxes.get(handle.external_id)
        if box is None or box.state is not SandboxState.RUNNING or box.paused:
            raise SandboxNotRunningError(f"sandbox {handle.external_id} is not running")
        return box

    @staticmethod
    def _interpret(box: _Box, argv: list[str], env: dict[str, str]) -> tuple[str, str, int]:
        name, args = (argv[0], argv[1:]) if argv else ("", [])
        if name == "echo":
            return " ".join(args) + "\n", "", 0
        if name == "env":
            return "".join(f"{k}={v}\n" for k, v in sorted(env.items())), "", 0
        if name == "cat" and len(args) == 1:
            data = box.files.get(_normalise(args[0]))
            if data is None:
                return "", f"cat: {args[0]}: No such file or directory\n", 1
            return data.decode(errors="replace"), "", 0
        return "", f"{name}: command not found\n", 127


def _normalise(path: str) -> str:
    """A sandbox path as a key, with the same confinement rule as real providers."""
    normal = PurePosixPath("/work", path)
    parts: list[str] = []
    for part in normal.parts[1:]:
        if part == "..":
            if not parts:
                raise SandboxPathError(f"path {path!r} is outside the sandbox work directory")
            parts.pop()
        elif part != ".":
            parts.append(part)
    if not parts or parts[0] != "work":
        raise SandboxPathError(f"path {path!r} is outside the sandbox work directory")
    return "/".join(parts[1:])


class InMemoryCodeInterpreter(InMemoryProvider):
    """A code interpreter for tests (id ``in-memory-code``): ``run_code`` really runs the
    wrapped program (:mod:`corral.runner.inline_code`) in a local Python subprocess, with
    the hard timeout; sandboxes are dict entries, made before and removed after each run.

    Steering, besides the in-memory provider's: ``fail_transiently(n)`` fails before the
    execute call; :meth:`fail_after_execute` makes the next runs fail after the code ran
    (the outcome is then unknown); :meth:`block_execute` holds runs at the execute call.
    """

    id = "in-memory-code"
    display_name = "In-memory code interpreter (tests)"
    hard_timeout_s = 30.0
    default_capabilities = BUILTIN["local"].capabilities.model_copy(
        update={"work_kinds": ("code",), "max_session_duration_seconds": 30}
    )

    def __init__(self, config: InMemoryProviderConfig | Mapping[str, Any] | None = None) -> None:
        super().__init__(config)
        self._fail_after: str | None = None
        self._executing = threading.Event()
        self._executing.set()
        self.executed: list[str] = []  # sandbox ids whose code was executed

    @property
    def capabilities(self) -> ProviderCapabilities:
        # The in-memory provider's abilities (it still has them), for code items alone.
        return super().capabilities.model_copy(
            update={"work_kinds": ("code",), "max_session_duration_seconds": 30}
        )

    def fail_after_execute(self, message: str = "the connection broke during execute") -> None:
        self._fail_after = message

    def block_execute(self) -> None:
        self._executing.clear()

    def unblock_execute(self) -> None:
        self._executing.set()

    def run_code(
        self,
        spec: SandboxSpec,
        code: str,
        arguments: Mapping[str, Any],
        *,
        timeout_s: float,
        on_execute: Callable[[SandboxHandle], None] | None = None,
    ) -> CodeRun:
        self._record("run_code", spec.sandbox_id)
        self.parse_options(spec)
        with self._lock:
            self._raise_requested_failure()
            self.boxes[spec.sandbox_id] = _Box(spec=spec)
        handle = self._handle(spec, spec.sandbox_id)
        try:
            if on_execute is not None:
                on_execute(handle)
            self._executing.wait(self.config.hang_timeout_s)
            self.executed.append(spec.sandbox_id)
            run = _run_locally(spec, code, arguments, min(timeout_s, self.hard_timeout_s))
            if self._fail_after is not None:
                raise ExecutionOutcomeUnknownError(self._fail_after)
            return run
        finally:
            self.terminate(handle)


def _run_locally(
    spec: SandboxSpec, code: str, arguments: Mapping[str, Any], timeout_s: float
) -> CodeRun:
    """Run the wrapped program in a local Python, as a code interpreter would."""
    marker = inline_code.new_marker()
    source = inline_code.program(code, arguments, marker=marker, env=spec.work_env())
    started = time.monotonic()
    try:
        done = subprocess.run(
            [sys.executable, "-c", source],
            capture_output=True,
            text=True,
            timeout=timeout_s,
            check=False,
        )
    except subprocess.TimeoutExpired as expired:
        printed = expired.stdout.decode() if isinstance(expired.stdout, bytes) else ""
        return CodeRun(
            stdout=inline_code.split_output(printed, marker).stdout,
            stderr="",
            exit_code=124,
            duration_s=time.monotonic() - started,
            timed_out=True,
        )
    outcome = inline_code.split_output(done.stdout, marker)
    return CodeRun(
        stdout=outcome.stdout,
        stderr=done.stderr,
        exit_code=0 if outcome.ok else (done.returncode or 1),
        duration_s=time.monotonic() - started,
        result=outcome.result,
        error=outcome.error,
    )
