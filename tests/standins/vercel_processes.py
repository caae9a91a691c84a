"""The commands of the Vercel Sandbox stand-in, run for real: each one is a local subprocess in
its own process group, with the sandbox's environment, its working directory mapped into the
sandbox's directory on this host, and its output kept in order for the logs and the
``wait=true&logs=true`` stream.

A sandbox path ``/vercel/sandbox/x`` is ``<sandbox root>/vercel/sandbox/x`` here; a command
itself is not confined (it runs on this host), only its working directory and the files API
are mapped."""

from __future__ import annotations

import codecs
import contextlib
import os
import secrets
import signal
import subprocess
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any, Literal

Stream = Literal["stdout", "stderr"]


def now_ms() -> int:
    return int(time.time() * 1000)


def host_path(root: Path, path: str, cwd: str) -> Path:
    """Where the sandbox path ``path`` (absolute, or relative to ``cwd``) lies on this host.

    Raises:
        ValueError: the path climbs out of the sandbox's root.
    """
    joined = PurePosixPath(cwd, path) if not path.startswith("/") else PurePosixPath(path)
    parts: list[str] = []
    for part in joined.parts[1:]:
        if part == "..":
            if not parts:
                raise ValueError(f"path {path!r} leaves the sandbox")
            parts.pop()
        elif part not in ("", "."):
            parts.append(part)
    return root.joinpath(*parts)


@dataclass
class Command:
    """One command of a session: a real process, or one that never started (exit 127)."""

    command_id: str
    name: str
    args: list[str]
    cwd: str
    session_id: str
    started_at: int
    env: dict[str, str] = field(repr=False)
    process: subprocess.Popen[bytes] | None = field(default=None, repr=False)
    output: list[tuple[Stream, str]] = field(default_factory=list, repr=False)
    exit_code: int | None = None
    changed: threading.Condition = field(default_factory=threading.Condition, repr=False)
    _readers: list[threading.Thread] = field(default_factory=list, repr=False)

    def body(self) -> dict[str, Any]:
        """The API's command object (``_CommandPayload`` in the SDK)."""
        return {
            "id": self.command_id,
            "name": self.name,
            "args": list(self.args),
            "cwd": self.cwd,
            "sessionId": self.session_id,
            "exitCode": self.exit_code,
            "startedAt": self.started_at,
        }

    @property
    def done(self) -> bool:
        """Exited, and all its output read."""
        with self.changed:
            return self.exit_code is not None

    def output_from(self, index: int) -> list[tuple[Stream, str]]:
        with self.changed:
            return self.output[index:]

    def signal(self, number: int) -> None:
        if self.process is not None and self.process.poll() is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.process.pid, number)

    def kill_and_wait(self) -> None:
        self.signal(signal.SIGKILL)
        self._finish()

    def _append(self, stream: Stream, text: str) -> None:
        if text:
            with self.changed:
                self.output.append((stream, text))
                self.changed.notify_all()

    def _finish(self) -> None:
        if self.process is None:
            return
        code = self.process.wait()
        for reader in self._readers:
            reader.join(timeout=5)
        with self.changed:
            if self.exit_code is None:
                self.exit_code = 128 - code if code < 0 else code
            self.changed.notify_all()


def start_command(
    *,
    session_id: str,
    argv: list[str],
    cwd: str,
    host_cwd: Path,
    env: Mapping[str, str],
    kill_after_s: float | None,
) -> Command:
    """Start ``argv`` as a process of its own group; a missing program exits with 127 and
    the shell's message, as in the sandbox."""
    command = Command(
        command_id=f"cmd_{secrets.token_hex(12)}",
        name=argv[0],
        args=argv[1:],
        cwd=cwd,
        session_id=session_id,
        started_at=now_ms(),
        env=dict(env),
    )
    host_cwd.mkdir(parents=True, exist_ok=True)
    try:
        command.process = subprocess.Popen(
            argv,
            cwd=host_cwd,
            env=dict(env),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,
        )
    except OSError as exc:
        command._append("stderr", f"sh: 1: {argv[0]}: {exc.strerror or 'not found'}\n")
        command.exit_code = 127
        return command
    _follow(command, kill_after_s)
    return command


def _follow(command: Command, kill_after_s: float | None) -> None:
    """Threads that read the process's output, reap it, and kill it after ``kill_after_s``."""
    process = command.process
    assert process is not None and process.stdout is not None and process.stderr is not None
    for stream, pipe in (("stdout", process.stdout), ("stderr", process.stderr)):
        reader = threading.Thread(target=_read, args=(command, stream, pipe), daemon=True)
        reader.start()
        command._readers.append(reader)
    threading.Thread(target=command._finish, daemon=True).start()
    if kill_after_s is not None:
        timer = threading.Timer(kill_after_s, command.signal, args=(signal.SIGKILL,))
        timer.daemon = True
        timer.start()


def _read(command: Command, stream: Stream, pipe: Any) -> None:
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    with pipe:
        while chunk := pipe.read1(65536):
            command._append(stream, decoder.decode(chunk))
    command._append(stream, decoder.decode(b"", final=True))
