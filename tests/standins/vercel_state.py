"""The state behind the Vercel Sandbox stand-in: named sandboxes, their runtime sessions and
commands, the faults it was told to inject and the requests it saw.

The server thread writes it while the test thread reads it, so every access goes through one
lock; a sandbox's commands are real processes (``vercel_processes``)."""

from __future__ import annotations

import copy
import secrets
import shutil
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from tests.standins.vercel_processes import Command, now_ms

# Error bodies as Vercel's API writes them: {"error": {"code": ..., "message": ...}}, which
# the SDK's ``extract_structured_error`` reads into ``SandboxApiError.code`` and the message.
DEFAULT_ERRORS: dict[int, tuple[str, str]] = {
    400: ("bad_request", "Invalid request"),
    401: ("unauthorized", "Authentication required"),
    403: ("forbidden", "Not authorized"),
    404: ("not_found", "Not found"),
    409: ("conflict", "Conflict"),
    410: ("sandbox_stopped", "The sandbox session is no longer running"),
    429: ("rate_limited", "Rate limit exceeded"),
    500: ("internal_server_error", "An unexpected internal error occurred"),
    502: ("bad_gateway", "Bad gateway"),
    503: ("service_unavailable", "The service is temporarily unavailable"),
    504: ("gateway_timeout", "Gateway timeout"),
}
WORKDIR = "/vercel/sandbox"
DEFAULT_IMAGE = "vercel/sandbox/universal:latest"
DEFAULT_TIMEOUT_MS = 300_000  # five minutes when the create body names none
MAX_TIMEOUT_MS = 18_000_000  # five hours, the Pro plan's ceiling
MAX_TAGS = 5
VCPUS = (1, 2, 4, 8)
MEMORY_PER_VCPU_MB = 2048
Status = Literal["pending", "running", "stopping", "stopped", "failed", "aborted", "snapshotting"]


class ApiError(Exception):
    """An answer rendered as Vercel's error body."""

    def __init__(self, status: int, message: str | None = None, code: str | None = None):
        default_code, default_message = DEFAULT_ERRORS.get(status, ("error", "Error"))
        self.status = status
        self.code = code or default_code
        self.message = message or default_message
        super().__init__(f"{status} {self.code}: {self.message}")

    def body(self) -> dict[str, Any]:
        return {"error": {"code": self.code, "message": self.message}}


@dataclass
class Session:
    """A sandbox's runtime session (one microVM boot) and the commands it ran."""

    session_id: str
    sandbox_name: str
    project_id: str
    vcpus: int
    timeout_ms: int
    region: str
    network_policy: Any
    ready_at: int
    requested_at: int = field(default_factory=now_ms)
    stopped_at: int | None = None
    ended: Status | None = None  # stopped, failed or aborted once it ended
    commands: dict[str, Command] = field(default_factory=dict, repr=False)

    def status(self, at: int) -> Status:
        if self.ended is not None:
            return self.ended
        return "pending" if at < self.ready_at else "running"

    def body(self, at: int) -> dict[str, Any]:
        """The API's session object (``_RuntimeSessionPayload`` in the SDK)."""
        return {
            "id": self.session_id,
            "sourceSandboxName": self.sandbox_name,
            "projectId": self.project_id,
            "status": self.status(at),
            "cwd": WORKDIR,
            "region": self.region,
            "memory": self.vcpus * MEMORY_PER_VCPU_MB,
            "vcpus": self.vcpus,
            "timeout": self.timeout_ms,
            "networkPolicy": self.network_policy,
            "requestedAt": self.requested_at,
            "startedAt": self.ready_at,
            "stoppedAt": self.stopped_at,
        }


@dataclass
class StandinSandbox:
    """A named sandbox as the stand-in keeps it, with the create body it was made from."""

    name: str
    project_id: str
    image: str
    env: dict[str, str] = field(repr=False)
    tags: dict[str, str]
    persistent: bool
    source: dict[str, Any] | None
    create_body: dict[str, Any] = field(repr=False)
    root: Path
    session: Session
    created_at: int = field(default_factory=now_ms)
    updated_at: int = field(default_factory=now_ms)

    def status(self, at: int) -> Status:
        return self.session.status(at)

    def body(self, at: int) -> dict[str, Any]:
        """The API's sandbox object (``_SandboxPayload`` in the SDK)."""
        session = self.session
        return {
            "name": self.name,
            "currentSessionId": session.session_id,
            "image": self.image,
            "status": self.status(at),
            "persistent": self.persistent,
            "projectId": self.project_id,
            "cwd": WORKDIR,
            "region": session.region,
            "memory": session.vcpus * MEMORY_PER_VCPU_MB,
            "vcpus": session.vcpus,
            "timeout": session.timeout_ms,
            "networkPolicy": session.network_policy,
            "statusUpdatedAt": session.stopped_at or session.ready_at,
            "createdAt": self.created_at,
            "updatedAt": self.updated_at,
            "tags": dict(self.tags),
        }

    @property
    def commands(self) -> list[Command]:
        return list(self.session.commands.values())


