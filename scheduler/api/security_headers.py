"""Headers every answer of the api carries, whatever made it: a console page, JSON, an
error, a static file, the runner protocol, an unhandled error's 500.

- ``X-Content-Type-Options: nosniff``: a browser takes an answer for the type it names, so
  a JSON body, a log line or a bundle never runs as a script or renders as a page;
- ``Referrer-Policy: no-referrer``: a console URL (its filters name orgs and pools) is sent
  to no other site;
- ``X-Frame-Options: DENY``: no other site shows an answer inside a frame (the console's
  pages also say ``frame-ancestors 'none'`` in their Content-Security-Policy).

A header an answer sets itself is left as it is.
"""

from __future__ import annotations

from fastapi import FastAPI
from starlette.types import ASGIApp, Message, Receive, Scope, Send

SECURITY_HEADERS: tuple[tuple[bytes, bytes], ...] = (
    (b"x-content-type-options", b"nosniff"),
    (b"referrer-policy", b"no-referrer"),
    (b"x-frame-options", b"DENY"),
)


class SecurityHeadersMiddleware:
    """Adds :data:`SECURITY_HEADERS` to every HTTP answer that lacks them."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def send_with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = list(message.get("headers", []))
                present = {name.lower() for name, _ in headers}
                headers += [(n, v) for n, v in SECURITY_HEADERS if n not in present]
                message = {**message, "headers": headers}
            await send(message)

        await self.app(scope, receive, send_with_headers)


def install(api: FastAPI) -> None:
    """Make the middleware ``api``'s outermost layer: outside the server-error middleware
    Starlette puts first, so that an unhandled error's 500 carries the headers too."""
    build = api.build_middleware_stack
    api.build_middleware_stack = lambda: SecurityHeadersMiddleware(build())  # type: ignore[method-assign]
