"""The state behind the E2B stand-in: its sandboxes, the commands they ran, the faults it was
told to inject and the requests it saw.

The server thread writes all of it while the test thread reads it, so every access goes
through one lock, and what a test gets back is a copy it cannot race with."""

from __future__ import annotations

import copy
import secrets
import string
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any, Literal, TypeVar

# Bodies the real services answer with, so the SDK maps them exactly as it would E2B's.
API_KEY_INVALID = "Invalid API key, please visit https://e2b.dev/docs/api-key for more information."
API_KEY_MISSING = "Authorization header is missing"
ENVD_UNAUTHORIZED = (
    "unauthorized access, please provide a valid access token or method signing if supported"
)
PROXY_SANDBOX_NOT_FOUND = "The sandbox was not found"
DEFAULT_MESSAGES: dict[int, str] = {
    400: "Bad request",
    401: API_KEY_INVALID,
    403: "You are not allowed to access this team",
    404: "Not found",
    409: "Conflict",
    429: "Rate limit exceeded, please try again later.",
    500: "Internal server error",
    502: "Bad gateway",
    503: "Service temporarily unavailable",
    504: "Gateway timeout",
}

CLIENT_ID = "6532622b"  # E2B answers every sandbox with this legacy constant
DEFAULT_TIMEOUT_S = 300  # the API's default when the create body has no timeout
MAX_TIMEOUT_S = 86_400  # the Pro plan's ceiling; more is a 400
CPU_COUNT, MEMORY_MB, DISK_SIZE_MB = 2, 512, 10_240  # the "base" template's size

T = TypeVar("T")
SandboxStateName = Literal["running", "paused"]
Surface = Literal["api", "envd"]


class ApiError(Exception):
    """An answer the REST half renders as E2B's ``{"code": ..., "message": ...}`` body."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"{status}: {message}")
        self.status = status
        self.message = message


@dataclass(frozen=True)
class CommandCall:
    """One ``process.Process/Start`` as envd received it: what a command handler decides on."""

    sandbox_id: str
    cmd: str  # the string the SDK hands ``/bin/bash -l -c``
    envs: dict[str, str]  # this command's own ``envs=``
    sandbox_envs: dict[str, str]  # the ``envs=`` the sandbox was created with
    cwd: str | None
    user: str | None  # from ``Authorization: Basic``; None means envd's default user
    timeout_ms: int | None  # the Connect deadline the SDK sent (its ``timeout=``)

    @property
    def environment(self) -> dict[str, str]:
        """What the process would see: sandbox envs overridden by the command's own."""
        return {**self.sandbox_envs, **self.envs}


@dataclass(frozen=True)
class CommandOutcome:
    """What a simulated command printed and how it ended. ``duration`` holds the end event
    back, so a test can make a command outlive the SDK's ``timeout=``."""

    stdout: str = ""
    stderr: str = ""
    exit_code: int = 0
    duration: float = 0.0


CommandHandler = Callable[[CommandCall], "CommandOutcome | tuple[str, str, int]"]


@dataclass
class StandinSandbox:
    """A sandbox as the stand-in holds it: the create request's fields plus lifecycle."""

    sandbox_id: str
    template_id: str
    alias: str | None
    metadata: dict[str, str]
    envs: dict[str, str]
    timeout: int
    state: SandboxStateName
    started_at: datetime
    end_at: datetime
    envd_access_token: str
    auto_pause: bool
    create_body: dict[str, Any]
    commands: list[CommandCall] = field(default_factory=list)


@dataclass
class Fault:
    """An injected answer for the next ``remaining`` matching requests (None: until cleared)."""

    status: int | None
    delay: float = 0.0
    remaining: int | None = 1
    method: str | None = None
    path_prefix: str | None = None
    message: str | None = None
    headers: dict[str, str] = field(default_factory=dict)

    def matches(self, method: str, path: str) -> bool:
        """Whether this fault answers ``method path``."""
        if self.method is not None and self.method.upper() != method.upper():
            return False
        return self.path_prefix is None or path.startswith(self.path_prefix)


