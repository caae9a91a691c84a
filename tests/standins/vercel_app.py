"""The routes of the Vercel Sandbox stand-in: what the official ``vercel-sandbox`` SDK (0.10,
``vercel.sandbox._internal.api_client``) calls, answered with the JSON its models read.

Sandboxes are named: create is ``POST /v3/sandboxes`` (``projectId`` in the body), get, list
and destroy are ``/v2/sandboxes[/{name}]`` (``projectId``, or ``project`` for the list, in the
query); everything that runs in a sandbox goes to its current session,
``/v2/sandboxes/sessions/{id}/...`` (stop, cmd, cmd/{id}[/logs|/kill], fs/write|read|mkdir).
Command output is NDJSON: ``{"command": ...}`` records around ``{"stream", "data"}`` ones."""

from __future__ import annotations

import asyncio
import io
import json
import re
import tarfile
import threading
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from tests.standins.vercel_processes import Command, host_path, now_ms, start_command
from tests.standins.vercel_state import (
    DEFAULT_IMAGE,
    MAX_TAGS,
    MAX_TIMEOUT_MS,
    VCPUS,
    WORKDIR,
    ApiError,
    Session,
    StandinSandbox,
    StandinState,
)

NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
PAGE_LIMIT = 20  # the default page: small, so that listing a few dozen sandboxes pages
MAX_PAGE = 50
NDJSON = "application/x-ndjson"
POLL_S = 0.02
HOME = "/home/vercel-sandbox"


def error_response(error: ApiError, headers: dict[str, str] | None = None) -> Response:
    return JSONResponse(error.body(), status_code=error.status, headers=headers)


async def _json(request: Request) -> dict[str, Any]:
    raw = await request.body()
    try:
        body = json.loads(raw) if raw else {}
    except ValueError as exc:
        raise ApiError(400, f"Invalid JSON body: {exc}") from exc
    if not isinstance(body, dict):
        raise ApiError(400, "The body must be a JSON object")
    return body


def _check_create(body: dict[str, Any]) -> str:
    """The create body's name, once every field the stand-in checks is valid."""
    name = body.get("name")
    if not isinstance(name, str) or not NAME.match(name):
        raise ApiError(400, "name must be 1-128 letters, digits, '.', '_' or '-'")
    tags = body.get("tags") or {}
    if len(tags) > MAX_TAGS:
        raise ApiError(400, f"A sandbox can have at most {MAX_TAGS} tags", "too_many_tags")
    if any(not isinstance(v, str) for v in [*tags, *tags.values()]):
        raise ApiError(400, "tags must map strings to strings")
    env = body.get("env") or {}
    if any(not isinstance(v, str) for v in [*env, *env.values()]):
        raise ApiError(400, "env must map strings to strings")
    timeout = body.get("timeout")
    if timeout is not None and not (isinstance(timeout, int) and 0 < timeout <= MAX_TIMEOUT_MS):
        raise ApiError(400, f"timeout must be 1 to {MAX_TIMEOUT_MS} milliseconds")
    vcpus = (body.get("resources") or {}).get("vcpus")
    if vcpus is not None and vcpus not in VCPUS:
        raise ApiError(400, f"resources.vcpus must be one of {', '.join(map(str, VCPUS))}")
    return name


def build_app(state: StandinState, base_env: dict[str, str], stopping: threading.Event) -> Any:
    """The stand-in's Starlette app; ``base_env`` is what every command's environment starts
    from (``PATH`` and the like of this host)."""
    sandboxes = _SandboxRoutes(state)
    commands = _CommandRoutes(state, base_env, stopping)
    files = _FileRoutes(state)
    session = "/v2/sandboxes/sessions/{session_id}"
    routes = [
        Route("/v3/sandboxes", sandboxes.create, methods=["POST"]),
        Route("/v2/sandboxes", sandboxes.list, methods=["GET"]),
        Route(session, sandboxes.get_session, methods=["GET"]),
        Route(f"{session}/stop", sandboxes.stop_session, methods=["POST"]),
        Route(f"{session}/cmd", commands.start, methods=["POST"]),
        Route(f"{session}/cmd", commands.list, methods=["GET"]),
        Route(f"{session}/cmd/{{command_id}}", commands.get, methods=["GET"]),
        Route(f"{session}/cmd/{{command_id}}/logs", commands.logs, methods=["GET"]),
        Route(f"{session}/cmd/{{command_id}}/kill", commands.kill, methods=["POST"]),
        Route(f"{session}/fs/write", files.write, methods=["POST"]),
        Route(f"{session}/fs/read", files.read, methods=["POST"]),
        Route(f"{session}/fs/mkdir", files.mkdir, methods=["POST"]),
        Route("/v2/sandboxes/{name}", sandboxes.get, methods=["GET"]),
        Route("/v2/sandboxes/{name}", sandboxes.destroy, methods=["DELETE"]),
    ]

    async def api_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, ApiError)
        return error_response(exc)

    async def http_error(request: Request, exc: Exception) -> Response:
        status = getattr(exc, "status_code", 500)
        return error_response(ApiError(status, f"No route for {request.method} {request.url.path}"))

    return Starlette(
        routes=routes, exception_handlers={ApiError: api_error, 404: http_error, 405: http_error}
    )


