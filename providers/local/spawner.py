"""The provider's side of the supervisor spawner (:mod:`corral.providers.local.supervisor`).

One spawner per provider, started on the first provision and kept: each launch after that
is a message on its stdin, which a supervisor it forked ahead of time takes, rather than a
Python interpreter starting for every sandbox.
"""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from corral.providers.errors import SandboxCreateError
from corral.providers.local.processes import process_alive, start_ticks

SUPERVISOR = Path(__file__).with_name("supervisor.py")


class SupervisorSpawner:
    """Starts local sandboxes' supervisors through one spawner process.

    The spawner is this process's child; a thread waits for it, so that it is collected
    whenever it ends. It ends only after :meth:`close` (or this process's end), once the
    sandboxes it started have ended: they do not depend on the worker that started them.
    """

    def __init__(self, path: str) -> None:
        self.path = path  # PATH of the spawner, which passes no other variable on
        self._lock = threading.Lock()
        self._process: subprocess.Popen[bytes] | None = None
        self._process_start = 0
        self._owner = os.getpid()

    def spawn(self, launch: dict[str, Any], timeout_s: float) -> tuple[int, int | None]:
        """Have a supervisor run ``launch``: its pid and start time, already written into
        the sandbox's record.

        Raises:
            SandboxCreateError: the spawner could not be started or did not answer.
        """
        with self._lock:
            process = self._running()
            assert process.stdin is not None and process.stdout is not None
            try:
                body = json.dumps(launch).encode()
                _write_all(process.stdin.fileno(), b"%010d" % len(body) + body)
                answer = json.loads(_read_line(process.stdout.fileno(), timeout_s))
            except (OSError, ValueError) as exc:
                self._close_locked()  # the next provision starts a fresh spawner
                raise SandboxCreateError(f"the local supervisor spawner failed: {exc}") from exc
        return answer["pid"], answer["start"]

    def close(self) -> None:
        """Take no more launches; the spawner exits once its sandboxes have ended."""
        with self._lock:
            self._close_locked()

    def _running(self) -> subprocess.Popen[bytes]:
        if self._owner != os.getpid():  # forked: the spawner is the parent process's
            self._process, self._owner = None, os.getpid()
        if self._process is not None and process_alive(self._process.pid, self._process_start):
            return self._process
        self._close_locked()
        process = subprocess.Popen(
            [sys.executable, "-I", "-S", str(SUPERVISOR)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            bufsize=0,
            cwd="/",
            env={"PATH": self.path},
            start_new_session=True,
        )
        self._process, self._process_start = process, start_ticks(process.pid) or 0
        threading.Thread(target=process.wait, name="local-spawner-wait", daemon=True).start()
        return process

    def _close_locked(self) -> None:
        if self._process is not None:
            for pipe in (self._process.stdin, self._process.stdout):
                if pipe is not None:
                    pipe.close()
            self._process = None


def _write_all(fd: int, data: bytes) -> None:
    while data:
        data = data[os.write(fd, data) :]


def _read_line(fd: int, timeout_s: float) -> bytes:
    """One line from ``fd``, or an error once ``timeout_s`` has passed or the file ends."""
    line = b""
    deadline = time.monotonic() + timeout_s
    while not line.endswith(b"\n"):
        remaining = deadline - time.monotonic()
        if remaining <= 0 or not select.select([fd], [], [], remaining)[0]:
            raise TimeoutError(f"no answer within {timeout_s}s")
        chunk = os.read(fd, 4096)
        if not chunk:
            raise ConnectionError("the spawner ended")
        line += chunk
    return line
