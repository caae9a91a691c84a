"""The envd half of the E2B stand-in: the sandbox proxy and the process service behind it.

The SDK reaches envd at ``sandbox_url`` with the sandbox named by the ``E2b-Sandbox-Id``
header and envd's token in ``X-Access-Token``, as it does through ``sandbox.e2b.app``. The
process service is the SDK's own generated Connect server (``process_connect``), so the
Connect framing (5-byte envelopes, the JSON codec the SDK insists on, the end-of-stream
message) is the protocol's, not a copy of it. Nothing runs: a command handler decides what
each command prints and how it exits."""

from __future__ import annotations

import asyncio
import base64
import binascii
import json
import shlex
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, MutableMapping
from typing import Any, Literal

from connectrpc.code import Code
from connectrpc.errors import ConnectError
from connectrpc.request import RequestContext
from e2b.envd.process import process_connect, process_pb
from protobuf import Oneof

from tests.standins.e2b_state import (
    ENVD_UNAUTHORIZED,
    PROXY_SANDBOX_NOT_FOUND,
    CommandCall,
    CommandHandler,
    CommandOutcome,
    StandinState,
)

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

Event = process_pb.ProcessEvent

# envd answers these without the access token (the file routes check a signature instead).
UNAUTHENTICATED_ROUTES = {("GET", "/health"), ("GET", "/files"), ("POST", "/files")}
OUTPUT_CHUNK_BYTES = 64 * 1024


def default_command_handler(call: CommandCall) -> CommandOutcome:
    """``echo X`` prints X, ``exit N`` (also inside ``sh -c``/``bash -c``) exits N, ``true`` and
    ``false`` do what they say; anything else is bash's "command not found" (127)."""
    return simulate(call.cmd)


def _echo(args: list[str]) -> CommandOutcome:
    if args[:1] == ["-n"]:
        return CommandOutcome(stdout=" ".join(args[1:]))
    return CommandOutcome(stdout=" ".join(args) + "\n")


def _exit(args: list[str]) -> CommandOutcome:
    if not args:
        return CommandOutcome()
    if args[0].lstrip("-").isdigit():
        return CommandOutcome(exit_code=int(args[0]) & 0xFF)
    message = f"bash: line 1: exit: {args[0]}: numeric argument required\n"
    return CommandOutcome(stderr=message, exit_code=2)


BUILTINS: dict[str, Callable[[list[str]], CommandOutcome]] = {
    "echo": _echo,
    "exit": _exit,
    "true": lambda _: CommandOutcome(),
    "false": lambda _: CommandOutcome(exit_code=1),
}


def simulate(cmd: str) -> CommandOutcome:
    """The default handler's tiny shell: the builtins above, ``sh -c``/``bash -c`` around them,
    and bash's "command not found" for everything else."""
    try:
        argv = shlex.split(cmd)
    except ValueError:
        return CommandOutcome(stderr="bash: -c: line 1: syntax error\n", exit_code=2)
    if not argv:
        return CommandOutcome()
    name, args = argv[0], argv[1:]
    if name in ("sh", "bash") and len(args) >= 2 and args[0] == "-c":
        return simulate(args[1])
    builtin = BUILTINS.get(name)
    if builtin is not None:
        return builtin(args)
    return CommandOutcome(stderr=f"bash: line 1: {name}: command not found\n", exit_code=127)


def _outcome(result: CommandOutcome | tuple[str, str, int]) -> CommandOutcome:
    if isinstance(result, CommandOutcome):
        return result
    stdout, stderr, exit_code = result
    return CommandOutcome(stdout=stdout, stderr=stderr, exit_code=exit_code)


def _basic_user(header: str | None) -> str | None:
    """The user the SDK asks for with ``Authorization: Basic base64("user:")``."""
    if not header or not header.lower().startswith("basic "):
        return None
    try:
        decoded = base64.b64decode(header[6:], validate=True).decode()
    except (binascii.Error, UnicodeDecodeError):
        return None
    return decoded.split(":", 1)[0] or None


# The events of a Start stream, spelled out per oneof case so each Oneof keeps its literal
# field name for the type checker.
def _started(pid: int) -> process_pb.StartResponse:
    event: Oneof[Literal["start"], Event.StartEvent] = Oneof("start", Event.StartEvent(pid=pid))
    return process_pb.StartResponse(event=Event(event=event))


def _stdout(data: bytes) -> process_pb.StartResponse:
    output: Oneof[Literal["stdout"], bytes] = Oneof("stdout", data)
    event: Oneof[Literal["data"], Event.DataEvent] = Oneof("data", Event.DataEvent(output=output))
    return process_pb.StartResponse(event=Event(event=event))


def _stderr(data: bytes) -> process_pb.StartResponse:
    output: Oneof[Literal["stderr"], bytes] = Oneof("stderr", data)
    event: Oneof[Literal["data"], Event.DataEvent] = Oneof("data", Event.DataEvent(output=output))
    return process_pb.StartResponse(event=Event(event=event))


def _ended(exit_code: int) -> process_pb.StartResponse:
    end = Event.EndEvent(exit_code=exit_code, exited=True, status=f"exit status {exit_code}")
    event: Oneof[Literal["end"], Event.EndEvent] = Oneof("end", end)
    return process_pb.StartResponse(event=Event(event=event))


