"""``corral dev`` owns its state directory: one at a time.

A second ``corral dev`` on the same directory would overwrite the first's admin token and, as
it stopped, remove the api-url file and the api socket the first one's sandboxes use. So each
takes an exclusive lock (``fcntl.flock``) on ``<state_dir>/dev.lock`` before it writes or
binds anything there, and writes its pid and api URL into the file; the kernel releases the
lock when the process ends, however it ends. The file itself stays: removing a lock file
would let a third process lock a new file while a second still holds the old one.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from collections.abc import Iterator
from pathlib import Path

from corral.shared.errors import CorralError

LOCK_FILE = "dev.lock"


class StateDirTakenError(CorralError):
    """another `corral dev` holds this state directory"""

    code = "state_dir_taken"


def _holder(fd: int) -> str:
    """What the lock file says of the process holding it: ``pid N, api URL``."""
    try:
        pid, _, url = os.pread(fd, 4096, 0).decode(errors="replace").strip().partition(" ")
    except OSError:
        pid, url = "", ""
    if not pid.isdigit():  # it has not written its line yet
        return "pid unknown"
    return f"pid {pid}, api {url}" if url else f"pid {pid}"


@contextlib.contextmanager
def holding_state_dir(state_dir: Path, api_url: str) -> Iterator[None]:
    """Hold ``state_dir`` for this process (its pid and ``api_url`` in the lock file).

    Raises:
        StateDirTakenError: another process holds it; nothing in the directory was changed.
    """
    state_dir.mkdir(parents=True, exist_ok=True)
    path = state_dir / LOCK_FILE
    # Not inherited by the processes corral dev starts (Python's descriptors never are):
    # a sandbox's spawner that outlives it must not keep the directory locked.
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise StateDirTakenError(
                f"another `corral dev` ({_holder(fd)}) holds the state directory {state_dir}; "
                "stop it first, or give this one a CORRAL_STATE_DIR of its own"
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()} {api_url}\n".encode(), 0)
        yield
    finally:
        os.close(fd)  # and with it the lock


def holder(state_dir: Path) -> tuple[int, str] | None:
    """The pid and api URL of the ``corral dev`` holding ``state_dir``, as its lock file says
    (its URL is there before its api answers); None when no such process runs."""
    try:
        pid, _, url = (state_dir / LOCK_FILE).read_text().strip().partition(" ")
        command = Path(f"/proc/{pid}/cmdline").read_bytes() if pid.isdigit() else b""
    except OSError:
        return None
    # A pid that was reused since runs something else.
    return (int(pid), url) if b"corral" in command and b"dev" in command else None
