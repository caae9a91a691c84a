"""A protocol-level stand-in for E2B's cloud, for testing corral's e2b provider on loopback.

E2B's API and sandbox proxy are unreachable from here, and the provider talks to them only
through the official ``e2b`` SDK, so this serves what that SDK (2.x, synchronous
``e2b.Sandbox``) sends, on two free 127.0.0.1 ports of one uvicorn server in a thread:

* the REST API (``api_url``): create, info, list by metadata, kill, pause, connect/resume and
  timeout updates, checking ``X-API-KEY`` (``e2b_rest``);
* the sandbox proxy and envd (``sandbox_url``): ``/health`` and the Connect
  ``process.Process/Start`` stream that ``sandbox.commands.run`` opens (``e2b_envd``).

Point the SDK at it with ``Sandbox.create(..., **standin.sdk_kwargs())``: ``api_url`` and
``sandbox_url`` are the SDK's own overrides (``ConnectionConfig``), plain http, and
``debug=False`` keeps an ``E2B_DEBUG`` in the environment from skipping the API.

A test can decide what commands print (``on_command``), make requests fail or hang
(``fail_next``/``delay_next``), end sandboxes (``finish``) or move time (``advance``), and read
back the sandboxes and every request (``sandboxes``/``requests``)."""

from __future__ import annotations

import json
import secrets
import socket
import threading
import time
import uuid
from collections.abc import Callable, Mapping, MutableMapping
from datetime import timedelta
from types import TracebackType
from typing import Any, Self
from urllib.parse import parse_qs

import uvicorn

from tests.standins.asgi import listen, read_body, replay
from tests.standins.e2b_envd import (
    Receive,
    Scope,
    Send,
    build_envd_app,
    default_command_handler,
    pause_for,
    send_json,
)
from tests.standins.e2b_rest import build_api_app
from tests.standins.e2b_state import (
    API_KEY_INVALID,
    API_KEY_MISSING,
    DEFAULT_MESSAGES,
    ENVD_UNAUTHORIZED,
    PROXY_SANDBOX_NOT_FOUND,
    CommandCall,
    CommandHandler,
    CommandOutcome,
    Fault,
    RecordedRequest,
    StandinSandbox,
    StandinState,
    Surface,
)

__all__ = [
    "CommandCall",
    "CommandHandler",
    "CommandOutcome",
    "E2BStandin",
    "Fault",
    "RecordedRequest",
    "StandinSandbox",
]

DEFAULT_ENVD_VERSION = "0.6.4"  # new enough for every feature gate of the SDK it was built on
REDACTED = "<redacted>"
START_TIMEOUT_S = 5.0


def _decode_body(content_type: str, body: bytes) -> Any:
    """JSON as parsed JSON, a Connect request as its (first) JSON message, else bytes."""
    if not body:
        return None
    try:
        if content_type.startswith("application/connect+json"):
            # Envelope: 1 flag byte, 4-byte big-endian length, then the JSON message.
            return json.loads(body[5 : 5 + int.from_bytes(body[1:5], "big")])
        if content_type.startswith("application/json"):
            return json.loads(body)
    except ValueError:
        return body
    return body


