"""The toolbox half of the Daytona stand-in: the routes the SDK's toolbox client sends to
``{toolboxProxyUrl}/{sandboxId}/...`` for a started sandbox.

* ``process/execute``: one command to its end, its combined output (``ExecuteResponse``);
* ``process/session...``: create, read, delete sessions; ``exec`` a command in one, detached
  (``runAsync``: 202 and its id) or to its end (200, stdout and stderr apart); a command and
  its logs (``Command``, ``SessionCommandLogsResponse``);
* a command's logs followed over a WebSocket (``follow=true``): the daemon's log, each chunk
  behind its stream's marker, as it grows, then a normal close once the command ended;
* ``files/bulk-upload`` (multipart ``files[i].path`` and ``files[i].file``),
  ``files/bulk-download`` (a multipart answer, one ``file`` or ``error`` part per path) and
  ``files/info`` (a ``FileInfo``).

Bodies are parsed and answers built with the SDK's own models
(``daytona_toolbox_api_client.models``); errors are the daemon's ``ErrorResponse``. The
commands really run, in :class:`~tests.standins.daytona_host.SandboxHost`."""

from __future__ import annotations

import asyncio
import json
import mimetypes
import stat
from collections.abc import Callable
from datetime import UTC, datetime
from http import HTTPStatus
from typing import Any, TypeVar

from daytona_toolbox_api_client.models import (
    Command,
    CreateSessionRequest,
    DaemonErrorCode,
    ErrorResponse,
    ExecuteRequest,
    ExecuteResponse,
    FileInfo,
    FilesDownloadRequest,
    FsFileResult,
    Session,
    SessionCommandLogsResponse,
    SessionExecuteRequest,
    SessionExecuteResponse,
    UploadFilesResponse,
)
from fastapi import FastAPI, Request, Response, WebSocket, WebSocketDisconnect
from fastapi.responses import JSONResponse
from starlette.concurrency import run_in_threadpool
from starlette.datastructures import UploadFile
from starlette.exceptions import HTTPException as StarletteHTTPException

from tests.standins.daytona_host import CommandRun, SandboxHost
from tests.standins.daytona_state import USER, ApiError, StandinSandbox, StandinState

BOUNDARY = "DAYTONA-FILE-BOUNDARY"  # the daemon's
SOURCE_DAEMON = "DAYTONA_DAEMON"
EXECUTE_DEFAULT_TIMEOUT_S = 10  # process/execute without a timeout
FOLLOW_POLL_S = 0.02  # how often a followed log looks for more
_CODES = {
    400: "BAD_REQUEST",
    401: "UNAUTHORIZED",
    403: "FORBIDDEN",
    404: "NOT_FOUND",
    408: "REQUEST_TIMEOUT",
    409: "CONFLICT",
    410: "GONE",
    422: "UNPROCESSABLE_ENTITY",
    500: "INTERNAL_SERVER_ERROR",
}
M = TypeVar("M")


def toolbox_error_body(status: int, message: str, path: str, method: str, code: str | None) -> Any:
    """The daemon's ``ErrorResponse``."""
    chosen = code or _CODES.get(status)
    return ErrorResponse(
        status_code=status,
        message=message or HTTPStatus(status).phrase,
        path=path,
        method=method,
        timestamp=datetime.now(UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z"),
        code=DaemonErrorCode(chosen) if chosen else None,
        source=SOURCE_DAEMON if chosen else None,
    ).to_dict()


async def _parse(request: Request, model: Callable[[dict[str, Any]], M | None]) -> M:
    raw = await request.body()
    try:
        body = json.loads(raw) if raw else None
        parsed = model(body) if isinstance(body, dict) else None
    except ValueError as exc:
        raise ApiError(400, f"invalid request body: {exc}", "INVALID_REQUEST_BODY") from exc
    if parsed is None:
        raise ApiError(400, "invalid request body", "INVALID_REQUEST_BODY")
    return parsed


def build_toolbox_app(state: StandinState, host: SandboxHost) -> FastAPI:
    """The toolbox app, under ``/toolbox/{sandboxId}``; the gateway checks the bearer token."""
    app = FastAPI(openapi_url=None, docs_url=None, redoc_url=None)

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError) -> Response:
        body = toolbox_error_body(
            exc.status, exc.message, request.url.path, request.method, exc.code
        )
        return JSONResponse(body, exc.status)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> Response:
        body = toolbox_error_body(
            exc.status_code, str(exc.detail), request.url.path, request.method, None
        )
        return JSONResponse(body, exc.status_code)

    _process_routes(app, state, host)
    _session_routes(app, state, host)
    _file_routes(app, state, host)
    return app


