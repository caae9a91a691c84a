"""Callers of the api's Unix socket from pid namespaces of their own, as sandboxes are: each a
bubblewrap with ``--unshare-pid``, as the local provider starts one, running ``caller_argv``.

A caller makes its calls, each on a new connection, in one of the ways a sandbox could try to
pass for another: from a new session (``setsid``), orphaned (handed to the namespace's first
process), at the bottom of a chain of processes, with a made-up ``X-Forwarded-For``. It
prints one line, its label and what each call was answered (an HTTP status, or ``held`` for
a plain connection held until the other end closes it).
"""

from __future__ import annotations

import shlex
import sys
from collections.abc import Sequence
from pathlib import Path

CALLER = r"""
import os, socket, sys, time

path, label, count, steps = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4].split(",")
BODY = b'{"token": "crt_' + b"x" * 43 + b'"}'

def call(index):
    with socket.socket(socket.AF_UNIX) as sock:
        sock.connect(path)
        if "held" in steps:
            while sock.recv(1024):
                pass
            return "held"
        forwarded = b""
        if "xff" in steps:
            forwarded = b"X-Forwarded-For: 10.7.%d.%d\r\n" % divmod(index, 250)
        sock.sendall(
            b"POST /v1/runner/register HTTP/1.1\r\nHost: api\r\nConnection: close\r\n"
            b"Content-Type: application/json\r\n" + forwarded
            + b"Content-Length: %d\r\n\r\n" % len(BODY) + BODY
        )
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
        return answer.split(b" ", 2)[1].decode()

for step in steps:
    if step == "setsid":
        os.setsid()
    elif step == "orphan":
        parent = os.getpid()
        if os.fork():
            os._exit(0)
        while os.getppid() == parent:  # until handed to the namespace's first process
            time.sleep(0.001)
    elif step.startswith("chain:"):
        for _ in range(int(step.split(":")[1])):
            child = os.fork()
            if child:
                os._exit(os.waitpid(child, 0)[1] >> 8)
print(label, *(call(index) for index in range(count)), flush=True)
"""


def caller_argv(socket_path: Path, label: str, count: int, how: str = "plain") -> list[str]:
    """A command that makes ``count`` calls on ``socket_path``, ``how`` is a comma-separated
    list of: ``setsid``, ``orphan`` (its parent ends first; its output ends when it does),
    ``chain:N`` (from the end of a chain of N forked processes), ``xff`` (a made-up
    forwarded-for address per call), ``held`` (no request: it holds the connection until
    the other end closes it); ``plain`` for none."""
    return [sys.executable, "-c", CALLER, str(socket_path), label, str(count), how]


def sandboxed(bwrap: str, command: Sequence[str]) -> list[str]:
    """``command`` in a pid namespace of its own, the host's files seen as they are."""
    return [bwrap, "--die-with-parent", "--unshare-pid", "--dev-bind", "/", "/", "--", *command]


def nested(command: Sequence[str]) -> list[str]:
    """``command`` in a new user and pid namespace of its own (``unshare -Urpf``)."""
    return ["unshare", "--user", "--map-root-user", "--pid", "--fork", "--", *command]


def entered(target_pid: int, command: Sequence[str]) -> list[str]:
    """``command`` run from the host in the pid namespace of ``target_pid``, as a provider
    runs a command in a sandbox (``nsenter --pid`` forks it into the namespace)."""
    return ["nsenter", f"--target={target_pid}", "--pid", "--", *command]


def orphaned(command: Sequence[str]) -> list[str]:
    """``command`` (a caller with ``orphan``), waited for until its orphan has ended: the
    orphan holds the pipe to ``cat`` open until then."""
    return ["sh", "-c", f"{shlex.join(command)} | cat"]


def script(*commands: Sequence[str]) -> list[str]:
    """One shell that runs ``commands`` one after the other."""
    return ["sh", "-c", " ; ".join(shlex.join(command) for command in commands)]


def answers(output: str) -> dict[str, list[str]]:
    """The callers' lines by label."""
    lines = (line.split() for line in output.splitlines() if line.strip())
    return {words[0]: words[1:] for words in lines}