async def pause_for(seconds: float, stopping: threading.Event) -> None:
    """Sleep, but give up as soon as the stand-in stops, so no request outlives it."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + seconds
    while not stopping.is_set() and (left := deadline - loop.time()) > 0:
        await asyncio.sleep(min(left, 0.05))


class ProcessService(process_connect.Process):
    """``process.Process``: Start runs the handler; List has nothing running (every command
    ends in its Start stream); SendSignal and Connect find no process. The rest answer
    UNIMPLEMENTED from the generated base class, as an envd without them would."""

    def __init__(
        self,
        state: StandinState,
        handler: Callable[[], CommandHandler],
        stopping: threading.Event,
    ) -> None:
        self._state = state
        self._handler = handler
        self._stopping = stopping

    async def start(
        self,
        request: process_pb.StartRequest,
        ctx: RequestContext[process_pb.StartRequest, process_pb.StartResponse],
    ) -> AsyncIterator[process_pb.StartResponse]:
        call = self._call(request, ctx)
        pid = self._state.record_command(call)
        outcome = _outcome(await asyncio.to_thread(self._handler(), call))
        yield _started(pid)
        # envd sends a process's output as it comes, in pieces, not whole.
        stdout, stderr = outcome.stdout.encode(), outcome.stderr.encode()
        for start in range(0, len(stdout), OUTPUT_CHUNK_BYTES):
            yield _stdout(stdout[start : start + OUTPUT_CHUNK_BYTES])
        for start in range(0, len(stderr), OUTPUT_CHUNK_BYTES):
            yield _stderr(stderr[start : start + OUTPUT_CHUNK_BYTES])
        await pause_for(outcome.duration, self._stopping)
        yield _ended(outcome.exit_code)

    def _call(self, request: process_pb.StartRequest, ctx: RequestContext[Any, Any]) -> CommandCall:
        """What the handler sees: the command string the SDK wraps in ``bash -l -c``."""
        headers = ctx.request_headers
        config = request.process or process_pb.ProcessConfig()
        args = list(config.args)
        cmd = args[2] if args[:2] == ["-l", "-c"] and len(args) > 2 else shlex.join(args)
        sandbox = self._state.running(headers.get("e2b-sandbox-id"))
        timeout = headers.get("connect-timeout-ms")
        return CommandCall(
            sandbox_id=sandbox.sandbox_id if sandbox else "",
            cmd=cmd,
            envs=dict(config.envs),
            sandbox_envs=dict(sandbox.envs) if sandbox else {},
            cwd=config.cwd if config.has_field("cwd") else None,
            user=_basic_user(headers.get("authorization")),
            timeout_ms=int(timeout) if timeout and timeout.isdigit() else None,
        )

    async def list(
        self,
        request: process_pb.ListRequest,
        ctx: RequestContext[process_pb.ListRequest, process_pb.ListResponse],
    ) -> process_pb.ListResponse:
        return process_pb.ListResponse(processes=[])

    async def send_signal(
        self,
        request: process_pb.SendSignalRequest,
        ctx: RequestContext[process_pb.SendSignalRequest, process_pb.SendSignalResponse],
    ) -> process_pb.SendSignalResponse:
        raise ConnectError(Code.NOT_FOUND, "process not found")

    def connect(
        self,
        request: process_pb.ConnectRequest,
        ctx: RequestContext[process_pb.ConnectRequest, process_pb.ConnectResponse],
    ) -> AsyncIterator[process_pb.ConnectResponse]:
        raise ConnectError(Code.NOT_FOUND, "process not found")


async def send_json(
    send: Send, status: int, body: Any, headers: dict[str, str] | None = None
) -> None:
    """A complete JSON answer, written straight to ASGI (the gateway uses it too)."""
    payload = json.dumps(body).encode()
    raw_headers = [
        (b"content-type", b"application/json"),
        (b"content-length", b"%d" % len(payload)),
    ]
    raw_headers += [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()]
    await send({"type": "http.response.start", "status": status, "headers": raw_headers})
    await send({"type": "http.response.body", "body": payload})


def build_envd_app(
    state: StandinState, handler: Callable[[], CommandHandler], stopping: threading.Event
) -> ASGIApp:
    """The sandbox proxy in front of envd: 502 "The sandbox was not found" for a sandbox that
    is gone or paused (what the SDK reads as not running), envd's 401 for a wrong token,
    ``/health`` 204, and the process service."""
    process_app = process_connect.ProcessASGIApplication(ProcessService(state, handler, stopping))

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        headers = {k.decode().lower(): v.decode() for k, v in scope["headers"]}
        sandbox_id = headers.get("e2b-sandbox-id", "")
        sandbox = state.running(sandbox_id)
        method, path = scope["method"], scope["path"]
        if sandbox is None:
            body = {"sandboxId": sandbox_id, "message": PROXY_SANDBOX_NOT_FOUND, "code": 502}
            await send_json(send, 502, body)
            return
        token_ok = headers.get("x-access-token") == sandbox.envd_access_token
        if not token_ok and (method, path) not in UNAUTHENTICATED_ROUTES:
            await send_json(send, 401, {"code": 401, "message": ENVD_UNAUTHORIZED})
        elif (method, path) == ("GET", "/health"):
            await send({"type": "http.response.start", "status": 204, "headers": []})
            await send({"type": "http.response.body", "body": b""})
        elif path.startswith(process_app.path + "/"):
            await process_app(scope, receive, send)
        else:
            await send_json(send, 404, {"code": 404, "message": f"{path} not found"})

    return app
