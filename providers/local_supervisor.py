"""Supervisor of one local sandbox. Standard library only; run as a script by the provider.

It is the leader of the sandbox's process group. It starts the sandbox's entrypoint (inside
bubblewrap when the provider isolates), applies the memory limit, enforces the deadline, and
writes the outcome to a result file, so that any worker process — not only the one that
started the sandbox — can tell what happened.

    python -I -S local_supervisor.py LAUNCH_JSON

LAUNCH_JSON holds: argv, timeout_s, grace_s, memory_bytes, result_path, started_path, and
bwrap_status (whether argv is bubblewrap, to be asked for its JSON status stream).
"""

from __future__ import annotations

import json
import os
import resource
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from typing import IO, Any


def _write_json(path: str, payload: dict[str, Any]) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w", encoding="utf-8") as handle:
        json.dump(payload, handle)
    os.replace(tmp, path)


def _prepare_child(memory_bytes: int | None) -> Callable[[], None]:
    """Runs in the child between fork and exec: its own signal mask and memory limit."""

    def apply() -> None:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})
        if memory_bytes:
            resource.setrlimit(resource.RLIMIT_AS, (memory_bytes, memory_bytes))

    return apply


def _await_setup(ns_pid: int, child: subprocess.Popen[bytes], limit_s: float = 10.0) -> bool:
    """Wait until bubblewrap has built the sandbox.

    bubblewrap reports its namespace pid before the sandbox's root is ready; its init forks
    the entrypoint only once setup is done, so the first child of that pid is the signal.
    """
    children = f"/proc/{ns_pid}/task/{ns_pid}/children"
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline and child.poll() is None:
        try:
            with open(children, encoding="ascii") as handle:
                if handle.read().strip():
                    return True
        except FileNotFoundError:
            return False
        time.sleep(0.001)
    return False


def _start(launch: dict[str, Any]) -> tuple[subprocess.Popen[bytes], IO[bytes] | None]:
    """Start the entrypoint; return it and the bubblewrap status stream (kept open)."""
    # A TERM that lands while the child starts is handled once it has started.
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    argv = list(launch["argv"])
    status_read = None
    pass_fds: tuple[int, ...] = ()
    if launch.get("bwrap_status"):
        status_read, status_write = os.pipe()
        argv[1:1] = ["--json-status-fd", str(status_write)]
        pass_fds = (status_write,)
    # The supervisor is single-threaded, so preexec_fn is safe here.
    child = subprocess.Popen(
        argv,
        stdin=subprocess.DEVNULL,
        pass_fds=pass_fds,
        preexec_fn=_prepare_child(launch.get("memory_bytes")),  # noqa: PLW1509
    )
    started: dict[str, Any] = {"child_pid": child.pid, "ns_pid": None, "setup_ok": True}
    status: IO[bytes] | None = None
    if status_read is not None:
        os.close(pass_fds[0])
        status = os.fdopen(status_read, "rb")
        started.update(_await_sandbox(status, child))
    _write_json(launch["started_path"], started)
    return child, status


def _await_sandbox(status: IO[bytes], child: subprocess.Popen[bytes]) -> dict[str, Any]:
    """Read bubblewrap's status stream until the sandbox is built, or known not to be.

    bubblewrap writes {"child-pid": N} first, and {"exit-code": N} only if the entrypoint
    really ran. Setup and exec failures write no exit code.
    """
    first = status.readline()
    ns_pid = json.loads(first).get("child-pid") if first.strip() else None
    if ns_pid is not None and _await_setup(ns_pid, child):
        return {"ns_pid": ns_pid, "setup_ok": True}
    # The entrypoint was never seen running: it either finished at once or never started.
    return {"ns_pid": None, "setup_ok": b'"exit-code"' in status.read()}


class _TerminationRequestedError(Exception):
    """SIGTERM arrived: the provider is terminating the sandbox."""


_stopping = False


def _on_term(signum: int, frame: object) -> None:
    # Only the first TERM interrupts; once the supervisor is stopping the group (which sends
    # TERM to itself too) or writing its result, further ones change nothing.
    global _stopping  # noqa: PLW0603 - a signal handler has no other way to keep state
    if not _stopping:
        _stopping = True
        raise _TerminationRequestedError


def _stop_group(child: subprocess.Popen[bytes], grace_s: float) -> int | None:
    """TERM the whole group, give it ``grace_s`` to exit, and report the child's code."""
    global _stopping  # noqa: PLW0603
    _stopping = True
    os.killpg(0, signal.SIGTERM)
    try:
        return child.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        return None


def main() -> None:
    with open(sys.argv[1], encoding="utf-8") as handle:
        launch = json.load(handle)
    signal.signal(signal.SIGTERM, _on_term)
    child, status_stream = _start(launch)
    grace_s = launch.get("grace_s", 5)
    try:
        # A TERM that arrived while the child started is delivered here, inside the try.
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})
        exit_code = child.wait(timeout=launch.get("timeout_s"))
        result: dict[str, Any] = {"reason": "exited", "exit_code": exit_code}
    except subprocess.TimeoutExpired:
        result = {"reason": "deadline", "exit_code": _stop_group(child, grace_s)}
    except _TerminationRequestedError:
        result = {"reason": "terminated", "exit_code": _stop_group(child, grace_s)}
    global _stopping  # noqa: PLW0603
    _stopping = True  # from here on, nothing interrupts writing the result
    if status_stream is not None:
        # Held open until here so bubblewrap can always report the exit code.
        status_stream.close()
    result["ended_at"] = time.time()
    _write_json(launch["result_path"], result)
    sys.stdout.flush()
    # The entrypoint is done: nothing it left behind in its process group outlives it,
    # this supervisor included.
    os.killpg(0, signal.SIGKILL)


if __name__ == "__main__":
    main()