class _Gateway:
    """The ASGI entry point: log, inject faults, check the API key, route by listening port."""

    def __init__(
        self,
        state: StandinState,
        *,
        api_key: Callable[[], str],
        api_port: int,
        handler: Callable[[], CommandHandler],
        stopping: threading.Event,
    ) -> None:
        self._state = state
        self._api_key = api_key
        self._api_port = api_port
        self._stopping = stopping
        self._api = build_api_app(state)
        self._envd = build_envd_app(state, handler, stopping)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":  # lifespan is off and websockets are not served
            return
        surface: Surface = "api" if scope["server"][1] == self._api_port else "envd"
        body = await read_body(receive)
        record = self._record(surface, scope, body)

        async def send_recorded(message: MutableMapping[str, Any]) -> None:
            if message["type"] == "http.response.start":
                with self._state.lock:
                    record.status = message["status"]
            await send(message)

        if await self._inject(surface, scope, send_recorded):
            return
        if surface == "envd":
            await self._envd(scope, replay(body, receive), send_recorded)
            return
        headers = dict(scope["headers"])
        key = headers.get(b"x-api-key", b"").decode()
        if key != self._api_key():
            message = API_KEY_INVALID if key else API_KEY_MISSING
            await send_json(send_recorded, 401, {"code": 401, "message": message})
            return
        await self._api(scope, replay(body, receive), send_recorded)

    def _record(self, surface: Surface, scope: Scope, body: bytes) -> RecordedRequest:
        headers = {k.decode().lower(): v.decode() for k, v in scope["headers"]}
        if "x-api-key" in headers:
            headers["x-api-key"] = REDACTED
        record = RecordedRequest(
            surface=surface,
            method=scope["method"],
            path=scope["path"],
            query=parse_qs(scope["query_string"].decode(), keep_blank_values=True),
            headers=headers,
            body=_decode_body(headers.get("content-type", ""), body),
        )
        with self._state.lock:
            self._state.log.append(record)
        return record

    async def _inject(self, surface: Surface, scope: Scope, send: Send) -> bool:
        """Answer with the matching fault, if any; True when the request is answered."""
        fault = self._state.take_fault(scope["method"], scope["path"])
        if fault is None:
            return False
        await pause_for(fault.delay, self._stopping)
        if fault.status is None:
            return False
        body: dict[str, Any] = {"code": fault.status, "message": _fault_message(surface, fault)}
        if surface == "envd" and fault.status == 502:
            headers = {k.decode().lower(): v.decode() for k, v in scope["headers"]}
            body = {"sandboxId": headers.get("e2b-sandbox-id", ""), **body}
        await send_json(send, fault.status, body, fault.headers)
        return True


def _fault_message(surface: Surface, fault: Fault) -> str:
    if fault.message is not None:
        return fault.message
    if surface == "envd" and fault.status == 401:
        return ENVD_UNAUTHORIZED
    if surface == "envd" and fault.status == 502:
        return PROXY_SANDBOX_NOT_FOUND
    return DEFAULT_MESSAGES.get(fault.status or 500, "Error")


