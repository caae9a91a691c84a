"""The REST half of the Daytona stand-in: the ``/api`` routes the official SDK calls for sandboxes.

Routes and bodies follow the SDK's generated client (``daytona_api_client``): create is
``POST /api/sandbox`` with a ``CreateSandbox`` body; get, delete, start and stop take an id
or a name; the list is ``GET /api/sandbox?labels=<JSON>&limit=&cursor=``, answered as
``ListSandboxesResponse``. Every answer is built from the SDK's own models
(``daytona_api_client.models``), so it is what that SDK parses; errors are the body of
Daytona's exception filter, ``{"statusCode", "timestamp", "path", "error", "message"}``."""

from __future__ import annotations

import json
from collections.abc import Callable
from datetime import UTC, datetime
from http import HTTPStatus
from typing import Any

from daytona_api_client.models import (
    BuildInfo,
    ListSandboxesResponse,
    Sandbox,
    SandboxDesiredState,
    SandboxListItem,
    SandboxState,
    ToolboxProxyUrl,
)
from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from tests.standins.daytona_state import (
    DEFAULT_MESSAGES,
    ApiError,
    StandinSandbox,
    StandinState,
    sandbox_fields,
)

PAGE_LIMIT = 200  # the API's largest page


def api_error_body(status: int, message: str, path: str) -> dict[str, Any]:
    """What Daytona's API answers for an error (its Nest ``AllExceptionsFilter``)."""
    try:
        phrase = HTTPStatus(status).phrase
    except ValueError:
        phrase = "Http Exception"
    return {
        "statusCode": status,
        "timestamp": datetime.now(UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z"),
        "path": path,
        "error": phrase,
        "message": message or DEFAULT_MESSAGES.get(status, phrase),
    }


def sandbox_body(sandbox: StandinSandbox, toolbox_url: str) -> dict[str, Any]:
    """The ``Sandbox`` model of a single-sandbox answer (create, get, delete, start, stop)."""
    fields = _typed(sandbox_fields(sandbox, toolbox_url))
    model = Sandbox(
        **fields,
        env=dict(sandbox.env),
        kvm=False,
        volumes=[],
        build_info=_build_info(sandbox),
    )
    # As the API writes it: datetimes (the build's) in ISO 8601.
    return dict(json.loads(json.dumps(model.to_dict(), default=_iso)))


def _iso(value: Any) -> str:
    if isinstance(value, datetime):
        return value.astimezone(UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")
    raise TypeError(f"{type(value).__name__} is not JSON")


def listed_body(sandbox: StandinSandbox, toolbox_url: str) -> dict[str, Any]:
    """The ``SandboxListItem`` model of ``GET /api/sandbox``: no env, no volumes."""
    return SandboxListItem(**_typed(sandbox_fields(sandbox, toolbox_url))).to_dict()


def _typed(fields: dict[str, Any]) -> dict[str, Any]:
    fields = dict(fields)
    fields["state"] = SandboxState(fields["state"])
    fields["desired_state"] = SandboxDesiredState(fields["desired_state"])
    return {k: v for k, v in fields.items() if v is not None}


def _build_info(sandbox: StandinSandbox) -> BuildInfo | None:
    if sandbox.dockerfile is None:
        return None
    return BuildInfo(
        dockerfile_content=sandbox.dockerfile,
        context_hashes=[],
        created_at=sandbox.created_at,
        updated_at=sandbox.created_at,
        snapshot_ref=f"daytona-build-{sandbox.id[:8]}",
    )


async def _json_body(request: Request) -> dict[str, Any]:
    raw = await request.body()
    try:
        body = json.loads(raw) if raw else None
    except ValueError as exc:
        raise ApiError(400, f"request body is not JSON: {exc}") from exc
    if not isinstance(body, dict):
        raise ApiError(400, "request body must be a JSON object")
    return body


def _label_filter(raw: str | None) -> dict[str, str]:
    if not raw:
        return {}
    try:
        labels = json.loads(raw)
    except ValueError as exc:
        raise ApiError(400, f"labels must be JSON: {exc}") from exc
    if not isinstance(labels, dict) or not all(isinstance(v, str) for v in labels.values()):
        raise ApiError(400, "labels must be a JSON object of strings")
    return {str(k): v for k, v in labels.items()}


def _page(request: Request, items: list[StandinSandbox]) -> tuple[list[StandinSandbox], str | None]:
    """One page and the cursor of the next (None after the last)."""
    params = request.query_params
    try:
        limit = int(params.get("limit", 100))
        start = int(params.get("cursor") or 0)
    except ValueError as exc:
        raise ApiError(400, f"invalid pagination parameter: {exc}") from exc
    if not 1 <= limit <= PAGE_LIMIT:
        raise ApiError(400, f"limit must not be greater than {PAGE_LIMIT}")
    end = start + limit
    return items[start:end], (str(end) if end < len(items) else None)


def build_api_app(state: StandinState, toolbox_url: Callable[[], str]) -> FastAPI:
    """The REST app; the gateway in front of it checks the API key and injects faults."""
    app = FastAPI(openapi_url=None, docs_url=None, redoc_url=None)

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError) -> Response:
        return JSONResponse(api_error_body(exc.status, exc.message, request.url.path), exc.status)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> Response:
        message = f"Cannot {request.method} {request.url.path}"
        body = api_error_body(exc.status_code, message, request.url.path)
        return JSONResponse(body, exc.status_code)

    @app.post("/api/sandbox")
    async def create(request: Request) -> Response:
        with state.lock:
            sandbox = state.create(await _json_body(request))
            return JSONResponse(sandbox_body(sandbox, toolbox_url()))

    @app.get("/api/sandbox")
    async def list_sandboxes(request: Request) -> Response:
        labels = _label_filter(request.query_params.get("labels"))
        with state.lock:
            page, cursor = _page(request, state.listed(labels))
            items = [SandboxListItem.from_dict(listed_body(s, toolbox_url())) for s in page]
            body = ListSandboxesResponse(items=items, next_cursor=cursor).to_dict()
        body.setdefault("nextCursor", None)
        return JSONResponse(body)

    @app.get("/api/sandbox/{id_or_name}")
    async def get(id_or_name: str) -> Response:
        with state.lock:
            return JSONResponse(sandbox_body(state.require(id_or_name), toolbox_url()))

    @app.get("/api/sandbox/{sandbox_id}/toolbox-proxy-url")
    async def toolbox_proxy_url(sandbox_id: str) -> Response:
        state.require(sandbox_id)
        return JSONResponse(ToolboxProxyUrl(url=toolbox_url()).to_dict())

    _lifecycle_routes(app, state, toolbox_url)
    return app


def _lifecycle_routes(app: FastAPI, state: StandinState, toolbox_url: Callable[[], str]) -> None:
    """Delete, start and stop: each answers the sandbox as it is afterwards."""

    @app.delete("/api/sandbox/{id_or_name}")
    async def delete(id_or_name: str) -> Response:
        with state.lock:
            sandbox = state.require(id_or_name)
            state.delete(sandbox, state.now())
            return JSONResponse(sandbox_body(sandbox, toolbox_url()))

    @app.post("/api/sandbox/{id_or_name}/start")
    async def start(id_or_name: str) -> Response:
        with state.lock:
            sandbox = state.require(id_or_name)
            state.start(sandbox)
            return JSONResponse(sandbox_body(sandbox, toolbox_url()))

    @app.post("/api/sandbox/{id_or_name}/stop")
    async def stop(id_or_name: str) -> Response:
        with state.lock:
            sandbox = state.require(id_or_name)
            if sandbox.state not in ("stopped", "destroying"):
                state.stop(sandbox, state.now())
            return JSONResponse(sandbox_body(sandbox, toolbox_url()))