def started(state: StandinState, sandbox_id: str) -> StandinSandbox:
    """The sandbox a toolbox request is for, which must be started (the call is an event)."""
    with state.lock:
        sandbox = state.find(sandbox_id)
        if sandbox is None:
            raise ApiError(404, f"sandbox {sandbox_id} not found")
        if sandbox.state != "started":
            raise ApiError(409, f"sandbox {sandbox_id} is not started (state {sandbox.state})")
        state.touch(sandbox)
        return sandbox


def _process_routes(app: FastAPI, state: StandinState, host: SandboxHost) -> None:
    @app.post("/toolbox/{sandbox_id}/process/execute")
    async def execute(sandbox_id: str, request: Request) -> Response:
        sandbox = started(state, sandbox_id)
        asked = await _parse(request, ExecuteRequest.from_dict)
        timeout = asked.timeout or EXECUTE_DEFAULT_TIMEOUT_S
        env = {**sandbox.env, **(asked.envs or {})}
        code, output = await _in_thread(
            lambda: host.execute(sandbox.id, asked.command, env, asked.cwd, timeout)
        )
        if code is None:
            message = f"command timed out after {timeout} seconds"
            raise ApiError(408, message, "PROCESS_EXECUTION_TIMEOUT")
        return JSONResponse(ExecuteResponse(exit_code=code, result=output).to_dict())


def _session_body(session_id: str, runs: list[CommandRun]) -> dict[str, Any]:
    commands = [Command(id=r.id, command=r.command, exit_code=r.exit_code) for r in runs]
    return Session(session_id=session_id, commands=commands).to_dict()


def _session_routes(app: FastAPI, state: StandinState, host: SandboxHost) -> None:
    prefix = "/toolbox/{sandbox_id}/process/session"

    @app.post(prefix)
    async def create_session(sandbox_id: str, request: Request) -> Response:
        sandbox = started(state, sandbox_id)
        asked = await _parse(request, CreateSessionRequest.from_dict)
        host.create_session(sandbox.id, asked.session_id)
        return Response(status_code=201)

    @app.get(prefix)
    async def list_sessions(sandbox_id: str) -> Response:
        sandbox = started(state, sandbox_id)
        ids = host.session_ids(sandbox.id)
        return JSONResponse([_session_body(i, host.session(sandbox.id, i)) for i in ids])

    @app.get(prefix + "/{session_id}")
    async def get_session(sandbox_id: str, session_id: str) -> Response:
        sandbox = started(state, sandbox_id)
        return JSONResponse(_session_body(session_id, host.session(sandbox.id, session_id)))

    @app.delete(prefix + "/{session_id}")
    async def delete_session(sandbox_id: str, session_id: str) -> Response:
        sandbox = started(state, sandbox_id)
        await _in_thread(lambda: host.delete_session(sandbox.id, session_id))
        return Response(status_code=204)

    @app.post(prefix + "/{session_id}/exec")
    async def session_exec(sandbox_id: str, session_id: str, request: Request) -> Response:
        sandbox = started(state, sandbox_id)
        asked = await _parse(request, SessionExecuteRequest.from_dict)
        if not asked.command.strip():
            raise ApiError(400, "command cannot be empty", "BAD_REQUEST")
        run = host.run(sandbox.id, session_id, asked.command, sandbox.env)
        if asked.run_async or asked.var_async:
            return JSONResponse(SessionExecuteResponse(cmd_id=run.id).to_dict(), 202)
        await _in_thread(lambda: _finish(run))
        output, stdout, stderr = run.logs()
        answer = SessionExecuteResponse(
            cmd_id=run.id, exit_code=run.exit_code, output=output, stdout=stdout, stderr=stderr
        )
        return JSONResponse(answer.to_dict())

    _command_routes(app, state, host, prefix)
    _follow_route(app, state, host, prefix)


def _command_routes(app: FastAPI, state: StandinState, host: SandboxHost, prefix: str) -> None:
    @app.get(prefix + "/{session_id}/command/{command_id}")
    async def get_command(sandbox_id: str, session_id: str, command_id: str) -> Response:
        sandbox = started(state, sandbox_id)
        run = host.command(sandbox.id, session_id, command_id)
        body = Command(id=run.id, command=run.command, exit_code=run.exit_code).to_dict()
        return JSONResponse(body)

    @app.get(prefix + "/{session_id}/command/{command_id}/logs")
    async def command_logs(
        sandbox_id: str, session_id: str, command_id: str, request: Request
    ) -> Response:
        sandbox = started(state, sandbox_id)
        if request.query_params.get("follow") == "true":
            raise ApiError(400, "following logs needs a WebSocket", "BAD_REQUEST")
        output, stdout, stderr = host.command(sandbox.id, session_id, command_id).logs()
        logs = SessionCommandLogsResponse(output=output, stdout=stdout, stderr=stderr)
        return JSONResponse(logs.to_dict())


