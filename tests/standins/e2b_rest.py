"""The REST half of the E2B stand-in: the control-plane routes the official SDK (2.x) calls.

Routes and bodies follow the SDK's generated client (``e2b.api.client``): create is
``POST /v2/sandboxes``, list is ``GET /v2/sandboxes?metadata=k%3Dv&state=running,paused``,
resume is ``POST /v2/sandboxes/{id}/connect``; errors are ``{"code": N, "message": ...}``,
which is what the SDK's ``handle_api_exception`` reads."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from typing import Any
from urllib.parse import parse_qsl, unquote

from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from tests.standins.e2b_state import (
    CLIENT_ID,
    CPU_COUNT,
    DISK_SIZE_MB,
    MEMORY_MB,
    ApiError,
    StandinSandbox,
    StandinState,
    timeout_from,
)

PAGE_LIMIT = 100  # the API's default and largest page


def error_response(status: int, message: str, headers: dict[str, str] | None = None) -> Response:
    """E2B's error body, which the SDK turns into its exceptions by status."""
    return JSONResponse({"code": status, "message": message}, status_code=status, headers=headers)


def _stamp(moment: datetime) -> str:
    return moment.isoformat().replace("+00:00", "Z")


def created_body(sandbox: StandinSandbox, envd_version: str) -> dict[str, Any]:
    """The ``Sandbox`` model answered by create and connect."""
    return {
        "templateID": sandbox.template_id,
        "sandboxID": sandbox.sandbox_id,
        "alias": sandbox.alias,
        "clientID": CLIENT_ID,
        "envdVersion": envd_version,
        "envdAccessToken": sandbox.envd_access_token,
        "trafficAccessToken": None,
        "domain": None,
    }


def listed_body(sandbox: StandinSandbox, envd_version: str) -> dict[str, Any]:
    """The ``ListedSandbox`` model of ``GET /v2/sandboxes``."""
    return {
        "templateID": sandbox.template_id,
        "alias": sandbox.alias,
        "sandboxID": sandbox.sandbox_id,
        "clientID": CLIENT_ID,
        "startedAt": _stamp(sandbox.started_at),
        "endAt": _stamp(sandbox.end_at),
        "cpuCount": CPU_COUNT,
        "memoryMB": MEMORY_MB,
        "diskSizeMB": DISK_SIZE_MB,
        "metadata": dict(sandbox.metadata),
        "state": sandbox.state,
        "envdVersion": envd_version,
        "volumeMounts": [],
    }


def detail_body(sandbox: StandinSandbox, envd_version: str) -> dict[str, Any]:
    """The ``SandboxDetail`` model of ``GET /sandboxes/{id}``."""
    body = listed_body(sandbox, envd_version)
    body.update(envdAccessToken=sandbox.envd_access_token, domain=None)
    return body


async def _json_body(request: Request) -> dict[str, Any]:
    raw = await request.body()
    if not raw:
        return {}
    try:
        body = json.loads(raw)
    except ValueError as exc:
        raise ApiError(400, f"request body is not JSON: {exc}") from exc
    if not isinstance(body, dict):
        raise ApiError(400, "request body must be a JSON object")
    return body


def parse_metadata_query(raw: str | None) -> dict[str, str]:
    """The SDK sends ``metadata=urlencode({quote(k): quote(v)})``; the API undoes both."""
    if not raw:
        return {}
    return {unquote(k): unquote(v) for k, v in parse_qsl(raw, keep_blank_values=True)}


def _started_after(raw: str | None) -> datetime | None:
    if not raw:
        return None
    try:
        moment = datetime.fromisoformat(raw)
    except ValueError as exc:
        raise ApiError(400, f"invalid startedAfter: {exc}") from exc
    return moment if moment.tzinfo else moment.replace(tzinfo=UTC)


def _matches(sandbox: StandinSandbox, request: Request) -> bool:
    """Whether a sandbox passes the list filters: metadata, state, template, startedAfter."""
    params = request.query_params
    wanted = parse_metadata_query(params.get("metadata"))
    if any(sandbox.metadata.get(k) != v for k, v in wanted.items()):
        return False
    states = [s for s in params.get("state", "").split(",") if s]
    if states and sandbox.state not in states:
        return False
    template = params.get("template")
    if template and template not in (sandbox.template_id, sandbox.alias):
        return False
    after = _started_after(params.get("startedAfter"))
    return after is None or sandbox.started_at >= after


