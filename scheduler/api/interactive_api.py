"""The interactive sessions api (docs/sessions.md): create, read, exec, files, close.

Exec and file calls run in this process, through the provider of the session's sandbox
(:meth:`corral.shared.runtime.Runtime.provider`, built from the deployment's configuration
and credentials exactly as a provider worker builds it): no broker round trip, and no result
backend to carry output. Env values of an exec go to the provider call and nowhere else:
never a log line, a database row or an error answer.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
import os
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path as FilePath
from typing import Annotated

from fastapi import APIRouter, Depends, HTTPException, Path, Request, Response
from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator
from starlette.concurrency import run_in_threadpool

from corral.providers.base import SandboxHandle, SupportsExec, SupportsFiles
from corral.providers.errors import (
    FileTooLargeError,
    ProviderError,
    ProviderTimeoutError,
    SandboxNotRunningError,
    SandboxPathError,
    TransientProviderError,
)
from corral.providers.size_limits import refuse_larger
from corral.scheduler.admin.responses import Answer
from corral.scheduler.api.auth import Principal, Scope, needs
from corral.scheduler.api.bodies import StrictJSONRoute, read_json
from corral.scheduler.api.http_errors import InvalidFields, InvalidRequest, ServiceUnavailable
from corral.scheduler.api.interactive import (
    SessionAnswer,
    SessionCreate,
    SessionEndedError,
    SessionRefusedError,
    SessionView,
    create_session,
    hold,
    load_session,
    release,
    sandbox_path,
    session_env,
)
from corral.scheduler.api.process_runtime import ApiRuntime
from corral.scheduler.publish import enqueue
from corral.shared.broker.celery_app import app as celery_app
from corral.shared.env_names import EnvMap
from corral.shared.errors import SecretKeyMismatchError
from corral.shared.messages import field_errors
from corral.shared.runtime import Runtime
from corral.shared.store.interactive_ends import close_session
from corral.shared.store.models import TerminationReason
from corral.shared.text import IDENTIFIER, NulFree

log = logging.getLogger(__name__)
ACTOR = "api"
TIMED_OUT_EXIT_CODE = 124  # as coreutils' timeout says it

router = APIRouter(prefix="/v1/sessions", tags=["sessions"], route_class=StrictJSONRoute)
Dispatcher = Annotated[Principal, Depends(needs(Scope.DISPATCH))]
Reader = Annotated[Principal, Depends(needs(Scope.READ))]
SessionId = Annotated[str, Path(pattern=IDENTIFIER, description="a session id (se-...)")]


class ExecBody(BaseModel):
    """One command in the session's sandbox."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    shell: bool = Field(default=False, description="run command (one string) through /bin/sh -c")
    command: list[NulFree] | NulFree = Field(
        description="an argv list; a string only with shell: true", max_length=100_000
    )
    env: EnvMap = Field(default_factory=dict, max_length=256, repr=False)
    cwd: str | None = Field(default=None, description="relative to the work directory")
    timeout_s: float | None = Field(default=None, gt=0)

    @field_validator("command")
    @classmethod
    def _argv_unless_shell(cls, value: list[str] | str, info: ValidationInfo) -> list[str] | str:
        shell = info.data.get("shell", False)
        if shell and not isinstance(value, str):
            raise ValueError("with shell: true, give the command as one string")
        if not shell and isinstance(value, str):
            raise ValueError("an argv list, or one string with shell: true (runs /bin/sh -c)")
        if not value or (isinstance(value, list) and len(value) > 4096):
            raise ValueError("must not be empty; an argv list has at most 4096 items")
        return value


class ExecAnswer(Answer):
    stdout: str
    stderr: str
    exit_code: int
    duration_s: float
    timed_out: bool = Field(description=f"killed at timeout_s (exit_code {TIMED_OUT_EXIT_CODE})")
    truncated: bool = Field(description="stdout or stderr was cut at the output limit")


def _visible(rt: Runtime, session_id: str, caller: Principal) -> SessionView:
    """The session if the caller may see it; 404 as for one that does not exist."""
    try:
        view = load_session(rt.db, session_id)
    except LookupError as exc:
        raise HTTPException(status_code=404, detail="session not found") from exc
    if not caller.sees(view.answer.org_id):
        raise HTTPException(status_code=404, detail="session not found")
    return view


