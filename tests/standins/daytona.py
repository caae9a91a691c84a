"""A protocol-level stand-in for Daytona, for testing corral's daytona provider on loopback.

Daytona's cloud is unreachable from here, and the provider talks to it only through the
official ``daytona`` SDK, so this serves what that SDK sends, on two free 127.0.0.1 ports of
one uvicorn server in a thread:

* the REST API (``api_url``, ``/api/...``): sandbox create, get, list by labels, delete, start,
  stop (:mod:`tests.standins.daytona_api`);
* the toolbox proxy (``toolbox_url``, ``/toolbox/{sandboxId}/...``, which every sandbox names
  as its ``toolboxProxyUrl``): process execute, sessions and their commands, bulk file upload
  and download (:mod:`tests.standins.daytona_toolbox`).

Both check ``Authorization: Bearer <api_key>``. Answers are built with the SDK's generated
models and errors carry Daytona's bodies and status codes. The commands sandboxes are given
really run, as local processes with the sandbox's environment
(:mod:`tests.standins.daytona_host`): a runner started in a sandbox registers and works.

A test points the SDK (or the provider) at ``api_url`` with ``api_key``; it can make requests
fail or hang (``fail_next``, ``delay_next``), move time so auto-stop and auto-delete happen
(``advance``), fail a start or break a sandbox (``fail_next_start``, ``break_sandbox``), and
read back sandboxes, their sessions and every request (``sandboxes``, ``sandbox``,
``sessions``, ``requests``). The SDK's event stream (Socket.IO at ``/api/socket.io``) is
refused: the SDK falls back to polling."""

from __future__ import annotations

import json
import secrets
import shutil
import socket
import tempfile
import threading
import time
from collections.abc import Mapping, MutableMapping
from datetime import timedelta
from pathlib import Path
from types import TracebackType
from typing import Any, Self
from urllib.parse import parse_qs

import uvicorn

from tests.standins.asgi import listen, pause_for, read_body, replay, send_json
from tests.standins.daytona_api import api_error_body, build_api_app
from tests.standins.daytona_host import SandboxHost
from tests.standins.daytona_state import (
    DEFAULT_MESSAGES,
    Fault,
    RecordedRequest,
    StandinSandbox,
    StandinState,
    Surface,
)
from tests.standins.daytona_toolbox import build_toolbox_app, toolbox_error_body

__all__ = ["DaytonaStandin", "Fault", "RecordedRequest", "StandinSandbox"]

REDACTED = "<redacted>"
START_TIMEOUT_S = 5.0
Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]


class _Gateway:
    """The ASGI entry point: log, inject faults, check the bearer token, route by port."""

    def __init__(self, standin: DaytonaStandin) -> None:
        self._standin = standin
        self._state = standin._state
        self._api = build_api_app(standin._state, lambda: standin.toolbox_url)
        self._toolbox = build_toolbox_app(standin._state, standin._host)

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        if scope["type"] == "websocket":
            await self._websocket(scope, receive, send)
            return
        if scope["type"] != "http":  # lifespan is off
            return
        surface: Surface = "api" if scope["server"][1] == self._standin._api_port else "toolbox"
        body = await read_body(receive)
        record = self._record(surface, scope, body)

        async def send_recorded(message: Message) -> None:
            if message["type"] == "http.response.start":
                with self._state.lock:
                    record.status = message["status"]
            await send(message)

        if await self._inject(surface, scope, send_recorded):
            return
        headers = {k.decode().lower(): v.decode() for k, v in scope["headers"]}
        if headers.get("authorization") != f"Bearer {self._standin.api_key}":
            await self._answer(
                send_recorded, surface, scope=scope, status=401, message="Unauthorized", headers={}
            )
            return
        app = self._api if surface == "api" else self._toolbox
        await app(scope, replay(body, receive), send_recorded)

    async def _websocket(self, scope: Scope, receive: Any, send: Any) -> None:
        """A toolbox WebSocket with the API key (a command's logs, followed) goes to the
        toolbox; any other (the SDK's event stream) is refused, so the SDK polls."""
        headers = {k.decode().lower(): v.decode() for k, v in scope["headers"]}
        toolbox = scope["server"][1] == self._standin._toolbox_port
        if toolbox and headers.get("authorization") == f"Bearer {self._standin.api_key}":
            await self._toolbox(scope, receive, send)
            return
        await receive()
        await send({"type": "websocket.close", "code": 1008})

    def _record(self, surface: Surface, scope: Scope, body: bytes) -> RecordedRequest:
        headers = {k.decode().lower(): v.decode() for k, v in scope["headers"]}
        if "authorization" in headers:
            headers["authorization"] = REDACTED
        parsed: Any = body or None
        if body and headers.get("content-type", "").startswith("application/json"):
            try:
                parsed = json.loads(body)
            except ValueError:
                parsed = body
        record = RecordedRequest(
            surface=surface,
            method=scope["method"],
            path=scope["path"],
            query=parse_qs(scope["query_string"].decode(), keep_blank_values=True),
            headers=headers,
            body=parsed,
        )
        with self._state.lock:
            self._state.log.append(record)
        return record

    async def _inject(self, surface: Surface, scope: Scope, send: Any) -> bool:
        """Answer with the matching fault, if any; True when the request is answered."""
        fault = self._state.take_fault(scope["method"], scope["path"])
        if fault is None:
            return False
        await pause_for(fault.delay, self._standin._stopping)
        if fault.status is None:
            return False
        message = fault.message or DEFAULT_MESSAGES.get(fault.status, "Error")
        await self._answer(
            send, surface, scope=scope, status=fault.status, message=message, headers=fault.headers
        )
        return True

    @staticmethod
    async def _answer(
        send: Any,
        surface: Surface,
        *,
        scope: Scope,
        status: int,
        message: str,
        headers: Mapping[str, str],
    ) -> None:
        path = scope["path"]
        if surface == "api":
            body = api_error_body(status, message, path)
        else:
            body = toolbox_error_body(status, message, path, scope["method"], None)
        await send_json(send, status, body, headers)


