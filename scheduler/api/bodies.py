"""Request bodies within bounds: a byte limit per route, enforced before the body is read,
and JSON read strictly (no NaN or Infinity, no number out of a float's range, no lone
surrogate, no nesting deeper than ``CORRAL_API_JSON_MAX_DEPTH``).

The byte limit is an ASGI middleware in front of everything: a ``Content-Length`` over the
route's limit is answered 413 without being kept; a body without one (chunked) is counted as
it streams, and refused as soon as it passes the limit. So a body costs the api at most its
route's limit in memory, whatever the client sends.

Before a 413, the rest of a body at most :data:`LINGER_BYTES` over the limit is read and
dropped (for at most :data:`LINGER_S`): closing a connection with bytes still unread makes
the kernel reset it, and the reset can reach the client before the answer does. A client
just over the limit so always reads its 413; one further over is answered at once and may
see only the reset. A ``Content-Length`` over the limit with ``Expect: 100-continue`` is
answered at once: that client sends its body only when asked to. Limits by route class
(``CORRAL_API_BODY_LIMIT_*``): dispatch, the runner's ``logs``, ``complete`` and
``bundle``, and everything else.
"""

from __future__ import annotations

import asyncio
import json
import math
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, HTTPException, Request, Response
from fastapi.routing import APIRoute
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from corral.scheduler.api.http_errors import InvalidRequest, problem
from corral.scheduler.api.process_runtime import runtime_of
from corral.shared.broker.envelope import json_depth
from corral.shared.settings import ApiSettings

BODY = "(body)"
SESSIONS = "/v1/sessions/"
LINGER_BYTES = 1 << 20
LINGER_S = 5.0


@dataclass(frozen=True)
class BodyLimits:
    """The largest body, in bytes, of each route class."""

    dispatch: int
    complete: int
    logs: int
    default: int
    bundle: int
    session_file: int

    @classmethod
    def from_settings(cls, settings: ApiSettings) -> BodyLimits:
        return cls(
            dispatch=settings.api_body_limit_dispatch,
            complete=settings.api_body_limit_complete,
            logs=settings.api_body_limit_logs,
            default=settings.api_body_limit_default,
            bundle=settings.bundle_body_limit(),
            session_file=settings.interactive_file_max_bytes,
        )

    def for_path(self, path: str) -> int:
        if path.startswith(SESSIONS) and "/files/" in path:
            return self.session_file  # an upload into an interactive session
        return {
            "/v1/dispatch": self.dispatch,
            "/v1/runner/complete": self.complete,
            "/v1/runner/logs": self.logs,
            "/v1/runner/bundle": self.bundle,
        }.get(path.rstrip("/"), self.default)


class BodyTooLargeError(HTTPException):
    """The body streamed past its route's limit. An HTTPException, so that FastAPI passes
    it on while it reads a body instead of making it a 400."""

    def __init__(self, limit: int) -> None:
        super().__init__(status_code=413, detail=f"the request body is larger than {limit} bytes")
        self.limit = limit


def install(api: FastAPI) -> None:
    """Limit every route's body (the middleware) and answer an overrun with 413."""

    def refused(_: Request, exc: Exception) -> Response:
        assert isinstance(exc, BodyTooLargeError)
        return too_large(exc.limit)

    api.add_exception_handler(BodyTooLargeError, refused)
    api.add_middleware(BodyLimitMiddleware)


def too_large(limit: int) -> Response:
    # Connection: close, so the client stops sending the rest of it.
    return problem(
        413,
        "body_too_large",
        BODY,
        f"the request body is larger than this route's limit of {limit} bytes",
        headers={"Connection": "close"},
        limit_bytes=limit,
    )


