"""The state behind the Daytona stand-in: its sandboxes and their lifecycle, the faults it was
told to inject and the requests it saw.

The server's threads write it while the test thread reads it, so every access goes through
one lock, and what a test gets back is a copy it cannot race with. What runs inside the
sandboxes (processes, files) is :mod:`tests.standins.daytona_host`'s."""

from __future__ import annotations

import copy
import threading
import uuid
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any, Literal, TypeVar

from daytona_api_client.models import CreateSandbox

ORGANIZATION_ID = "5b1d3b7e-3c0a-4f5e-9a8e-6c1f0d2b7a41"
TARGET = "us"
USER = "daytona"
DEFAULT_SNAPSHOT = "daytonaio/sandbox:0.5.0"  # what Daytona uses when a create names none
DEFAULT_CPU, DEFAULT_MEMORY_GIB, DEFAULT_DISK_GIB = 1, 1, 3
DEFAULT_AUTO_STOP_MIN = 15
DEFAULT_AUTO_ARCHIVE_MIN = 7 * 24 * 60
DAEMON_VERSION = "0.5.0"

# The messages Daytona's API answers with (its Nest exception filter's ``message``).
DEFAULT_MESSAGES: dict[int, str] = {
    400: "Bad Request",
    401: "Unauthorized",
    403: "Forbidden resource",
    404: "Not Found",
    408: "Request Timeout",
    409: "Conflict",
    429: "ThrottlerException: Too Many Requests",
    500: "Internal server error",
    502: "Bad Gateway",
    503: "Service Unavailable",
    504: "Gateway Timeout",
}

T = TypeVar("T")
Surface = Literal["api", "toolbox"]


class ApiError(Exception):
    """An answer rendered as Daytona's error body (API or toolbox, by surface)."""

    def __init__(self, status: int, message: str, code: str | None = None) -> None:
        super().__init__(f"{status}: {message}")
        self.status = status
        self.message = message
        self.code = code  # the daemon's error code (toolbox only)


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
        if self.method is not None and self.method.upper() != method.upper():
            return False
        return self.path_prefix is None or path.startswith(self.path_prefix)


@dataclass
class RecordedRequest:
    """One request as it reached the stand-in; the bearer token's value is never kept."""

    surface: Surface
    method: str
    path: str
    query: dict[str, list[str]]
    headers: dict[str, str]  # lower-case names; authorization is "<redacted>"
    body: Any  # parsed JSON, raw bytes (multipart), or None
    status: int | None = None  # the status answered, once sent


@dataclass
class StandinSandbox:
    """A sandbox as the stand-in holds it: the create request's fields plus its lifecycle."""

    id: str
    name: str
    snapshot: str | None
    dockerfile: str | None  # an image-based sandbox's build
    env: dict[str, str]
    labels: dict[str, str]
    public: bool
    target: str
    cpu: int
    gpu: int
    memory: int
    disk: int
    auto_stop_interval: int
    auto_archive_interval: int
    auto_delete_interval: int
    network_block_all: bool
    network_allow_list: str | None
    domain_allow_list: str | None
    create_body: dict[str, Any]
    created_at: datetime
    started_at: datetime  # when "starting" turns into "started"
    last_activity_at: datetime
    state: str = "starting"
    error_reason: str | None = None
    start_error: str | None = None  # set: the start ends in "error" with this reason
    stopped_at: datetime | None = None
    destroy_at: datetime | None = None  # while "destroying"


