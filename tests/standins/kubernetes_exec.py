"""Pod exec as the API server streams it: a WebSocket speaking the ``channel.k8s.io`` framing.

Nothing runs: a handler (a Python callable given the argv) says what the command printed and
how it exited, and this module frames that the way the official client's ``WSClient`` reads it:
binary frames whose first byte is the channel (1 stdout, 2 stderr, 3 the exit ``Status``)."""

from __future__ import annotations

import asyncio
import json
import re
import shlex
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from starlette.websockets import WebSocket, WebSocketDisconnect

STDOUT, STDERR, ERROR = 1, 2, 3
# The client offers v5 first and then v4 and reads the answer's header; the API server picks
# the first offered protocol it serves, so a current cluster answers v5.
PROTOCOLS = ("v5.channel.k8s.io", "v4.channel.k8s.io")
FRAME_BYTES = 32 * 1024  # long output spans frames, as it does from a kubelet

Output = str | bytes


@dataclass(frozen=True)
class ExecResult:
    """What a simulated command printed and how it exited."""

    stdout: Output = ""
    stderr: Output = ""
    exit_code: int = 0


ExecHandler = Callable[[list[str]], "ExecResult | tuple[Output, Output, int]"]


def _as_bytes(output: Output) -> bytes:
    return output if isinstance(output, bytes) else output.encode()


def as_result(value: ExecResult | tuple[Output, Output, int]) -> ExecResult:
    """Handlers may return an ``ExecResult`` or a plain ``(stdout, stderr, exit_code)``."""
    if isinstance(value, ExecResult):
        return value
    stdout, stderr, exit_code = value
    return ExecResult(stdout, stderr, int(exit_code))


_SHELL_SYNTAX = re.compile(r"[;&|<>`$(){}]")


def _echo(words: list[str]) -> ExecResult:
    if words[:1] == ["-n"]:
        return ExecResult(" ".join(words[1:]))
    return ExecResult(" ".join(words) + "\n")


def _shell(program: str, script: str) -> ExecResult:
    if match := re.fullmatch(r"\s*exit\s+(\d+)\s*", script):
        return ExecResult(exit_code=int(match.group(1)))
    if not _SHELL_SYNTAX.search(script) and (words := shlex.split(script)):
        return default_exec(words)
    return ExecResult(stderr=f"{program}: 1: unsupported by the stand-in: {script}\n", exit_code=2)


def _env(words: list[str], environ: dict[str, str]) -> ExecResult:
    """``env [--] [NAME=VALUE]... [COMMAND [ARG]...]``: without a command it prints the
    environment, which in the stand-in is only what ``env`` invocations set."""
    rest = words[1:] if words[:1] == ["--"] else list(words)
    environ = dict(environ)
    while rest and "=" in rest[0] and not rest[0].startswith("="):
        name, _, value = rest.pop(0).partition("=")
        environ[name] = value
    if rest:
        return default_exec(rest, environ)
    return ExecResult("".join(f"{name}={value}\n" for name, value in sorted(environ.items())))


def _timeout(words: list[str], environ: dict[str, str]) -> ExecResult:
    """``timeout [-s SIGNAL|--signal=SIGNAL|-k D] DURATION COMMAND...``: the command runs
    (the stand-in's commands return at once, so none outlives its duration)."""
    rest = list(words)
    while rest and rest[0].startswith("-"):
        option = rest.pop(0)
        if option in ("-s", "-k", "--signal", "--kill-after") and rest:
            rest.pop(0)
    if len(rest) < 2:
        return ExecResult(stderr="timeout: missing operand\n", exit_code=125)
    return default_exec(rest[1:], environ)


def _cat(words: list[str]) -> ExecResult:
    """The stand-in's containers hold no files: every ``cat FILE`` fails as coreutils' does."""
    missing = [word for word in words if word != "-"]
    stderr = "".join(f"cat: {name}: No such file or directory\n" for name in missing)
    return ExecResult(stderr=stderr, exit_code=1 if missing else 0)


