"""What runs inside the Daytona stand-in's sandboxes, for real: each sandbox is a directory on
this host (its home, ``home/daytona``, is where relative paths and commands start), and each
command a toolbox session or ``process/execute`` is given runs as a local ``/bin/sh -c``
process with the sandbox's environment (the stand-in's ``base_env``, then the env the sandbox
was created with, then the command's own).

So a runner started in a session really registers with the control URL its env names, and
``exec`` really runs. Commands of one session do not share a shell here (a ``cd`` does not
carry over to the next one), which corral never relies on. Stopping or deleting a sandbox
kills its processes and everything they started."""

from __future__ import annotations

import contextlib
import os
import posixpath
import signal
import subprocess
import threading
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

from daytona.common.process import STDERR_PREFIX, STDOUT_PREFIX

from tests.processes import descendants
from tests.standins.daytona_state import USER, ApiError

_CHUNK = 65536


@dataclass
class CommandRun:
    """One command of one session: its process and everything it printed so far."""

    id: str
    command: str
    process: subprocess.Popen[bytes] = field(repr=False)
    stdout: bytearray = field(default_factory=bytearray)
    stderr: bytearray = field(default_factory=bytearray)
    output: bytearray = field(default_factory=bytearray)  # both, as they came
    # The daemon's log of it, which a follow streams: each chunk behind its stream's marker.
    marked: bytearray = field(default_factory=bytearray)
    readers: list[threading.Thread] = field(default_factory=list, repr=False)
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    @property
    def exit_code(self) -> int | None:
        """The shell's ``$?`` for it once it ended and its output is read: 128 + N for a
        signal N."""
        code = self.process.poll()
        if code is None or any(reader.is_alive() for reader in self.readers):
            return None
        return 128 - code if code < 0 else code

    def marked_from(self, offset: int) -> bytes:
        """The marked log from ``offset`` on, a chunk of it at most."""
        with self.lock:
            return bytes(self.marked[offset : offset + _CHUNK])

    def logs(self) -> tuple[str, str, str]:
        """Output, stdout and stderr so far, decoded."""
        with self.lock:
            return tuple(  # type: ignore[return-value]
                bytes(b).decode(errors="replace") for b in (self.output, self.stdout, self.stderr)
            )