class DaytonaStandin:
    """Daytona's API and toolbox proxy on loopback, driven through the official SDK.

    ``api_key`` is the only key accepted (a fresh ``dtn_...`` one by default: take it from the
    instance); ``snapshots`` makes other snapshot names a 400 (default: any name is one);
    ``base_env`` is the environment every sandbox's image has (default: ``PATH``);
    ``start_delay_s`` is how long a new sandbox stays ``starting``; ``destroy_delay_s`` how long
    a deleted one stays ``destroying`` (and its name taken); ``root`` holds the sandboxes'
    directories (default: a temporary directory, removed at stop)."""

    def __init__(
        self,
        api_key: str | None = None,
        *,
        snapshots: list[str] | None = None,
        base_env: Mapping[str, str] | None = None,
        start_delay_s: float = 0.0,
        destroy_delay_s: float = 0.0,
        root: Path | None = None,
        host: str = "127.0.0.1",
    ) -> None:
        self.api_key = api_key or f"dtn_{secrets.token_hex(32)}"
        self.host = host
        self._own_root = root is None
        self.root = root or Path(tempfile.mkdtemp(prefix="daytona-standin-"))
        self._host = SandboxHost(self.root, base_env)
        self._state = StandinState(
            snapshots=snapshots,
            start_delay_s=start_delay_s,
            destroy_delay_s=destroy_delay_s,
            on_end=self._host.end,
        )
        self._stopping = threading.Event()
        self._server: uvicorn.Server | None = None
        self._thread: threading.Thread | None = None
        self._sockets: list[socket.socket] = []
        self._api_port = 0
        self._toolbox_port = 0

    # -- lifecycle ---------------------------------------------------------------------------

    def start(self) -> Self:
        """Serve on two free ports; returns once both accept connections."""
        if self._thread is not None:
            raise RuntimeError("the Daytona stand-in is already running")
        self._stopping.clear()
        self._sockets = [listen(self.host), listen(self.host)]
        self._api_port = self._sockets[0].getsockname()[1]
        self._toolbox_port = self._sockets[1].getsockname()[1]
        config = uvicorn.Config(
            _Gateway(self),
            log_config=None,  # leave the test process's logging alone
            log_level="warning",
            access_log=False,
            lifespan="off",
            ws="wsproto",
            timeout_graceful_shutdown=1,
        )
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(
            target=self._server.run,
            kwargs={"sockets": self._sockets},
            name=f"daytona-standin-{self._api_port}",
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
            raise RuntimeError("the Daytona stand-in did not start")
        return self

    def stop(self) -> None:
        """Stop serving: every sandbox process is killed, delays end, the thread and ports go."""
        self._stopping.set()
        self._host.close()
        if self._server is not None:
            self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout=START_TIMEOUT_S)
            if self._thread.is_alive():
                raise RuntimeError("the Daytona stand-in's server thread did not stop")
        for sock in self._sockets:
            sock.close()
        self._server, self._thread, self._sockets = None, None, []
        if self._own_root:
            shutil.rmtree(self.root, ignore_errors=True)

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    # -- where the SDK goes ------------------------------------------------------------------

    @property
    def api_url(self) -> str:
        """The REST API's base URL (the SDK's ``api_url``)."""
        return f"http://{self.host}:{self._port(self._api_port)}/api"

    @property
    def toolbox_url(self) -> str:
        """The toolbox proxy's base URL, every sandbox's ``toolboxProxyUrl``."""
        return f"http://{self.host}:{self._port(self._toolbox_port)}/toolbox"

    def _port(self, port: int) -> int:
        if self._thread is None:
            raise RuntimeError("the Daytona stand-in is not running")
        return port

    def sdk_config(self) -> dict[str, Any]:
        """Keyword arguments of ``daytona.DaytonaConfig`` that send every call here."""
        return {"api_key": self.api_key, "api_url": self.api_url}

    # -- behaviour ---------------------------------------------------------------------------

    def fail_next(
        self,
        status: int,
        *,
        times: int | None = 1,
        method: str | None = None,
        path: str | None = None,
        message: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        """Answer the next ``times`` requests (None: until :meth:`clear_faults`) matching
        ``method`` and the ``path`` prefix (``/api/...`` or ``/toolbox/...``) with ``status``
        and Daytona's error body for it. The SDK retries none of them itself."""
        self._add_fault(Fault(status, 0.0, times, method, path, message, dict(headers or {})))

    def delay_next(
        self,
        seconds: float,
        *,
        times: int | None = 1,
        method: str | None = None,
        path: str | None = None,
        status: int | None = None,
    ) -> None:
        """Hold the next matching requests for ``seconds`` (cut short by :meth:`stop`), then
        answer normally, or with ``status`` and Daytona's error body."""
        self._add_fault(Fault(status, seconds, times, method, path))

    def _add_fault(self, fault: Fault) -> None:
        if fault.remaining is not None and fault.remaining < 1:
            raise ValueError("times must be at least 1 (or None for until cleared)")
        with self._state.lock:
            self._state.faults.append(fault)

    def clear_faults(self) -> None:
        """Drop every injected fault that has not been used up."""
        with self._state.lock:
            self._state.faults.clear()

    def advance(self, seconds: float) -> None:
        """Move the stand-in's clock: auto-stop and auto-delete intervals pass without sleeping."""
        with self._state.lock:
            self._state.offset += timedelta(seconds=seconds)
            self._state.sweep()

    def fail_next_start(self, reason: str) -> None:
        """The next sandbox made ends its start in Daytona's ``error`` state with ``reason``."""
        with self._state.lock:
            self._state.start_failures.append(reason)

    def break_sandbox(self, id_or_name: str, reason: str) -> None:
        """Put a sandbox in Daytona's ``error`` state, as a failed runner host would."""
        with self._state.lock:
            sandbox = self._state.require(id_or_name)
            sandbox.state, sandbox.error_reason = "error", reason
            self._host.end(sandbox.id)

    # -- inspection --------------------------------------------------------------------------

    def sandboxes(self) -> dict[str, StandinSandbox]:
        """Copies of the sandboxes Daytona still has (not destroyed), by id."""
        with self._state.lock:
            self._state.sweep()
            return {s.id: s for s in self._state.snapshot(self._state.sandboxes.values())}

    def sandbox(self, id_or_name: str) -> StandinSandbox:
        """A copy of one sandbox, destroyed ones included, by id or name."""
        with self._state.lock:
            self._state.sweep()
            everything = [*self._state.sandboxes.values(), *self._state.destroyed.values()]
            for found in everything:
                if id_or_name in (found.id, found.name):
                    return self._state.snapshot([found])[0]
        raise KeyError(id_or_name)

    def destroyed(self) -> list[str]:
        """Ids of the sandboxes deleted and gone, oldest first."""
        with self._state.lock:
            self._state.sweep()
            return list(self._state.destroyed)

    def state_file_sizes_as(self, size: int | None) -> None:
        """From now on ``files/info`` says every file is ``size`` bytes (None: the truth)."""
        self._host.stated_size = size

    def sessions(self, sandbox_id: str) -> dict[str, list[tuple[str, int | None]]]:
        """The sandbox's sessions: each command's line and exit code (None: still running)."""
        return {
            session: [
                (run.command, run.exit_code) for run in self._host.session(sandbox_id, session)
            ]
            for session in self._host.session_ids(sandbox_id)
        }

    def output(self, sandbox_id: str, session: str) -> str:
        """What the session's commands printed (stdout and stderr as they came)."""
        return "".join(run.logs()[0] for run in self._host.session(sandbox_id, session))

    def requests(
        self, *, method: str | None = None, path: str | None = None, surface: Surface | None = None
    ) -> list[RecordedRequest]:
        """Copies of the requests seen so far, optionally by method, path prefix and surface."""
        with self._state.lock:
            return [
                r
                for r in self._state.snapshot(self._state.log)
                if (method is None or r.method == method.upper())
                and (path is None or r.path.startswith(path))
                and (surface is None or r.surface == surface)
            ]

    def clear_requests(self) -> None:
        with self._state.lock:
            self._state.log.clear()