@dataclass
class Fault:
    """An injected answer: hold the matching request ``delay`` seconds, then answer with
    ``status`` (None: answer normally)."""

    status: int | None
    delay: float
    remaining: int | None  # None: until cleared
    method: str | None
    path: str | None
    code: str | None = None
    message: str | None = None
    headers: dict[str, str] = field(default_factory=dict)

    def matches(self, method: str, path: str) -> bool:
        return (self.method is None or self.method == method) and (
            self.path is None or path.startswith(self.path)
        )


@dataclass
class RecordedRequest:
    method: str
    path: str
    query: dict[str, list[str]]
    headers: dict[str, str]
    body: Any
    status: int | None = None


@dataclass
class StandinState:
    team_id: str
    project_id: str
    workdir: Path
    boot_s: float = 0.0
    region: str = "iad1"
    lock: threading.RLock = field(default_factory=threading.RLock)
    sandboxes: dict[str, StandinSandbox] = field(default_factory=dict)
    destroyed: dict[str, StandinSandbox] = field(default_factory=dict)
    faults: list[Fault] = field(default_factory=list)
    log: list[RecordedRequest] = field(default_factory=list)

    def take_fault(self, method: str, path: str) -> Fault | None:
        with self.lock:
            for fault in self.faults:
                if fault.matches(method, path):
                    if fault.remaining is not None:
                        fault.remaining -= 1
                        if fault.remaining == 0:
                            self.faults.remove(fault)
                    return fault
        return None

    def sweep(self) -> None:
        """End the sessions whose execution time limit ran out, as Vercel stops them."""
        at = now_ms()
        with self.lock:
            for sandbox in self.sandboxes.values():
                session = sandbox.session
                if session.ended is None and at > session.ready_at + session.timeout_ms:
                    self.stop_session(session)

    def stop_session(self, session: Session, ended: Status = "stopped") -> None:
        """Kill what runs in the session; it ends as ``ended``."""
        with self.lock:
            if session.ended is None:
                session.ended = ended
                session.stopped_at = now_ms()
            commands = list(session.commands.values())
        for command in commands:
            command.kill_and_wait()

    def sandbox(self, name: str, project_id: str | None) -> StandinSandbox:
        with self.lock:
            found = self.sandboxes.get(name)
        if found is None or (project_id is not None and found.project_id != project_id):
            raise ApiError(404, f"Sandbox {name!r} was not found", "not_found")
        return found

    def session(self, session_id: str) -> tuple[StandinSandbox, Session]:
        with self.lock:
            for sandbox in self.sandboxes.values():
                if sandbox.session.session_id == session_id:
                    return sandbox, sandbox.session
        raise ApiError(404, f"Session {session_id!r} was not found", "not_found")

    def live_session(self, session_id: str) -> tuple[StandinSandbox, Session]:
        """A session that runs commands: one that ended answers 410, as Vercel's does."""
        sandbox, session = self.session(session_id)
        if session.status(now_ms()) != "running":
            raise ApiError(410, "The sandbox session is no longer running", "sandbox_stopped")
        return sandbox, session

    def destroy(self, sandbox: StandinSandbox) -> None:
        self.stop_session(sandbox.session)
        with self.lock:
            self.sandboxes.pop(sandbox.name, None)
            self.destroyed[sandbox.name] = sandbox
        shutil.rmtree(sandbox.root, ignore_errors=True)

    def new_session(self, name: str, body: dict[str, Any]) -> Session:
        resources = body.get("resources") or {}
        at = now_ms()
        return Session(
            session_id=f"sbx_{secrets.token_hex(12)}",
            sandbox_name=name,
            project_id=self.project_id,
            vcpus=int(resources.get("vcpus") or 2),
            timeout_ms=int(body.get("timeout") or DEFAULT_TIMEOUT_MS),
            region=str(body.get("region") or self.region),
            network_policy=_readback(body.get("networkPolicy")),
            ready_at=at + int(self.boot_s * 1000),
            requested_at=at,
        )

    def snapshot(self, items: list[Any]) -> list[Any]:
        """Copies a test can read without racing the server (processes are shared)."""
        with self.lock:
            return [copy.copy(item) for item in items]


def _readback(policy: Any) -> Any:
    """How the API reads a network policy back: custom domain maps as their domain list."""
    if not isinstance(policy, dict):
        return {"mode": "allow-all"}
    if "allow" in policy:
        return {"mode": "custom", "allowedDomains": sorted(policy["allow"])}
    return {"mode": policy.get("mode", "allow-all")}