def _page(request: Request, items: list[StandinSandbox]) -> tuple[list[StandinSandbox], str]:
    """One page, newest first unless ``order=asc``, and the ``x-next-token`` of the next
    (none after the last page)."""
    params = request.query_params
    try:
        limit = min(int(params.get("limit", PAGE_LIMIT)), PAGE_LIMIT)
        start = int(params.get("nextToken") or 0)
    except ValueError as exc:
        raise ApiError(400, f"invalid pagination parameter: {exc}") from exc
    items.sort(key=lambda s: s.started_at, reverse=params.get("order", "desc") != "asc")
    end = start + max(limit, 1)
    return items[start:end], (str(end) if end < len(items) else "")


def build_api_app(state: StandinState) -> FastAPI:
    """The REST app; the gateway in front of it checks the API key and injects faults."""
    app = FastAPI(openapi_url=None, docs_url=None, redoc_url=None)
    version = state.envd_version

    @app.exception_handler(ApiError)
    async def _api_error(_: Request, exc: ApiError) -> Response:
        return error_response(exc.status, exc.message)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, exc: StarletteHTTPException) -> Response:
        return error_response(exc.status_code, str(exc.detail))

    @app.post("/v2/sandboxes")
    async def create(request: Request) -> Response:
        body = await _json_body(request)
        state.count_create()
        sandbox = state.create(body)
        return JSONResponse(created_body(sandbox, version), status_code=201)

    @app.get("/v2/sandboxes")
    async def list_sandboxes(request: Request) -> Response:
        with state.lock:
            state.sweep()
            found = [s for s in state.sandboxes.values() if _matches(s, request)]
            page, next_token = _page(request, found)
            body = [listed_body(s, version) for s in page]
        headers = {"x-next-token": next_token} if next_token else {}
        return JSONResponse(body, headers=headers)

    @app.get("/sandboxes/{sandbox_id}")
    async def info(sandbox_id: str) -> Response:
        with state.lock:
            sandbox = state.require(sandbox_id)
            return JSONResponse(detail_body(sandbox, version))

    @app.delete("/sandboxes/{sandbox_id}")
    async def kill(sandbox_id: str) -> Response:
        if not state.end(sandbox_id):
            raise ApiError(404, f"Sandbox '{sandbox_id}' not found")
        return Response(status_code=204)

    _lifecycle_routes(app, state)
    return app


def _lifecycle_routes(app: FastAPI, state: StandinState) -> None:
    """Pause, resume (v2 connect and the legacy resume) and timeout updates."""
    version = state.envd_version

    @app.post("/sandboxes/{sandbox_id}/pause")
    async def pause(sandbox_id: str) -> Response:
        if not state.pause(sandbox_id):
            raise ApiError(409, f"Error pausing sandbox - sandbox '{sandbox_id}' is already paused")
        return Response(status_code=204)

    @app.post("/v2/sandboxes/{sandbox_id}/connect")
    async def connect(sandbox_id: str, request: Request) -> Response:
        body = await _json_body(request)
        timeout = timeout_from(body, 0) if "timeout" in body else None
        with state.lock:
            sandbox, resumed = state.connect(sandbox_id, timeout)
            payload = created_body(sandbox, version)
        return JSONResponse(payload, status_code=201 if resumed else 200)

    @app.post("/sandboxes/{sandbox_id}/resume")
    async def resume(sandbox_id: str, request: Request) -> Response:
        body = await _json_body(request)
        with state.lock:
            found = state.find(sandbox_id)
            if found is not None and found.state == "running":
                raise ApiError(409, f"Sandbox {sandbox_id} is already running")
            timeout = timeout_from(body, 0) if "timeout" in body else None
            sandbox, _ = state.connect(sandbox_id, timeout)
            return JSONResponse(created_body(sandbox, version), status_code=201)

    @app.post("/sandboxes/{sandbox_id}/timeout")
    async def set_timeout(sandbox_id: str, request: Request) -> Response:
        body = await _json_body(request)
        if "timeout" not in body:
            raise ApiError(400, "timeout is required")
        state.set_timeout(sandbox_id, timeout_from(body, 0))
        return Response(status_code=204)