def _ready(rt: Runtime, session_id: str, caller: Principal) -> SessionView:
    """A session commands and files can reach now; 409 saying why not otherwise."""
    view = _visible(rt, session_id, caller)
    if view.answer.state == "ended":
        why = view.answer.end_reason or "ended"
        raise HTTPException(
            status_code=409, detail=f"session {view.id} has ended ({why}); create a new one"
        )
    if view.handle is None:
        raise HTTPException(
            status_code=409,
            detail=f"session {view.id} is still provisioning; wait until GET "
            f"/v1/sessions/{view.id} says ready",
        )
    return view


# The create route reads its body itself (as dispatch does): the models it shares with the
# dispatch message are documented once, as the message's (corral.scheduler.api.app._openapi).
CREATE_BODY = {
    "requestBody": {
        "required": True,
        "content": {"application/json": {"schema": {"$ref": "#/components/schemas/SessionCreate"}}},
    }
}


@router.post("", status_code=201, openapi_extra=CREATE_BODY)
async def create(request: Request, caller: Dispatcher, rt: ApiRuntime) -> SessionAnswer:
    """Route a live sandbox like a work item; 201 with its id once routed (provisioning)."""
    raw = read_json(await request.body(), max_depth=rt.settings.api_json_max_depth)
    try:
        body = SessionCreate.model_validate(raw)
    except ValidationError as exc:
        raise InvalidFields(field_errors(exc, SessionCreate)) from exc
    if not caller.sees(body.org):
        raise HTTPException(status_code=404, detail="org not found")
    return await run_in_threadpool(_create, rt, body)


def _create(rt: Runtime, body: SessionCreate) -> SessionAnswer:
    try:
        session_id, outcome = create_session(rt.db, body, rt.settings, actor=ACTOR)
    except SessionRefusedError as exc:
        raise HTTPException(status_code=409, detail=exc.message) from exc
    enqueue(outcome)  # after the commit; should it fail, the re-drive sends it
    return load_session(rt.db, session_id).answer


@router.get("/{session_id}")
def read(session_id: SessionId, caller: Reader, rt: ApiRuntime) -> SessionAnswer:
    """The session: provisioning, ready (commands and files work), or ended (and why)."""
    return _visible(rt, session_id, caller).answer


@router.delete("/{session_id}")
def close(session_id: SessionId, caller: Dispatcher, rt: ApiRuntime) -> SessionAnswer:
    """End the session: its work item is cancelled, its sandbox ended and billed."""
    _visible(rt, session_id, caller)
    db = rt.db
    sandbox_id = close_session(
        db, session_id, TerminationReason.SESSION_CLOSED.value, actor=ACTOR, detail="closed"
    )
    if sandbox_id is not None:
        try:  # the fast path; the reaper's `finished` rule is the backstop
            celery_app.send_task(
                "corral.terminate", args=[sandbox_id, TerminationReason.SESSION_CLOSED]
            )
        except Exception:  # any broker failure: the reaper ends it
            log.warning("terminate task not sent", extra={"sandbox_id": sandbox_id})
    return load_session(db, session_id).answer