@dataclass
class RecordedRequest:
    """One request as it reached the stand-in; the API key's value is never kept."""

    surface: Surface  # "api" (the REST API) or "envd" (the sandbox proxy)
    method: str
    path: str
    query: dict[str, list[str]]
    headers: dict[str, str]  # lower-case names; x-api-key's value is "<redacted>"
    body: Any  # parsed JSON, the decoded Connect message, raw bytes, or None
    status: int | None = None  # the status answered, once sent


def _now_utc() -> datetime:
    return datetime.now(UTC)


def new_sandbox_id() -> str:
    """An id shaped like E2B's: 20 lower-case letters and digits, starting with a letter."""
    alphabet = string.ascii_lowercase + string.digits
    return "i" + "".join(secrets.choice(alphabet) for _ in range(19))


class StandinState:
    """Sandboxes, faults and the request log, behind one lock.

    Time is the wall clock plus ``offset``, so a test can move past a sandbox's end without
    sleeping; a sandbox past its end is killed (or paused, with ``autoPause``) the next time
    anything looks at it, as E2B does on its own."""

    def __init__(self, *, envd_version: str, templates: Mapping[str, str] | None) -> None:
        self.lock = threading.RLock()
        self.envd_version = envd_version
        self.templates = dict(templates) if templates is not None else None
        self.offset = timedelta()
        self.sandboxes: dict[str, StandinSandbox] = {}
        self.ended: dict[str, StandinSandbox] = {}
        self.faults: list[Fault] = []
        self.log: list[RecordedRequest] = []
        self._next_pid = 1000
        self.creates_per_s: float | None = None  # E2B's creation rate limit (None: none)
        self._tokens, self._refilled = 0.0, 0.0

    def now(self) -> datetime:
        """The stand-in's clock: UTC wall time moved by :meth:`E2BStandin.advance`."""
        return _now_utc() + self.offset

    def sweep(self) -> None:
        """Apply every timeout that has passed: kill, or pause when the sandbox asked to."""
        with self.lock:
            now = self.now()
            for sandbox in list(self.sandboxes.values()):
                if sandbox.state != "running" or sandbox.end_at > now:
                    continue
                if sandbox.auto_pause:
                    sandbox.state = "paused"
                else:
                    self.ended[sandbox.sandbox_id] = self.sandboxes.pop(sandbox.sandbox_id)

    def find(self, sandbox_id: str) -> StandinSandbox | None:
        """The live (running or paused) sandbox, after applying timeouts."""
        with self.lock:
            self.sweep()
            return self.sandboxes.get(sandbox_id)

    def running(self, sandbox_id: str | None) -> StandinSandbox | None:
        """The sandbox envd traffic may reach: live and not paused."""
        found = self.find(sandbox_id) if sandbox_id else None
        return found if found is not None and found.state == "running" else None

    def resolve_template(self, template: str) -> tuple[str, str | None]:
        """Template ID and alias for the name a create asked for."""
        if self.templates is None:
            return template, template
        if template in self.templates:
            return self.templates[template], template
        if template in self.templates.values():
            return template, None
        raise ApiError(404, f"template '{template}' not found")

    def refill(self) -> None:
        """The creation rate limit's bucket, full."""
        with self.lock:
            self._tokens, self._refilled = self.creates_per_s or 0.0, time.monotonic()

    def count_create(self) -> None:
        """Count a create toward the creation rate limit: a token bucket of
        ``creates_per_s`` tokens a second holding a second's worth, a create past it refused
        with 429, as a vendor's rate limit does.

        Raises:
            ApiError: 429, the create is over the rate.
        """
        with self.lock:
            if self.creates_per_s is None:
                return
            now = time.monotonic()
            rate = self.creates_per_s
            self._tokens = min(rate, self._tokens + (now - self._refilled) * rate)
            self._refilled = now
            if self._tokens < 1:
                raise ApiError(429, "Rate limit exceeded, please try again later.")
            self._tokens -= 1

    def create(self, body: Mapping[str, Any]) -> StandinSandbox:
        """Start a sandbox from a ``POST /v2/sandboxes`` body."""
        template = body.get("templateID")
        if not isinstance(template, str) or not template:
            raise ApiError(400, "templateID is required")
        timeout = timeout_from(body, DEFAULT_TIMEOUT_S)
        template_id, alias = self.resolve_template(template)
        with self.lock:
            now = self.now()
            sandbox = StandinSandbox(
                sandbox_id=new_sandbox_id(),
                template_id=template_id,
                alias=alias,
                metadata=_string_map(body.get("metadata"), "metadata"),
                envs=_string_map(body.get("envVars"), "envVars"),
                timeout=timeout,
                state="running",
                started_at=now,
                end_at=now + timedelta(seconds=timeout),
                envd_access_token=secrets.token_urlsafe(24),
                auto_pause=bool(body.get("autoPause", False)),
                create_body=copy.deepcopy(dict(body)),
            )
            self.sandboxes[sandbox.sandbox_id] = sandbox
            return sandbox

    def end(self, sandbox_id: str) -> bool:
        """Make a sandbox gone, as a kill or a reached timeout does."""
        with self.lock:
            self.sweep()
            sandbox = self.sandboxes.pop(sandbox_id, None)
            if sandbox is None:
                return False
            self.ended[sandbox_id] = sandbox
            return True

    def pause(self, sandbox_id: str) -> bool:
        """Pause a running sandbox; False when it already is paused."""
        with self.lock:
            sandbox = self.require(sandbox_id)
            if sandbox.state == "paused":
                return False
            sandbox.state = "paused"
            return True

    def connect(self, sandbox_id: str, timeout: int | None) -> tuple[StandinSandbox, bool]:
        """Resume a paused sandbox or reach a running one; says whether it resumed.

        A running sandbox's end only moves later, as E2B documents for connect."""
        with self.lock:
            sandbox = self.require(sandbox_id)
            now = self.now()
            wanted = now + timedelta(seconds=timeout if timeout is not None else DEFAULT_TIMEOUT_S)
            resumed = sandbox.state == "paused"
            if resumed:
                sandbox.state = "running"
                sandbox.end_at = wanted
            elif timeout is not None and wanted > sandbox.end_at:
                sandbox.end_at = wanted
            if timeout is not None:
                sandbox.timeout = timeout
            return sandbox, resumed

    def set_timeout(self, sandbox_id: str, timeout: int) -> None:
        """Move a sandbox's end to ``timeout`` seconds from now."""
        with self.lock:
            sandbox = self.require(sandbox_id)
            sandbox.timeout = timeout
            sandbox.end_at = self.now() + timedelta(seconds=timeout)

    def require(self, sandbox_id: str) -> StandinSandbox:
        """The live sandbox, or the API's 404 for one that never was or has ended."""
        sandbox = self.find(sandbox_id)
        if sandbox is None:
            raise ApiError(
                404, f"sandbox \"{sandbox_id}\" doesn't exist or you don't have access to it"
            )
        return sandbox

    def record_command(self, call: CommandCall) -> int:
        """Keep a started command on its sandbox and hand out its pid."""
        with self.lock:
            sandbox = self.sandboxes.get(call.sandbox_id)
            if sandbox is not None:
                sandbox.commands.append(call)
            self._next_pid += 1
            return self._next_pid

    def take_fault(self, method: str, path: str) -> Fault | None:
        """The first fault matching this request, counted down; spent faults are dropped."""
        with self.lock:
            for fault in self.faults:
                if not fault.matches(method, path):
                    continue
                if fault.remaining is not None:
                    fault.remaining -= 1
                    if fault.remaining <= 0:
                        self.faults.remove(fault)
                return copy.copy(fault)
            return None

    def snapshot(self, items: Iterable[T]) -> list[T]:
        """Deep copies, taken under the lock, for the test thread."""
        with self.lock:
            return [copy.deepcopy(item) for item in items]


def timeout_from(body: Mapping[str, Any], default: int) -> int:
    timeout = body.get("timeout", default)
    if isinstance(timeout, bool) or not isinstance(timeout, int) or timeout < 0:
        raise ApiError(400, "timeout must be a non-negative integer")
    if timeout > MAX_TIMEOUT_S:
        raise ApiError(400, "Timeout cannot be greater than 24 hours")
    return timeout


def _string_map(value: Any, name: str) -> dict[str, str]:
    if value is None:
        return {}
    if not isinstance(value, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in value.items()
    ):
        raise ApiError(400, f"{name} must be an object of strings")
    return dict(value)
