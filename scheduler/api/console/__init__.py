"""corral's web console under ``/console``: server-rendered pages (Jinja2, htmx, inline SVG
charts) over the same functions the admin api calls, behind the admin api's authentication
(docs/console.md)."""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.exception_handlers import http_exception_handler
from fastapi.responses import Response
from starlette.exceptions import HTTPException

from corral.scheduler.api.console import (
    admin_pages,
    capacity_pages,
    pages,
    secret_pages,
    webhook_pages,
)
from corral.scheduler.api.console.render import page, redirect
from corral.scheduler.api.console.session import LoginRequired, open_session
from corral.scheduler.api.process_runtime import runtime_of

PREFIX = "/console"


def install(api: FastAPI) -> None:
    """Serve the console's pages; a request without a valid session goes to the login form,
    and a console page's error is a page too (the api's stay JSON)."""

    def login_required(request: Request, _: Exception) -> Response:
        return redirect(f"{PREFIX}/login", request)

    async def http_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        if not request.url.path.startswith(PREFIX + "/"):
            return await http_exception_handler(request, exc)
        session = open_session(runtime_of(request.app), request.cookies.get("corral_console"))
        detail = exc.detail if isinstance(exc.detail, str) else "refused"
        return page("error.html", session, status=exc.status_code, detail=detail)

    api.add_exception_handler(LoginRequired, login_required)
    api.add_exception_handler(HTTPException, http_error)
    api.include_router(pages.router)
    api.include_router(admin_pages.router)
    api.include_router(capacity_pages.router)
    api.include_router(webhook_pages.router)
    api.include_router(secret_pages.router)