def _sandbox_answer(sandbox: StandinSandbox) -> dict[str, Any]:
    at = now_ms()
    return {"sandbox": sandbox.body(at), "session": sandbox.session.body(at), "routes": []}


class _SandboxRoutes:
    def __init__(self, state: StandinState) -> None:
        self.state = state

    async def create(self, request: Request) -> Response:
        body = await _json(request)
        if body.get("projectId") != self.state.project_id:
            raise ApiError(404, "Project not found", "not_found")
        name = _check_create(body)
        with self.state.lock:
            if name in self.state.sandboxes:
                raise ApiError(409, f"A sandbox named {name!r} already exists", "conflict")
            sandbox = StandinSandbox(
                name=name,
                project_id=self.state.project_id,
                image=str(body.get("image") or DEFAULT_IMAGE),
                env=dict(body.get("env") or {}),
                tags=dict(body.get("tags") or {}),
                persistent=bool(body.get("persistent", True)),
                source=body.get("source"),
                create_body=body,
                root=self.state.workdir / name,
                session=self.state.new_session(name, body),
            )
            self.state.sandboxes[name] = sandbox
        for directory in (WORKDIR, HOME):
            host_path(sandbox.root, directory, "/").mkdir(parents=True, exist_ok=True)
        return JSONResponse(_sandbox_answer(sandbox), status_code=201)

    async def get(self, request: Request) -> Response:
        self.state.sweep()
        name = request.path_params["name"]
        sandbox = self.state.sandbox(name, request.query_params.get("projectId"))
        return JSONResponse(_sandbox_answer(sandbox))

    async def list(self, request: Request) -> Response:
        self.state.sweep()
        params = request.query_params
        if params.get("project") != self.state.project_id:
            raise ApiError(404, "Project not found", "not_found")
        found = self._matching(params.get("tags"), params.get("namePrefix"))
        reverse = params.get("sortOrder", "desc") == "desc"
        found.sort(key=lambda s: (s.created_at, s.name), reverse=reverse)
        start = int(params.get("cursor") or 0)
        limit = int(params.get("limit") or PAGE_LIMIT)
        if not 1 <= limit <= MAX_PAGE:
            raise ApiError(400, f"limit must be between 1 and {MAX_PAGE}")
        page = found[start : start + limit]
        following = str(start + limit) if start + limit < len(found) else None
        at = now_ms()
        return JSONResponse(
            {
                "sandboxes": [s.body(at) for s in page],
                "pagination": {"count": len(found), "next": following, "prev": None},
            }
        )

    def _matching(self, tag: str | None, prefix: str | None) -> list[StandinSandbox]:
        key, _, value = (tag or "").partition(":")
        with self.state.lock:
            return [
                s
                for s in self.state.sandboxes.values()
                if (not tag or s.tags.get(key) == value)
                and (not prefix or s.name.startswith(prefix))
            ]

    async def destroy(self, request: Request) -> Response:
        name = request.path_params["name"]
        sandbox = self.state.sandbox(name, request.query_params.get("projectId"))
        await asyncio.to_thread(self.state.destroy, sandbox)
        return JSONResponse({"sandbox": sandbox.body(now_ms())})

    async def get_session(self, request: Request) -> Response:
        self.state.sweep()
        _sandbox, session = self.state.session(request.path_params["session_id"])
        return JSONResponse({"session": session.body(now_ms())})

    async def stop_session(self, request: Request) -> Response:
        sandbox, session = self.state.session(request.path_params["session_id"])
        await asyncio.to_thread(self.state.stop_session, session)
        at = now_ms()
        return JSONResponse({"session": session.body(at), "sandbox": sandbox.body(at)})


