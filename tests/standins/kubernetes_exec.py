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

from starlette.websockets import WebSocket

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


def default_exec(argv: list[str]) -> ExecResult:
    """A tiny stand-in for a container's userland: ``echo``, ``true``, ``false``,
    ``sh -c "exit N"`` and ``sh -c "<one simple command>"``; anything else is not found (127)."""
    program = argv[0].rsplit("/", 1)[-1] if argv else ""
    if program == "echo":
        return _echo(argv[1:])
    if program in ("true", "false"):
        return ExecResult(exit_code=0 if program == "true" else 1)
    if program in ("sh", "bash") and len(argv) >= 3 and argv[1] == "-c":
        return _shell(program, argv[2])
    return ExecResult(stderr=f"{argv[0] if argv else ''}: command not found\n", exit_code=127)


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
    output and the exit ``Status``, then close normally as the kubelet does."""
    await websocket.accept(subprotocol=protocol)
    try:
        result = as_result(await asyncio.to_thread(handler, list(request.argv)))
        status = exit_status(result.exit_code, request.argv)
    except Exception as error:  # the handler is test code; its failure is the command's
        result, status = ExecResult(), _handler_failure(error)
    out, err = _as_bytes(result.stdout), _as_bytes(result.stderr)
    if request.tty:  # a terminal has one output stream
        out, err = out + err, b""
    if request.stdout and out:
        await _send(websocket, STDOUT, out)
    if request.stderr and err:
        await _send(websocket, STDERR, err)
    await _send(websocket, ERROR, json.dumps(status).encode())
    await websocket.close(code=1000)