def _follow_route(app: FastAPI, state: StandinState, host: SandboxHost, prefix: str) -> None:
    @app.websocket(prefix + "/{session_id}/command/{command_id}/logs")
    async def follow_logs(
        websocket: WebSocket, sandbox_id: str, session_id: str, command_id: str
    ) -> None:
        try:
            run = host.command(started(state, sandbox_id).id, session_id, command_id)
        except ApiError:
            await websocket.close(code=1008)
            return
        await websocket.accept()
        sent = 0
        try:
            while True:
                ended = run.exit_code is not None  # before reading: nothing after is missed
                chunk = run.marked_from(sent)
                if chunk:
                    await websocket.send_bytes(chunk)
                    sent += len(chunk)
                elif ended:
                    break
                else:
                    await asyncio.sleep(FOLLOW_POLL_S)
            await websocket.close(code=1000)
        except (WebSocketDisconnect, OSError):
            return  # the client gave up: the output has nowhere to go


def _finish(run: CommandRun) -> None:
    run.process.wait()
    for reader in run.readers:
        reader.join()


def _file_routes(app: FastAPI, state: StandinState, host: SandboxHost) -> None:
    @app.post("/toolbox/{sandbox_id}/files/bulk-upload")
    async def upload(sandbox_id: str, request: Request) -> Response:
        sandbox = started(state, sandbox_id)
        written: list[FsFileResult] = []
        async with request.form() as form:  # closes the parts' temporary files
            for key, value in form.multi_items():
                if not (key.startswith("files[") and key.endswith("].path")):
                    continue
                part = form.get(key.removesuffix(".path") + ".file")
                if not isinstance(value, str) or not isinstance(part, UploadFile):
                    raise ApiError(400, f"no file for {key}", "INVALID_REQUEST_BODY")
                data = await part.read()
                host.write(sandbox.id, value, data)
                written.append(FsFileResult(path=value, bytes=len(data)))
        return JSONResponse(UploadFilesResponse(files=written).to_dict())

    @app.post("/toolbox/{sandbox_id}/files/bulk-download")
    async def download(sandbox_id: str, request: Request) -> Response:
        sandbox = started(state, sandbox_id)
        asked = await _parse(request, FilesDownloadRequest.from_dict)
        if not asked.paths:
            raise ApiError(400, 'request body must be {"paths": [ ... ]} and non-empty')
        parts = [_part(path, host.read(sandbox.id, path)) for path in asked.paths]
        body = b"".join(parts) + f"--{BOUNDARY}--\r\n".encode()
        media = f"multipart/form-data; boundary={BOUNDARY}"
        return Response(body, media_type=media)

    _info_route(app, state, host)


def _info_route(app: FastAPI, state: StandinState, host: SandboxHost) -> None:
    @app.get("/toolbox/{sandbox_id}/files/info")
    async def file_info(sandbox_id: str, path: str) -> Response:
        sandbox = started(state, sandbox_id)
        target = host.resolve(sandbox.id, path)
        if not target.exists():
            raise ApiError(404, f"file not found: {path}", "FILE_NOT_FOUND")
        found = target.stat()
        info = FileInfo(
            group=USER,
            is_dir=target.is_dir(),
            mod_time=datetime.fromtimestamp(found.st_mtime, UTC).isoformat(),
            mode=stat.filemode(found.st_mode),
            name=target.name,
            owner=USER,
            permissions=f"{found.st_mode & 0o7777:o}",
            size=found.st_size if host.stated_size is None else host.stated_size,
        )
        return JSONResponse(info.to_dict())


def _part(path: str, data: bytes | None) -> bytes:
    """One part of a bulk download: the file, or the daemon's error text for it."""
    if data is None:
        name, ctype = "error", "text/plain; charset=utf-8"
        data = f"file not found or invalid: {path}".encode()
    else:
        name = "file"
        ctype = mimetypes.guess_type(path)[0] or "application/octet-stream"
    head = (
        f"--{BOUNDARY}\r\n"
        f'Content-Disposition: form-data; name="{name}"; filename="{path}"\r\n'
        f"Content-Type: {ctype}\r\n\r\n"
    )
    return head.encode() + data + b"\r\n"


async def _in_thread(call: Callable[[], M]) -> M:
    """A blocking call (a process to wait for) off the event loop."""
    return await run_in_threadpool(call)
