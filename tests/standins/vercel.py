"""A protocol-level stand-in for the Vercel Sandbox API, for testing corral's vercel provider
on loopback.

Vercel's API is unreachable from here, and the provider talks to it only through the official
``vercel-sandbox`` SDK, so this serves what that SDK (0.10, ``vercel.sandbox.sync``) sends, on
one free 127.0.0.1 port of a uvicorn server in a thread (the routes: ``vercel_app``):

* auth as Vercel's REST API does it: ``Authorization: Bearer <token>`` and ``?teamId=``; a
  missing or wrong token, or another team, is a 403 with Vercel's error body
  (``{"error": {"code": "forbidden", "message": ..., "invalidToken": true}}``);
* named sandboxes with tags (at most five), the project's list filtered by one tag, destroy;
* runtime sessions that run commands for real: a command is a local subprocess with the
  sandbox's environment (the create body's ``env``, then the command's), its working directory
  mapped into the sandbox's directory here (``vercel_processes``), so corral's runner started
  detached really registers with the control plane and completes its item;
* the files API (gzipped tar in, bytes out) on that directory.

Point the SDK at it with ``SandboxServiceOptions(base_url=standin.base_url, ...)`` and
``SandboxCredentials(standin.token, standin.team_id, standin.project_id)``.

A test can make requests fail or hang (``fail_next``/``delay_next``), end a sandbox's session
as its timeout would (``finish``), and read back the sandboxes, their commands and every
request (``sandboxes``/``sandbox``/``requests``/``requests_containing``)."""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import socket
import tempfile
import threading
import time
from collections.abc import Mapping, MutableMapping
from pathlib import Path
from types import TracebackType
from typing import Any, Self
from urllib.parse import parse_qs

import uvicorn

from tests.standins.asgi import listen, read_body, replay, send_json
from tests.standins.vercel_app import build_app
from tests.standins.vercel_processes import Command
from tests.standins.vercel_state import (
    ApiError,
    Fault,
    RecordedRequest,
    StandinSandbox,
    StandinState,
)

__all__ = ["Command", "Fault", "RecordedRequest", "StandinSandbox", "VercelStandin"]

REDACTED = "<redacted>"
START_TIMEOUT_S = 5.0
Scope = MutableMapping[str, Any]


async def _send_error(send: Any, error: ApiError, extra: Mapping[str, Any] | None = None) -> None:
    body = error.body()
    body["error"].update(extra or {})
    await send_json(send, error.status, body)


class _Gateway:
    """The ASGI entry point: record, inject faults, check token and team, then route."""

    def __init__(self, standin: VercelStandin, app: Any) -> None:
        self._standin = standin
        self._state = standin._state
        self._app = app

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        if scope["type"] != "http":  # lifespan is off and websockets are not served
            return
        body = await read_body(receive)
        record = self._record(scope, body)

        async def send_recorded(message: MutableMapping[str, Any]) -> None:
            if message["type"] == "http.response.start":
                with self._state.lock:
                    record.status = message["status"]
            await send(message)

        if await self._inject(scope, send_recorded):
            return
        refusal = self._refusal(scope)
        if refusal is not None:
            await _send_error(send_recorded, *refusal)
            return
        await self._app(scope, replay(body, receive), send_recorded)

    def _record(self, scope: Scope, body: bytes) -> RecordedRequest:
        headers = {k.decode().lower(): v.decode() for k, v in scope["headers"]}
        if "authorization" in headers:
            headers["authorization"] = REDACTED
        content_type = headers.get("content-type", "")
        decoded: Any = body
        if body and content_type.startswith("application/json"):
            try:
                decoded = json.loads(body)
            except ValueError:
                decoded = body
        record = RecordedRequest(
            method=scope["method"],
            path=scope["path"],
            query=parse_qs(scope["query_string"].decode(), keep_blank_values=True),
            headers=headers,
            body=decoded if body else None,
        )
        with self._state.lock:
            self._state.log.append(record)
        return record

    async def _inject(self, scope: Scope, send: Any) -> bool:
        fault = self._state.take_fault(scope["method"], scope["path"])
        if fault is None:
            return False
        await self._standin._pause(fault.delay)
        if fault.status is None:
            return False
        error = ApiError(fault.status, fault.message, fault.code)
        await send_json(send, fault.status, error.body(), fault.headers)
        return True

    def _refusal(self, scope: Scope) -> tuple[ApiError, dict[str, Any]] | None:
        """Vercel's answer to a request without the right token or team, if it gets one."""
        headers = dict(scope["headers"])
        authorization = headers.get(b"authorization", b"").decode()
        if not authorization.startswith("Bearer ") or not authorization[7:]:
            message = "The request is missing an authentication token"
            return ApiError(403, message, "forbidden"), {"missingToken": True}
        if not secrets.compare_digest(authorization[7:], self._standin.token):
            return ApiError(403, "Not authorized", "forbidden"), {"invalidToken": True}
        team = parse_qs(scope["query_string"].decode()).get("teamId", [""])[0]
        if team != self._state.team_id:
            return ApiError(403, "You don't have permission to access this team"), {}
        return None


