"""What the Modal stand-in (tests/standins/modal.py) holds: apps, images, secrets, sandboxes
with the local processes that play them, exec'd commands, the requests it received and the
faults a test injected. Every field is guarded by one lock; the gRPC handlers and the test
thread both read and write it."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import threading
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from grpclib import Status

TOKEN_ID_HEADER = "x-modal-token-id"
TOKEN_SECRET_HEADER = "x-modal-token-secret"


def new_id(prefix: str) -> str:
    """An object id of Modal's shape: a prefix and 22 letters and digits (``sb-…``)."""
    return f"{prefix}-{uuid.uuid4().hex[:22]}"


@dataclass
class Fault:
    """An answer the stand-in gives instead of serving: a status, a delay, or both."""

    method: str  # an RPC name, or "*" for every RPC
    status: Status | None = None
    message: str = ""
    delay_s: float = 0.0
    times: int | None = 1  # None: until cleared

    def matches(self, method: str) -> bool:
        return self.method in ("*", method) and (self.times is None or self.times > 0)


@dataclass(frozen=True)
class RecordedRequest:
    """One RPC as it arrived: its name, its metadata (token secret masked) and its message."""

    method: str
    metadata: dict[str, str]
    message: str  # the request in protobuf text format

    def carries(self, text: str) -> bool:
        return text in self.message or any(text in v for v in self.metadata.values())


@dataclass
class ExecRun:
    """One command exec'd in a sandbox, run as a local process."""

    exec_id: str
    sandbox_id: str
    argv: list[str]
    env: dict[str, str]
    process: subprocess.Popen[bytes]
    stdout: Path
    stderr: Path
    deadline: float | None
    timed_out: bool = False


@dataclass
class StandinSandbox:
    """A sandbox: what it was created with, and the local process that plays it."""

    sandbox_id: str
    task_id: str
    version: int  # 1: the SandboxCreate RPCs (a GPU asks for them); 2: the …V2 ones
    app_id: str
    name: str
    tags: dict[str, str]
    argv: list[str]
    env: dict[str, str] = field(repr=False)  # from its secrets: what its process got
    image_id: str
    gpu_type: str  # "" without a GPU
    gpu_count: int
    milli_cpu: int
    memory_mb: int
    timeout_s: int
    workdir: Path
    created_at: float
    process: subprocess.Popen[bytes] | None = field(default=None, repr=False)
    # (GenericResult status, exit code) once ended; see modal_api for the statuses.
    result: tuple[int, int] | None = None

    @property
    def gpu(self) -> str | None:
        """The GPU as ``Sandbox.create(gpu=…)`` names it (``T4``, ``A100:2``), or None."""
        if not self.gpu_type:
            return None
        return self.gpu_type if self.gpu_count <= 1 else f"{self.gpu_type}:{self.gpu_count}"

    def log(self) -> str:
        path = self.workdir / "sandbox.log"
        return path.read_text(errors="replace") if path.exists() else ""


# GenericResult statuses, as api_pb2 numbers them (kept here so the state needs no protobuf).
SUCCESS, FAILURE, TERMINATED, TIMEOUT = 1, 2, 3, 4


def kill_group(process: subprocess.Popen[bytes]) -> None:
    """SIGKILL the process group the stand-in started (each run leads its own)."""
    if process.poll() is None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(process.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        process.wait(timeout=5)


class ModalState:
    """Everything the stand-in knows, behind one lock."""

    def __init__(self, root: Path, base_env: Mapping[str, str]) -> None:
        self.root = root
        self.base_env = dict(base_env)
        self.lock = threading.RLock()
        self.apps: dict[str, str] = {}  # "environment/name" -> app id
        self.images: dict[str, str] = {}  # image id -> what it was made from
        self.secrets: dict[str, dict[str, str]] = {}
        self.sandboxes: dict[str, StandinSandbox] = {}
        self.execs: dict[str, ExecRun] = {}
        self.requests: list[RecordedRequest] = []
        self.faults: list[Fault] = []
        self.jwts: dict[str, str] = {}  # task id -> the JWT its command router accepts
        self.auth_tokens: set[str] = set()  # issued by AuthTokenGet, for the V2 RPCs

    # -- faults ---------------------------------------------------------------------------

    def take_fault(self, method: str) -> Fault | None:
        with self.lock:
            for fault in self.faults:
                if fault.matches(method):
                    if fault.times is not None:
                        fault.times -= 1
                    return fault
        return None

    # -- sandboxes ------------------------------------------------------------------------

    def start(self, sandbox: StandinSandbox) -> None:
        """Run the sandbox's entrypoint as a local process with its secrets' environment."""
        sandbox.workdir.mkdir(parents=True, exist_ok=True)
        env = {**self.base_env, "HOME": str(sandbox.workdir), **sandbox.env}
        with (sandbox.workdir / "sandbox.log").open("wb") as log:
            try:
                sandbox.process = subprocess.Popen(
                    sandbox.argv,
                    cwd=sandbox.workdir,
                    env=env,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL,
                    start_new_session=True,
                )
            except OSError as exc:  # no such program: the container's entrypoint fails
                log.write(f"exec {sandbox.argv[:1]}: {exc}\n".encode())
                sandbox.result = (FAILURE, 127)

    def refresh(self, sandbox: StandinSandbox) -> None:
        """Record the end of a sandbox whose process exited or whose timeout passed."""
        with self.lock:
            if sandbox.result is not None or sandbox.process is None:
                return
            code = sandbox.process.poll()
            if code is not None:
                # As a container reports it: killed by signal N is exit code 128 + N.
                code = 128 - code if code < 0 else code
                sandbox.result = (SUCCESS if code == 0 else FAILURE, code)
            elif time.monotonic() - sandbox.created_at > sandbox.timeout_s:
                kill_group(sandbox.process)
                sandbox.result = (TIMEOUT, 124)

    def terminate(self, sandbox: StandinSandbox) -> None:
        with self.lock:
            self.refresh(sandbox)
            if sandbox.result is None:
                if sandbox.process is not None:
                    kill_group(sandbox.process)
                sandbox.result = (TERMINATED, 137)
            for run in self.execs.values():
                if run.sandbox_id == sandbox.sandbox_id:
                    kill_group(run.process)

    def live(self) -> list[StandinSandbox]:
        with self.lock:
            for sandbox in self.sandboxes.values():
                self.refresh(sandbox)
            return [s for s in self.sandboxes.values() if s.result is None]

    def stop_all(self) -> None:
        with self.lock:
            for sandbox in self.sandboxes.values():
                if sandbox.process is not None:
                    kill_group(sandbox.process)
            for run in self.execs.values():
                kill_group(run.process)