class SandboxHost:
    """The sandboxes' directories and processes, under ``root``."""

    def __init__(self, root: Path, base_env: Mapping[str, str] | None = None) -> None:
        self.root = root
        path = os.environ.get("PATH", "/usr/local/bin:/usr/bin:/bin")
        self.base_env = dict(base_env) if base_env is not None else {"PATH": path}
        self._lock = threading.Lock()
        # sandbox id -> session id -> command id -> run, in the order they came
        self._sessions: dict[str, dict[str, dict[str, CommandRun]]] = {}
        self._loose: dict[str, list[subprocess.Popen[bytes]]] = {}  # process/execute's
        # What files/info says every file's size is (None: the truth), to play a stat that lies.
        self.stated_size: int | None = None

    # -- the file system ---------------------------------------------------------------------

    def home(self, sandbox_id: str) -> Path:
        home = self.root / sandbox_id / "home" / USER
        home.mkdir(parents=True, exist_ok=True)
        return home

    def resolve(self, sandbox_id: str, path: str) -> Path:
        """Where ``path`` is on this host: relative to the home, absolute from the sandbox's
        own root; nothing outside the sandbox's directory."""
        if not path:
            raise ApiError(400, "invalid path: empty", "INVALID_FILE_PATH")
        self.home(sandbox_id)
        inner = posixpath.normpath(posixpath.join(f"/home/{USER}", path))  # "/.." is "/"
        return self.root / sandbox_id / inner.lstrip("/")

    def write(self, sandbox_id: str, path: str, data: bytes) -> Path:
        target = self.resolve(sandbox_id, path)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(data)
        return target

    def read(self, sandbox_id: str, path: str) -> bytes | None:
        """The file's bytes; None when there is no regular file there."""
        try:
            target = self.resolve(sandbox_id, path)
        except ApiError:
            return None
        return target.read_bytes() if target.is_file() else None

    # -- sessions ----------------------------------------------------------------------------

    def create_session(self, sandbox_id: str, session_id: str) -> None:
        with self._lock:
            sessions = self._sessions.setdefault(sandbox_id, {})
            if session_id in sessions:
                raise ApiError(409, f"session {session_id} already exists", "CONFLICT")
            sessions[session_id] = {}

    def session(self, sandbox_id: str, session_id: str) -> list[CommandRun]:
        with self._lock:
            runs = self._sessions.get(sandbox_id, {}).get(session_id)
            if runs is None:
                raise ApiError(404, "session not found", "NOT_FOUND")
            return list(runs.values())

    def session_ids(self, sandbox_id: str) -> list[str]:
        with self._lock:
            return list(self._sessions.get(sandbox_id, {}))

    def command(self, sandbox_id: str, session_id: str, command_id: str) -> CommandRun:
        for run in self.session(sandbox_id, session_id):
            if run.id == command_id:
                return run
        raise ApiError(404, "command not found", "NOT_FOUND")

    def delete_session(self, sandbox_id: str, session_id: str) -> None:
        """Drop the session; whatever still runs in it is killed."""
        with self._lock:
            runs = self._sessions.get(sandbox_id, {}).pop(session_id, None)
        if runs is None:
            raise ApiError(404, "session not found", "NOT_FOUND")
        for run in runs.values():
            _kill(run.process)

    def run(
        self, sandbox_id: str, session_id: str, command: str, env: Mapping[str, str]
    ) -> CommandRun:
        """Start ``command`` in the session, in the sandbox's home."""
        self.session(sandbox_id, session_id)  # 404 before anything starts
        process = self._spawn(sandbox_id, command, env, self.home(sandbox_id))
        run = CommandRun(id=str(uuid.uuid4()), command=command, process=process)
        assert process.stdout is not None and process.stderr is not None
        run.readers = [
            _reader(process.stdout, run, run.stdout, STDOUT_PREFIX),
            _reader(process.stderr, run, run.stderr, STDERR_PREFIX),
        ]
        with self._lock:
            runs = self._sessions.get(sandbox_id, {}).get(session_id)
            if runs is None:  # deleted meanwhile
                _kill(process)
                raise ApiError(404, "session not found", "NOT_FOUND")
            runs[run.id] = run
        return run

    def _spawn(
        self, sandbox_id: str, command: str, env: Mapping[str, str], cwd: Path
    ) -> subprocess.Popen[bytes]:
        environment = {**self.base_env, "HOME": str(self.home(sandbox_id)), **env}
        return subprocess.Popen(
            ["/bin/sh", "-c", command],
            cwd=cwd,
            env=environment,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,
        )

    # -- process/execute ---------------------------------------------------------------------

    def execute(
        self,
        sandbox_id: str,
        command: str,
        env: Mapping[str, str],
        cwd: str | None,
        timeout_s: float,
    ) -> tuple[int | None, str]:
        """Run ``command`` to its end (None: killed at ``timeout_s``); its combined output."""
        directory = self.resolve(sandbox_id, cwd) if cwd else self.home(sandbox_id)
        if not directory.is_dir():
            raise ApiError(400, f"invalid working directory: {cwd}", "INVALID_FILE_PATH")
        process = self._spawn(sandbox_id, f"exec 2>&1\n{command}", env, directory)
        with self._lock:
            self._loose.setdefault(sandbox_id, []).append(process)
        try:
            output, _ = process.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            _kill(process)
            return None, ""
        finally:
            with self._lock:
                self._loose.get(sandbox_id, []).remove(process)
        code = process.returncode
        return (128 - code if code < 0 else code), output.decode(errors="replace")

    # -- ending ------------------------------------------------------------------------------

    def end(self, sandbox_id: str) -> None:
        """The sandbox stopped or went: every process it ran is killed, its sessions gone."""
        with self._lock:
            sessions = self._sessions.pop(sandbox_id, {})
            loose = self._loose.pop(sandbox_id, [])
        for runs in sessions.values():
            for run in runs.values():
                _kill(run.process)
        for process in loose:
            _kill(process)

    def close(self) -> None:
        with self._lock:
            sandbox_ids = [*self._sessions, *self._loose]
        for sandbox_id in sandbox_ids:
            self.end(sandbox_id)


def _reader(stream: IO[bytes], run: CommandRun, into: bytearray, marker: bytes) -> threading.Thread:
    def pump() -> None:
        with stream:
            while chunk := stream.read1(_CHUNK):  # type: ignore[attr-defined]
                with run.lock:
                    into.extend(chunk)
                    run.output.extend(chunk)
                    run.marked.extend(marker + chunk)

    thread = threading.Thread(target=pump, name=f"daytona-output-{run.id[:8]}", daemon=True)
    thread.start()
    return thread


def _kill(process: subprocess.Popen[bytes]) -> None:
    """Kill the process, its process group, and everything below it (the runner starts its
    steps in sessions of their own)."""
    if process.poll() is None:
        for below in descendants(process.pid):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(below.pid, signal.SIGKILL)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(process.pid, signal.SIGKILL)
    process.wait()