def _stamp(moment: datetime) -> str:
    return moment.astimezone(UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


class StandinState:
    """Sandboxes, faults and the request log, behind one lock.

    Time is the wall clock plus ``offset``: a test moves past an auto-stop interval without
    sleeping, and the next look at the sandboxes applies it (stop, then delete when the
    auto-delete interval says so), as Daytona does on its own. ``on_end`` is told each
    sandbox whose processes must go (stopped or deleted)."""

    def __init__(
        self,
        *,
        snapshots: Iterable[str] | None,
        start_delay_s: float,
        destroy_delay_s: float,
        on_end: Callable[[str], None],
    ) -> None:
        self.lock = threading.RLock()
        self.snapshots = set(snapshots) if snapshots is not None else None
        self.start_delay = timedelta(seconds=start_delay_s)
        self.destroy_delay = timedelta(seconds=destroy_delay_s)
        self.on_end = on_end
        self.offset = timedelta()
        self.sandboxes: dict[str, StandinSandbox] = {}
        self.destroyed: dict[str, StandinSandbox] = {}
        self.faults: list[Fault] = []
        self.start_failures: list[str] = []  # reasons the next starts fail with, in order
        self.log: list[RecordedRequest] = []

    def now(self) -> datetime:
        return datetime.now(UTC) + self.offset

    # -- lifecycle -------------------------------------------------------------------------

    def create(self, body: Mapping[str, Any]) -> StandinSandbox:
        """A sandbox from a ``POST /api/sandbox`` body, checked against the SDK's own model."""
        try:
            request = CreateSandbox.from_dict(dict(body))
        except ValueError as exc:
            raise ApiError(400, f"invalid request body: {exc}") from exc
        assert request is not None
        with self.lock:
            self.sweep()
            name = request.name or ""
            if name and self._by_name(name) is not None:
                raise ApiError(409, f"Sandbox with name {name} already exists")
            sandbox = self._new(request, body)
            if self.start_failures:
                sandbox.start_error = self.start_failures.pop(0)
            self.sandboxes[sandbox.id] = sandbox
            return sandbox

    def _new(self, request: CreateSandbox, body: Mapping[str, Any]) -> StandinSandbox:
        snapshot, dockerfile = self._source(request)
        now = self.now()
        sandbox_id = str(uuid.uuid4())
        auto_delete = request.auto_delete_interval
        return StandinSandbox(
            id=sandbox_id,
            name=request.name or sandbox_id,
            snapshot=snapshot,
            dockerfile=dockerfile,
            env=dict(request.env or {}),
            labels=dict(request.labels or {}),
            public=bool(request.public),
            target=request.target or TARGET,
            cpu=request.cpu or DEFAULT_CPU,
            gpu=request.gpu or 0,
            memory=request.memory or DEFAULT_MEMORY_GIB,
            disk=request.disk or DEFAULT_DISK_GIB,
            auto_stop_interval=_interval(request.auto_stop_interval, DEFAULT_AUTO_STOP_MIN),
            auto_archive_interval=_interval(
                request.auto_archive_interval, DEFAULT_AUTO_ARCHIVE_MIN
            ),
            auto_delete_interval=-1 if auto_delete is None else auto_delete,
            network_block_all=bool(request.network_block_all),
            network_allow_list=request.network_allow_list,
            domain_allow_list=request.domain_allow_list,
            create_body=copy.deepcopy(dict(body)),
            created_at=now,
            started_at=now + self.start_delay,
            last_activity_at=now,
            state="pending_build" if dockerfile else "starting",
        )

    def _source(self, request: CreateSandbox) -> tuple[str | None, str | None]:
        if request.build_info is not None:
            if request.snapshot:
                raise ApiError(400, "Cannot specify both snapshot and buildInfo")
            return None, request.build_info.dockerfile_content
        snapshot = request.snapshot or DEFAULT_SNAPSHOT
        if self.snapshots is not None and snapshot not in self.snapshots | {DEFAULT_SNAPSHOT}:
            raise ApiError(400, f"Snapshot {snapshot} not found. Did you add it?")
        return snapshot, None

    def sweep(self) -> None:
        """Apply what time did: starts finished, idle sandboxes stopped, stopped ones
        deleted, deleted ones gone."""
        with self.lock:
            now = self.now()
            for sandbox in list(self.sandboxes.values()):
                self._advance(sandbox, now)

    def _advance(self, sandbox: StandinSandbox, now: datetime) -> None:
        if sandbox.state in ("starting", "pending_build") and now >= sandbox.started_at:
            sandbox.state = "error" if sandbox.start_error else "started"
            sandbox.error_reason = sandbox.start_error
            sandbox.last_activity_at = now
        idle = now - sandbox.last_activity_at
        stop_after = timedelta(minutes=sandbox.auto_stop_interval)
        if sandbox.state == "started" and sandbox.auto_stop_interval > 0 and idle >= stop_after:
            self.stop(sandbox, now)
        if sandbox.state == "stopped" and sandbox.auto_delete_interval >= 0:
            assert sandbox.stopped_at is not None
            if now - sandbox.stopped_at >= timedelta(minutes=sandbox.auto_delete_interval):
                self.delete(sandbox, now)
        if sandbox.state == "destroying" and sandbox.destroy_at and now >= sandbox.destroy_at:
            sandbox.state = "destroyed"
            self.destroyed[sandbox.id] = self.sandboxes.pop(sandbox.id)

    def stop(self, sandbox: StandinSandbox, now: datetime) -> None:
        """Stop it: its processes end (and an ephemeral one is deleted)."""
        sandbox.state, sandbox.stopped_at = "stopped", now
        self.on_end(sandbox.id)
        if sandbox.auto_delete_interval == 0:
            self.delete(sandbox, now)

    def delete(self, sandbox: StandinSandbox, now: datetime) -> None:
        """Delete it: destroying for ``destroy_delay_s``, then gone (a 404)."""
        if sandbox.state in ("destroying", "destroyed"):
            return
        self.on_end(sandbox.id)
        sandbox.state, sandbox.destroy_at = "destroying", now + self.destroy_delay
        self._advance(sandbox, now)

    def start(self, sandbox: StandinSandbox) -> None:
        if sandbox.state in ("destroying", "destroyed", "error"):
            raise ApiError(400, f"Sandbox is in state {sandbox.state} and cannot be started")
        if sandbox.state == "stopped":
            now = self.now()
            sandbox.state, sandbox.stopped_at = "starting", None
            sandbox.started_at, sandbox.last_activity_at = now + self.start_delay, now
            self._advance(sandbox, now)

    def touch(self, sandbox: StandinSandbox) -> None:
        """Record an event on the sandbox, which holds its auto-stop off."""
        sandbox.last_activity_at = self.now()

    # -- lookups ---------------------------------------------------------------------------

    def _by_name(self, name: str) -> StandinSandbox | None:
        return next((s for s in self.sandboxes.values() if s.name == name), None)

    def find(self, id_or_name: str) -> StandinSandbox | None:
        """The sandbox with this id, else this name, that Daytona still has."""
        with self.lock:
            self.sweep()
            return self.sandboxes.get(id_or_name) or self._by_name(id_or_name)

    def require(self, id_or_name: str) -> StandinSandbox:
        sandbox = self.find(id_or_name)
        if sandbox is None:
            raise ApiError(404, f"Sandbox with ID or name {id_or_name} not found")
        return sandbox

    def listed(self, labels: Mapping[str, str]) -> list[StandinSandbox]:
        """Every sandbox Daytona still has whose labels include ``labels``, oldest first."""
        with self.lock:
            self.sweep()
            return [
                s
                for s in sorted(self.sandboxes.values(), key=lambda s: s.created_at)
                if all(s.labels.get(k) == v for k, v in labels.items())
            ]

    # -- faults and copies -----------------------------------------------------------------

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


def _interval(value: int | None, default: int) -> int:
    return default if value is None else value


def sandbox_fields(sandbox: StandinSandbox, toolbox_url: str) -> dict[str, Any]:
    """The fields the ``Sandbox`` and ``SandboxListItem`` models share, by attribute name."""
    return {
        "id": sandbox.id,
        "organization_id": ORGANIZATION_ID,
        "name": sandbox.name,
        "snapshot": sandbox.snapshot,
        "user": USER,
        "labels": dict(sandbox.labels),
        "public": sandbox.public,
        "network_block_all": sandbox.network_block_all,
        "network_allow_list": sandbox.network_allow_list,
        "domain_allow_list": sandbox.domain_allow_list,
        "target": sandbox.target,
        "cpu": sandbox.cpu,
        "gpu": sandbox.gpu,
        "memory": sandbox.memory,
        "disk": sandbox.disk,
        "state": sandbox.state,
        "desired_state": _desired(sandbox.state),
        "error_reason": sandbox.error_reason,
        "recoverable": False if sandbox.state == "error" else None,
        "backup_state": "None",
        "auto_stop_interval": sandbox.auto_stop_interval,
        "auto_pause_interval": 0,
        "auto_archive_interval": sandbox.auto_archive_interval,
        "auto_delete_interval": sandbox.auto_delete_interval,
        "created_at": _stamp(sandbox.created_at),
        "updated_at": _stamp(sandbox.last_activity_at),
        "last_activity_at": _stamp(sandbox.last_activity_at),
        "daemon_version": DAEMON_VERSION,
        "toolbox_proxy_url": toolbox_url,
    }


def _desired(state: str) -> str:
    if state in ("destroying", "destroyed"):
        return "destroyed"
    if state in ("stopping", "stopped"):
        return "stopped"
    return "started"