@router.post("/{session_id}/exec")
def execute(
    session_id: SessionId, body: ExecBody, caller: Dispatcher, rt: ApiRuntime
) -> ExecAnswer:
    """Run one command in the session's sandbox; a non-zero exit is an answer, not an error."""
    settings = rt.settings
    timeout = body.timeout_s or settings.interactive_exec_timeout_s
    if timeout > settings.interactive_exec_timeout_max_s:
        raise InvalidRequest(
            "timeout_s",
            f"at most {settings.interactive_exec_timeout_max_s:g} s "
            "(CORRAL_INTERACTIVE_EXEC_TIMEOUT_MAX_S)",
        )
    cwd = sandbox_path(body.cwd, "cwd") if body.cwd is not None else None
    view = _ready(rt, session_id, caller)
    assert view.handle is not None and view.answer.work_item_id is not None
    with provider_errors():
        provider = rt.provider(view.handle.provider_id)
        # The session's own env, under the call's: opened here, kept nowhere.
        env = {**session_env(rt.db, view.answer.work_item_id), **body.env}
    if not isinstance(provider, SupportsExec):
        raise HTTPException(status_code=409, detail="this session's provider runs no commands")
    _refuse_unbounded(provider.exec_command, "max_output_bytes", "a command's output")
    limit = settings.interactive_output_max_bytes
    held = _hold(rt, session_id, busy_s=timeout)
    try:
        with provider_errors(), _entering(cwd):
            try:
                # The provider keeps no more than the limit while the command runs.
                result = provider.exec_command(
                    view.handle,
                    body.command,
                    env=env or None,
                    cwd=cwd,
                    timeout_s=timeout,
                    max_output_bytes=limit,
                )
            except ProviderTimeoutError:
                return _timed_out(timeout)
    finally:
        release(rt.db, session_id, held)
    # Cut again all the same: the answer's limit holds whatever a provider returned.
    stdout, cut_out = _bounded(result.stdout, limit)
    stderr, cut_err = _bounded(result.stderr, limit)
    return ExecAnswer(
        stdout=stdout,
        stderr=stderr,
        exit_code=result.exit_code,
        duration_s=result.duration_s,
        timed_out=False,
        truncated=result.truncated or cut_out or cut_err,
    )


@contextlib.contextmanager
def _entering(cwd: str | None) -> Iterator[None]:
    """An exec's failure to enter ``cwd`` as a 422 naming ``cwd``: the provider refused it,
    or the host could not resolve or enter it (a local sandbox can swap it for a link or a
    file meanwhile). Without a cwd, an ``OSError`` is the api's own failure."""
    try:
        yield
    except SandboxPathError as exc:
        raise InvalidRequest("cwd", exc.message) from exc
    except OSError as exc:
        if cwd is None or isinstance(exc, ProviderError):
            raise
        raise InvalidRequest(
            "cwd", "could not be entered: it is no directory, or the sandbox changed it meanwhile"
        ) from exc


def _hold(rt: Runtime, session_id: str, *, busy_s: float) -> datetime:
    """The session's idle clock held for a call; 409 when it ended since it was read."""
    try:
        return hold(rt.db, session_id, busy_s=busy_s)
    except SessionEndedError as exc:
        raise HTTPException(status_code=409, detail=str(exc)) from exc


def _timed_out(timeout: float) -> ExecAnswer:
    return ExecAnswer(
        stdout="",
        stderr=f"the command did not finish within {timeout:g} s and was killed",
        exit_code=TIMED_OUT_EXIT_CODE,
        duration_s=timeout,
        timed_out=True,
        truncated=False,
    )


def _bounded(text: str, limit: int) -> tuple[str, bool]:
    """``text`` cut to at most ``limit`` UTF-8 bytes (never inside a character)."""
    data = text.encode()
    if len(data) <= limit:
        return text, False
    return data[:limit].decode(errors="ignore"), True


@contextlib.contextmanager
def provider_errors() -> Iterator[None]:
    """A provider's errors as answers: an ended sandbox 409, a missing file 404, a path it
    refuses or a file over the download limit 422, an unreachable provider 503, anything
    else it refuses (or a session env this api cannot open: another CORRAL_SECRET_KEY) 409.

    A provider's own refusal names the path the client gave (its own, in its own sandbox),
    never a host path; a plain ``OSError``'s text is never shown."""
    try:
        yield
    except SandboxNotRunningError as exc:
        raise HTTPException(
            status_code=409, detail="the session's sandbox is not running; create a new one"
        ) from exc
    except FileNotFoundError as exc:  # before ProviderError: a provider's own is both
        detail = exc.message if isinstance(exc, ProviderError) else "no such file in the session"
        raise HTTPException(status_code=404, detail=detail) from exc
    except SandboxPathError as exc:
        raise InvalidRequest("path", exc.message) from exc
    except FileTooLargeError as exc:
        raise InvalidRequest(
            "path",
            f"the file is larger than the download limit of {exc.max_bytes} bytes "
            "(CORRAL_INTERACTIVE_FILE_MAX_BYTES)",
        ) from exc
    except TransientProviderError as exc:
        raise ServiceUnavailable(
            exc.code, "the session's provider could not be reached; try again"
        ) from exc
    except (ProviderError, SecretKeyMismatchError) as exc:
        raise HTTPException(status_code=409, detail=exc.message) from exc
    except IsADirectoryError as exc:
        raise InvalidRequest("path", "is a directory, not a file") from exc