def default_exec(argv: list[str], environ: dict[str, str] | None = None) -> ExecResult:
    """A tiny stand-in for a container's userland: ``echo``, ``true``, ``false``, ``env``,
    ``timeout``, ``cat`` (of files that do not exist), ``sh -c "exit N"`` and
    ``sh -c "<one simple command>"``; anything else is not found (127)."""
    program = argv[0].rsplit("/", 1)[-1] if argv else ""
    words, environ = argv[1:], environ or {}
    if program in ("sh", "bash") and len(argv) >= 3 and argv[1] == "-c":
        return _shell(program, argv[2])
    userland: dict[str, Callable[[], ExecResult]] = {
        "echo": lambda: _echo(words),
        "true": ExecResult,
        "false": lambda: ExecResult(exit_code=1),
        "env": lambda: _env(words, environ),
        "timeout": lambda: _timeout(words, environ),
        "cat": lambda: _cat(words),
    }
    if program in userland:
        return userland[program]()
    return ExecResult(stderr=f"{argv[0] if argv else ''}: command not found\n", exit_code=127)


def _text(output: Output) -> str:
    return output.decode(errors="replace") if isinstance(output, bytes) else output


def container_program(argv: list[str]) -> tuple[str, int | None]:
    """What a container's main process prints and how it ends, for the programs the stand-in
    can play: a ``sh -c`` script of simple commands separated by ``;`` or newlines, or one
    simple command. ``exit N`` ends it with N; ``sleep`` (or ``exec sleep``) keeps it running
    (None); other commands run through ``default_exec``, their output going to the log."""
    program = argv[0].rsplit("/", 1)[-1] if argv else ""
    if program in ("sh", "bash") and len(argv) >= 3 and argv[1] == "-c":
        statements = [part.strip() for part in re.split(r"[;\n]", argv[2]) if part.strip()]
    else:
        statements = [shlex.join(argv)]
    output, exit_code = "", 0
    for statement in statements:
        words = shlex.split(statement)
        replaced = words[:1] == ["exec"]
        words = words[1:] if replaced else words
        if words[:1] == ["sleep"]:
            return output, None
        if words[:1] == ["exit"]:
            return output, int(words[1]) if len(words) > 1 else exit_code
        result = default_exec(words)
        output += _text(result.stdout) + _text(result.stderr)
        exit_code = result.exit_code
        if replaced:
            break
    return output, exit_code


def exit_status(exit_code: int, argv: list[str]) -> dict[str, Any]:
    """The channel-3 ``Status``; ``WSClient.returncode`` reads ``details.causes[0].message``."""
    if exit_code == 0:
        return {"metadata": {}, "status": "Success"}
    return {
        "metadata": {},
        "status": "Failure",
        "message": (
            "command terminated with non-zero exit code: error executing command "
            f"[{' '.join(argv)}], exit code {exit_code}"
        ),
        "reason": "NonZeroExitCode",
        "details": {"causes": [{"reason": "ExitCode", "message": str(exit_code)}]},
    }


def _handler_failure(error: Exception) -> dict[str, Any]:
    message = f"Internal error occurred: error executing command in container: {error}"
    return {
        "metadata": {},
        "status": "Failure",
        "message": message,
        "reason": "InternalError",
        "details": {"causes": [{"message": str(error)}]},
        "code": 500,
    }


def choose_protocol(offered_header: str) -> str | None:
    offered = [item.strip() for item in offered_header.split(",") if item.strip()]
    return next((item for item in offered if item in PROTOCOLS), None)


async def _send(websocket: WebSocket, channel: int, data: bytes) -> None:
    for start in range(0, len(data), FRAME_BYTES):
        await websocket.send_bytes(bytes([channel]) + data[start : start + FRAME_BYTES])


@dataclass(frozen=True)
class ExecRequest:
    """The query of an exec call, as the API server reads it."""

    argv: list[str]
    stdout: bool
    stderr: bool
    tty: bool


async def serve_exec(
    websocket: WebSocket, protocol: str, request: ExecRequest, handler: ExecHandler
) -> None:
    """Accept the upgrade, run the handler off the event loop (it may block), stream its
    output and the exit ``Status``, then close normally as the kubelet does. A client that
    gave up meanwhile (its own timeout) is no error: the output has nowhere to go."""
    await websocket.accept(subprotocol=protocol)
    try:
        result = as_result(await asyncio.to_thread(handler, list(request.argv)))
        status = exit_status(result.exit_code, request.argv)
    except Exception as error:  # the handler is test code; its failure is the command's
        result, status = ExecResult(), _handler_failure(error)
    out, err = _as_bytes(result.stdout), _as_bytes(result.stderr)
    if request.tty:  # a terminal has one output stream
        out, err = out + err, b""
    try:
        if request.stdout and out:
            await _send(websocket, STDOUT, out)
        if request.stderr and err:
            await _send(websocket, STDERR, err)
        await _send(websocket, ERROR, json.dumps(status).encode())
        await websocket.close(code=1000)
    except WebSocketDisconnect:
        return