class VercelStandin:
    """The Vercel Sandbox API on loopback, driven through the official SDK.

    ``token`` is the only access token it accepts (a fresh one by default), for team
    ``team_id`` and project ``project_id``. ``base_env`` starts every command's environment
    (this host's ``PATH`` by default; ``PYTHONPATH`` for a runner from a source tree);
    ``boot_s`` keeps a new sandbox ``pending`` that long (the SDK polls until ``running``)."""

    def __init__(
        self,
        token: str | None = None,
        *,
        team_id: str = "team_corral",
        project_id: str = "prj_corral",
        base_env: Mapping[str, str] | None = None,
        boot_s: float = 0.0,
        workdir: Path | None = None,
        host: str = "127.0.0.1",
    ) -> None:
        self.token = token or f"vcp_{secrets.token_hex(20)}"
        self.host = host
        self._tmp = None if workdir else tempfile.TemporaryDirectory(prefix="vercel-standin-")
        root = workdir or Path(self._tmp.name if self._tmp else ".")
        self._state = StandinState(
            team_id=team_id, project_id=project_id, workdir=root, boot_s=boot_s
        )
        self.base_env = dict(base_env or {"PATH": os.environ.get("PATH", "/usr/bin:/bin")})
        self._stopping = threading.Event()
        self._server: uvicorn.Server | None = None
        self._thread: threading.Thread | None = None
        self._socket: socket.socket | None = None

    @property
    def team_id(self) -> str:
        return self._state.team_id

    @property
    def project_id(self) -> str:
        return self._state.project_id

    # -- lifecycle ---------------------------------------------------------------------------

    def start(self) -> Self:
        """Serve on a free port; returns once it accepts connections."""
        if self._thread is not None:
            raise RuntimeError("the Vercel stand-in is already running")
        self._stopping.clear()
        self._socket = listen(self.host)
        app = build_app(self._state, self.base_env, self._stopping)
        config = uvicorn.Config(
            _Gateway(self, app),
            log_config=None,  # leave the test process's logging alone
            log_level="warning",
            access_log=False,
            lifespan="off",
            ws="none",
            timeout_graceful_shutdown=1,
        )
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(
            target=self._server.run,
            kwargs={"sockets": [self._socket]},
            name=f"vercel-standin-{self._socket.getsockname()[1]}",
            daemon=True,
        )
        self._thread.start()
        deadline = time.monotonic() + START_TIMEOUT_S
        while not self._server.started and self._thread.is_alive():
            if time.monotonic() > deadline:
                break
            time.sleep(0.002)
        if not self._server.started:
            self.stop()
            raise RuntimeError("the Vercel stand-in did not start")
        return self

    def stop(self) -> None:
        """Stop serving and end every command still running (they are this process's)."""
        self._stopping.set()
        if self._server is not None:
            self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout=START_TIMEOUT_S)
        if self._socket is not None:
            self._socket.close()
        self._server, self._thread, self._socket = None, None, None
        with self._state.lock:
            live = list(self._state.sandboxes.values())
        for sandbox in live:
            self._state.stop_session(sandbox.session)
        if self._tmp is not None:
            self._tmp.cleanup()

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    async def _pause(self, seconds: float) -> None:
        deadline = time.monotonic() + seconds
        while not self._stopping.is_set() and (left := deadline - time.monotonic()) > 0:
            await asyncio.sleep(min(left, 0.05))

    # -- where the SDK goes ------------------------------------------------------------------

    @property
    def base_url(self) -> str:
        """The API's base URL (the SDK's ``SandboxServiceOptions(base_url=...)``)."""
        if self._socket is None:
            raise RuntimeError("the Vercel stand-in is not running")
        return f"http://{self.host}:{self._socket.getsockname()[1]}"

    # -- behaviour ---------------------------------------------------------------------------

    def fail_next(
        self,
        status: int,
        *,
        times: int | None = 1,
        method: str | None = None,
        path: str | None = None,
        code: str | None = None,
        message: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        """Answer the next ``times`` requests (None: until :meth:`clear_faults`) matching
        ``method`` and the ``path`` prefix with ``status`` and Vercel's error body."""
        fault = Fault(status, 0.0, times, method, path, code, message, dict(headers or {}))
        self._add_fault(fault)

    def delay_next(
        self,
        seconds: float,
        *,
        times: int | None = 1,
        method: str | None = None,
        path: str | None = None,
        status: int | None = None,
    ) -> None:
        """Hold the next matching requests ``seconds`` (cut short by :meth:`stop`), then
        answer normally, or with ``status`` and Vercel's error body."""
        self._add_fault(Fault(status, seconds, times, method, path))

    def _add_fault(self, fault: Fault) -> None:
        if fault.remaining is not None and fault.remaining < 1:
            raise ValueError("times must be at least 1 (or None for until cleared)")
        with self._state.lock:
            self._state.faults.append(fault)

    def clear_faults(self) -> None:
        with self._state.lock:
            self._state.faults.clear()

    def destroy_all(self) -> None:
        """Destroy every sandbox, ending what runs in them (between tests)."""
        with self._state.lock:
            live = list(self._state.sandboxes.values())
        for sandbox in live:
            self._state.destroy(sandbox)

    def finish(self, name: str) -> None:
        """Stop a sandbox's session as its execution time limit would (it stays, stopped)."""
        sandbox = self._state.sandbox(name, None)
        self._state.stop_session(sandbox.session)

    # -- inspection --------------------------------------------------------------------------

    def sandboxes(self) -> dict[str, StandinSandbox]:
        """Copies of the sandboxes that exist (running or stopped, not destroyed) by name."""
        self._state.sweep()
        with self._state.lock:
            return {s.name: s for s in self._state.snapshot(list(self._state.sandboxes.values()))}

    def sandbox(self, name: str) -> StandinSandbox:
        """A copy of one sandbox, existing or destroyed."""
        with self._state.lock:
            found = self._state.sandboxes.get(name) or self._state.destroyed.get(name)
            if found is None:
                raise KeyError(name)
            copied: StandinSandbox = self._state.snapshot([found])[0]
            return copied

    def destroyed(self) -> list[str]:
        with self._state.lock:
            return list(self._state.destroyed)

    def requests(self, *, method: str | None = None, path: str | None = None) -> list[Any]:
        """Copies of the requests seen so far, optionally by method and path prefix."""
        with self._state.lock:
            return [
                r
                for r in self._state.snapshot(self._state.log)
                if (method is None or r.method == method.upper())
                and (path is None or r.path.startswith(path))
            ]

    def requests_containing(self, text: str) -> list[RecordedRequest]:
        """The requests whose path, query, headers or body carry ``text``."""
        return [
            r
            for r in self.requests()
            if text in f"{r.path} {r.query} {r.headers}"
            or text
            in (r.body.decode(errors="replace") if isinstance(r.body, bytes) else str(r.body))
        ]

    def clear_requests(self) -> None:
        with self._state.lock:
            self._state.log.clear()