@dataclass(frozen=True)
class _FileTarget:
    view: SessionView
    handle: SandboxHandle
    provider: SupportsFiles
    path: str


def _refuse_unbounded(method: Callable[..., object], keyword: str, what: str) -> None:
    """Refuse a provider written before the provider contract bounded ``what`` (a plugin
    whose ``method`` takes no ``keyword``): called with the limit it would fail, and
    called without it would hold all of it."""
    if not _takes_keyword(getattr(method, "__func__", method), keyword):
        raise HTTPException(
            status_code=409,
            detail=f"this session's provider cannot bound {what}: its "
            f"{method.__name__} takes no {keyword} (upgrade the provider)",
        )


@functools.cache
def _takes_keyword(function: Callable[..., object], keyword: str) -> bool:
    parameters = inspect.signature(function).parameters.values()
    return any(
        parameter.name == keyword or parameter.kind is inspect.Parameter.VAR_KEYWORD
        for parameter in parameters
    )


def _file_target(rt: Runtime, session_id: str, caller: Principal, path: str) -> _FileTarget:
    checked = sandbox_path(path, "path")
    view = _ready(rt, session_id, caller)
    assert view.handle is not None
    with provider_errors():
        provider = rt.provider(view.handle.provider_id)
    if not isinstance(provider, SupportsFiles):
        raise HTTPException(status_code=409, detail="this session's provider moves no files")
    return _FileTarget(view, view.handle, provider, checked)


class FileStored(Answer):
    size_bytes: int


@router.put("/{session_id}/files/{path:path}")
async def upload(
    session_id: SessionId, path: str, request: Request, caller: Dispatcher, rt: ApiRuntime
) -> FileStored:
    """Write the body (raw bytes, at most CORRAL_INTERACTIVE_FILE_MAX_BYTES) to ``path``."""
    target = await run_in_threadpool(_file_target, rt, session_id, caller, path)
    descriptor, spooled = tempfile.mkstemp(prefix="corral-session-upload-")
    size = 0
    try:
        with os.fdopen(descriptor, "wb") as spool:
            async for chunk in request.stream():
                size += len(chunk)
                spool.write(chunk)
        await run_in_threadpool(_upload, rt, target, FilePath(spooled))
    finally:
        os.unlink(spooled)
    return FileStored(size_bytes=size)


def _upload(rt: Runtime, target: _FileTarget, source: FilePath) -> None:
    held = _hold(rt, target.view.id, busy_s=rt.settings.interactive_exec_timeout_s)
    try:
        with provider_errors():
            target.provider.upload_file(target.handle, source, target.path)
    finally:
        release(rt.db, target.view.id, held)


@router.get(
    "/{session_id}/files/{path:path}",
    response_class=Response,
    responses={
        200: {
            "description": "the file's bytes",
            "content": {
                "application/octet-stream": {"schema": {"type": "string", "format": "binary"}}
            },
        }
    },
)
def download(session_id: SessionId, path: str, caller: Dispatcher, rt: ApiRuntime) -> Response:
    """The file at ``path`` (at most CORRAL_INTERACTIVE_FILE_MAX_BYTES), as raw bytes."""
    target = _file_target(rt, session_id, caller, path)
    _refuse_unbounded(target.provider.download_file, "max_bytes", "a file it copies out")
    limit = rt.settings.interactive_file_max_bytes
    held = _hold(rt, target.view.id, busy_s=rt.settings.interactive_exec_timeout_s)
    try:
        with tempfile.TemporaryDirectory(prefix="corral-session-download-") as directory:
            local = FilePath(directory) / "file"
            with provider_errors():
                # The provider refuses a larger file, and copies no more than limit + 1 bytes.
                target.provider.download_file(target.handle, target.path, local, max_bytes=limit)
                refuse_larger(target.path, local.stat().st_size, limit)  # whatever it copied
            data = local.read_bytes()
    finally:
        release(rt.db, target.view.id, held)
    return Response(content=data, media_type="application/octet-stream")