class E2BStandin:
    """E2B's API and sandbox proxy on loopback, driven through the official SDK.

    ``api_key`` is the only key the API accepts (a fresh ``e2b_...`` one by default, so tests
    take it from :meth:`sdk_kwargs` rather than hard-coding it);
    ``templates`` maps names to template IDs and makes other names a 404 (default: any
    name is a template whose ID is the name); ``command_handler`` decides what commands do
    (default: :func:`~tests.standins.e2b_envd.default_command_handler`)."""

    def __init__(
        self,
        api_key: str | None = None,
        *,
        envd_version: str = DEFAULT_ENVD_VERSION,
        templates: Mapping[str, str] | None = None,
        command_handler: CommandHandler | None = None,
        host: str = "127.0.0.1",
    ) -> None:
        self.api_key = api_key or f"e2b_{secrets.token_hex(20)}"
        self.host = host
        self._state = StandinState(envd_version=envd_version, templates=templates)
        self._handler: CommandHandler = command_handler or default_command_handler
        self._stopping = threading.Event()
        self._server: uvicorn.Server | None = None
        self._thread: threading.Thread | None = None
        self._sockets: list[socket.socket] = []
        self._api_port = 0
        self._envd_port = 0

    # -- lifecycle ---------------------------------------------------------------------------

    def start(self) -> Self:
        """Serve on two free ports; returns once both accept connections."""
        if self._thread is not None:
            raise RuntimeError("the E2B stand-in is already running")
        self._stopping.clear()
        self._sockets = [listen(self.host), listen(self.host)]
        self._api_port = self._sockets[0].getsockname()[1]
        self._envd_port = self._sockets[1].getsockname()[1]
        gateway = _Gateway(
            self._state,
            api_key=lambda: self.api_key,
            api_port=self._api_port,
            handler=lambda: self._handler,
            stopping=self._stopping,
        )
        config = uvicorn.Config(
            gateway,
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
            kwargs={"sockets": self._sockets},
            name=f"e2b-standin-{self._api_port}",
            daemon=True,
        )
        self._thread.start()
        self._wait_started()
        return self

    def _wait_started(self) -> None:
        assert self._server is not None and self._thread is not None
        deadline = time.monotonic() + START_TIMEOUT_S
        while not self._server.started and self._thread.is_alive():
            if time.monotonic() > deadline:
                break
            time.sleep(0.002)
        if not self._server.started:
            self.stop()
            raise RuntimeError("the E2B stand-in did not start")

    def stop(self) -> None:
        """Stop serving: pending delays end, connections close, the thread and ports go."""
        self._stopping.set()
        if self._server is not None:
            self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout=START_TIMEOUT_S)
            if self._thread.is_alive():
                raise RuntimeError("the E2B stand-in's server thread did not stop")
        for sock in self._sockets:
            sock.close()
        self._server, self._thread, self._sockets = None, None, []

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
        return f"http://{self.host}:{self._port(self._api_port)}"

    @property
    def sandbox_url(self) -> str:
        """envd's base URL for every sandbox (the SDK's ``sandbox_url``)."""
        return f"http://{self.host}:{self._port(self._envd_port)}"

    def _port(self, port: int) -> int:
        if self._thread is None:
            raise RuntimeError("the E2B stand-in is not running")
        return port

    def sdk_kwargs(self) -> dict[str, Any]:
        """Connection options for any ``e2b.Sandbox`` class method (create, connect, list, kill,
        get_info...): every request of the SDK, REST and envd, comes here."""
        return {
            "api_key": self.api_key,
            "api_url": self.api_url,
            "sandbox_url": self.sandbox_url,
            "debug": False,
        }

    def corral_config(self) -> dict[str, Any]:
        """corral's e2b provider configuration for this stand-in: its addresses and a
        deployment label of its own."""
        return {
            "api_url": self.api_url,
            "sandbox_url": self.sandbox_url,
            "deployment": f"standin-{uuid.uuid4().hex[:8]}",
            "request_timeout_s": 10,
        }

    # -- behaviour ---------------------------------------------------------------------------

    def on_command(self, handler: CommandHandler | None) -> None:
        """Decide what commands do from now on (None: back to the default handler). A
        handler gets a :class:`CommandCall` and returns a :class:`CommandOutcome` or
        ``(stdout, stderr, exit_code)``; it runs in a worker thread and may block."""
        self._handler = handler or default_command_handler

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
        ``method`` and the ``path`` prefix with ``status`` and E2B's error body.

        The SDK retries 429/502/503/504 three times on its own unless the answer carries
        ``Should-Retry: false`` (pass it in ``headers``), so persistent errors need
        ``times=4`` or more."""
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
        answer normally, or with ``status`` and E2B's error body."""
        self._add_fault(Fault(status, seconds, times, method, path))

    def limit_creates(self, per_s: float | None) -> None:
        """Refuse creates past ``per_s`` a second (a token bucket holding a second's worth)
        with 429, as E2B's sandbox creation rate limit does (5 a second on its Pro plan);
        None: no limit. The bucket starts full."""
        with self._state.lock:
            self._state.creates_per_s = per_s
            self._state.refill()

    def _add_fault(self, fault: Fault) -> None:
        if fault.remaining is not None and fault.remaining < 1:
            raise ValueError("times must be at least 1 (or None for until cleared)")
        with self._state.lock:
            self._state.faults.append(fault)

    def clear_faults(self) -> None:
        """Drop every injected fault that has not been used up."""
        with self._state.lock:
            self._state.faults.clear()

    def finish(self, sandbox_id: str) -> bool:
        """End a sandbox as its timeout would: gone from info, list and envd. False if unknown."""
        return self._state.end(sandbox_id)

    def advance(self, seconds: float) -> None:
        """Move the stand-in's clock, so timeouts pass (and sandboxes end) without sleeping."""
        with self._state.lock:
            self._state.offset += timedelta(seconds=seconds)
            self._state.sweep()

    # -- inspection --------------------------------------------------------------------------

    def sandboxes(self) -> dict[str, StandinSandbox]:
        """Copies of the live (running or paused) sandboxes by ID."""
        with self._state.lock:
            self._state.sweep()
            return {s.sandbox_id: s for s in self._state.snapshot(self._state.sandboxes.values())}

    def sandbox(self, sandbox_id: str) -> StandinSandbox:
        """A copy of one sandbox, live or ended (killed, finished, timed out)."""
        with self._state.lock:
            self._state.sweep()
            found = self._state.sandboxes.get(sandbox_id) or self._state.ended.get(sandbox_id)
            if found is None:
                raise KeyError(sandbox_id)
            return self._state.snapshot([found])[0]

    def ended(self) -> list[str]:
        """IDs of the sandboxes that ended (killed, finished or timed out), oldest first."""
        with self._state.lock:
            self._state.sweep()
            return list(self._state.ended)

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
        """Forget the request log."""
        with self._state.lock:
            self._state.log.clear()