class _CommandRoutes:
    def __init__(
        self, state: StandinState, base_env: dict[str, str], stopping: threading.Event
    ) -> None:
        self.state = state
        self.base_env = base_env
        self.stopping = stopping

    async def start(self, request: Request) -> Response:
        sandbox, session = self.state.live_session(request.path_params["session_id"])
        body = await _json(request)
        argv = [str(body.get("command") or ""), *map(str, body.get("args") or [])]
        if not argv[0]:
            raise ApiError(400, "command is required")
        cwd = str(body.get("cwd") or WORKDIR)
        env = {
            **self.base_env,
            "HOME": str(host_path(sandbox.root, HOME, "/")),
            **sandbox.env,
            **{str(k): str(v) for k, v in (body.get("env") or {}).items()},
        }
        timeout = body.get("timeout")
        command = await asyncio.to_thread(
            start_command,
            session_id=session.session_id,
            argv=argv,
            cwd=cwd,
            host_cwd=host_path(sandbox.root, cwd, "/"),
            env=env,
            kill_after_s=None if timeout is None else timeout / 1000,
        )
        with self.state.lock:
            session.commands[command.command_id] = command
        waiting = request.query_params.get("wait") == "true" or body.get("wait") is True
        if not waiting:
            return JSONResponse({"command": command.body()})
        return StreamingResponse(self._run_stream(command), media_type=NDJSON)

    async def _run_stream(self, command: Command) -> AsyncIterator[bytes]:
        yield _line({"command": command.body()})
        async for record in self._output(command):
            yield record
        yield _line({"command": command.body()})

    async def _output(self, command: Command) -> AsyncIterator[bytes]:
        """Every output record of ``command`` until it exits (or the stand-in stops)."""
        sent = 0
        while not self.stopping.is_set():
            finished = command.done
            fresh = command.output_from(sent)
            sent += len(fresh)
            for stream, data in fresh:
                yield _line({"stream": stream, "data": data})
            if finished and not command.output_from(sent):
                return
            await asyncio.sleep(POLL_S)

    def _command(self, request: Request) -> tuple[Session, Command]:
        _sandbox, session = self.state.session(request.path_params["session_id"])
        with self.state.lock:
            command = session.commands.get(request.path_params["command_id"])
        if command is None:
            raise ApiError(404, "Command not found", "not_found")
        return session, command

    async def list(self, request: Request) -> Response:
        _sandbox, session = self.state.session(request.path_params["session_id"])
        with self.state.lock:
            found = list(session.commands.values())
        return JSONResponse({"commands": [c.body() for c in found]})

    async def get(self, request: Request) -> Response:
        _session, command = self._command(request)
        if request.query_params.get("wait") == "true":
            while not command.done and not self.stopping.is_set():
                await asyncio.sleep(POLL_S)
        return JSONResponse({"command": command.body()})

    async def logs(self, request: Request) -> Response:
        _session, command = self._command(request)
        return StreamingResponse(self._output(command), media_type=NDJSON)

    async def kill(self, request: Request) -> Response:
        _session, command = self._command(request)
        body = await _json(request)
        command.signal(int(body.get("signal") or 15))
        return JSONResponse({"command": command.body()})


def _line(record: dict[str, Any]) -> bytes:
    return json.dumps(record).encode() + b"\n"


class _FileRoutes:
    def __init__(self, state: StandinState) -> None:
        self.state = state

    async def write(self, request: Request) -> Response:
        sandbox, _session = self.state.live_session(request.path_params["session_id"])
        base = request.headers.get("x-cwd", "/")
        data = await request.body()
        try:
            with tarfile.open(fileobj=io.BytesIO(data), mode="r:gz") as archive:
                for member in archive.getmembers():
                    self._extract(archive, member, _inside(sandbox.root, member.name, base))
        except (tarfile.TarError, OSError, EOFError) as exc:
            raise ApiError(400, f"The body is not a gzipped tar archive: {exc}") from exc
        return JSONResponse({})

    @staticmethod
    def _extract(archive: tarfile.TarFile, member: tarfile.TarInfo, target: Path) -> None:
        if member.isdir():
            target.mkdir(parents=True, exist_ok=True)
            return
        if not member.isfile():
            raise ApiError(400, f"Unsupported archive entry {member.name!r}")
        reader = archive.extractfile(member)
        assert reader is not None
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(reader.read())
        target.chmod(member.mode & 0o7777)

    async def read(self, request: Request) -> Response:
        sandbox, _session = self.state.live_session(request.path_params["session_id"])
        body = await _json(request)
        path = str(body.get("path") or "")
        target = _inside(sandbox.root, path, str(body.get("cwd") or WORKDIR))
        if not target.is_file():
            raise ApiError(404, f"File not found: {path}", "file_not_found")
        return Response(target.read_bytes(), media_type="application/octet-stream")

    async def mkdir(self, request: Request) -> Response:
        sandbox, _session = self.state.live_session(request.path_params["session_id"])
        body = await _json(request)
        path = str(body.get("path") or "")
        target = _inside(sandbox.root, path, str(body.get("cwd") or WORKDIR))
        if not body.get("recursive", True) and not target.parent.is_dir():
            raise ApiError(404, f"Parent directory not found: {path}", "path_not_found")
        target.mkdir(parents=True, exist_ok=True)
        return JSONResponse({})


def _inside(root: Path, path: str, cwd: str) -> Path:
    try:
        return host_path(root, path, cwd)
    except ValueError as exc:
        raise ApiError(400, str(exc), "invalid_path") from exc