class BodyLimitMiddleware:
    """Refuse bodies over their route's limit with 413, reading at most the limit.

    The limits are ``settings()``'s, else those of the runtime the app's routes get."""

    def __init__(self, app: ASGIApp, *, settings: Callable[[], ApiSettings] | None = None) -> None:
        self.app = app
        self.settings = settings

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        settings = self.settings() if self.settings else runtime_of(scope["app"]).settings
        limit = BodyLimits.from_settings(settings).for_path(scope["path"])
        declared, lingers = _content_length(scope), not _expects_continue(scope)
        if declared is not None and declared > limit:
            if lingers and declared - limit <= LINGER_BYTES:
                await _drain(receive, declared)
            await too_large(limit)(scope, receive, send)
            return
        received = 0
        started = False

        async def counted() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    # Here, not where the 413 is sent: the app's own handler may send it.
                    if message.get("more_body", False):
                        await _drain(receive, LINGER_BYTES)
                    raise BodyTooLargeError(limit)
            return message

        async def watched(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, counted, watched)
        except BodyTooLargeError:
            if started:
                raise
            await too_large(limit)(scope, receive, send)


async def _drain(receive: Receive, most: int) -> None:
    """Read and drop the rest of the request's body, until it ends, ``most`` more bytes have
    been read, the client goes or LINGER_S have passed (a client trickling it in is not
    waited for longer)."""
    received = 0
    try:
        async with asyncio.timeout(LINGER_S):
            while received < most:
                message = await receive()
                if message["type"] != "http.request" or not message.get("more_body", False):
                    return
                received += len(message.get("body", b""))
    except TimeoutError:
        return


def _expects_continue(scope: Scope) -> bool:
    """The client waits for ``100 Continue`` before it sends its body (which the server
    sends at the body's first read)."""
    return any(
        name == b"expect" and value.lower() == b"100-continue" for name, value in scope["headers"]
    )


def _content_length(scope: Scope) -> int | None:
    for name, value in scope["headers"]:
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None  # the server refuses a malformed one before we see it
    return None


# -- strict JSON ----------------------------------------------------------------------------


def _refuse_constant(name: str) -> Any:
    raise ValueError("NaN and Infinity are not JSON")


def _finite(text: str) -> float:
    value = float(text)
    if math.isinf(value):
        raise ValueError("a number is out of range")
    return value


def read_json(body: bytes, *, max_depth: int, error: str = "invalid_request") -> Any:
    """``body`` as JSON, strictly.

    Raises:
        InvalidRequest: not UTF-8 JSON, NaN/Infinity or a number out of range, a lone
            surrogate, or nested deeper than ``max_depth``; the message never quotes it.
    """
    try:
        text = body.decode("utf-8")
        value = json.loads(text, parse_constant=_refuse_constant, parse_float=_finite)
    except RecursionError as exc:
        raise InvalidRequest(BODY, _too_deep(max_depth), error=error) from exc
    except (UnicodeDecodeError, ValueError) as exc:
        raise InvalidRequest(BODY, "the body is not UTF-8 JSON", error=error) from exc
    if json_depth(value, limit=max_depth) > max_depth:
        raise InvalidRequest(BODY, _too_deep(max_depth), error=error)
    try:  # a lone surrogate (an unpaired \\ud800 escape) cannot be stored as text
        json.dumps(value, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError as exc:
        raise InvalidRequest(BODY, "the body holds an unpaired surrogate", error=error) from exc
    return value


def _too_deep(max_depth: int) -> str:
    return f"the body is nested more than {max_depth} levels deep"


class StrictJSONRequest(Request):
    """A request whose ``json()`` is :func:`read_json` with the configured depth."""

    async def json(self) -> Any:
        if not hasattr(self, "_json"):
            depth = runtime_of(self.app).settings.api_json_max_depth
            self._json = read_json(await self.body(), max_depth=depth)
        return self._json


class StrictJSONRoute(APIRoute):
    """Routes whose JSON bodies FastAPI reads through :class:`StrictJSONRequest`."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def strict(request: Request) -> Response:
            return await handler(StrictJSONRequest(request.scope, request.receive))

        return strict
