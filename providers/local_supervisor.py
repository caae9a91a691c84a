"""Supervisor of one local sandbox. Standard library only; run as a script by the provider.

It is the leader of the sandbox's process group. It starts the sandbox's entrypoint (inside
bubblewrap when the provider isolates), applies the memory limit, enforces the deadline, and
writes the outcome to a result file, so that any worker process — not only the one that
started the sandbox — can tell what happened.

It is also the sandbox's child subreaper: a process of the sandbox whose parent dies (the
pid-1 bubblewrap, once the outer one has exited) becomes its child rather than init's. At the
end it kills what is left and reaps it all, so that nothing outlives the sandbox, not even as
a zombie for an init that may never collect it. Only the supervisor itself is left for the
worker that started it to reap.

    python -I -S local_supervisor.py LAUNCH_JSON

LAUNCH_JSON holds: argv, timeout_s, grace_s, memory_bytes, result_path, started_path, and
bwrap_status (whether argv is bubblewrap, to be asked for its JSON status stream).
"""

from __future__ import annotations

import contextlib
import ctypes
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


_PR_SET_CHILD_SUBREAPER = 36  # linux/prctl.h
_END_LIMIT_S = 5.0


def _become_subreaper() -> None:
    """Orphaned processes of the sandbox become this process's children (Linux 3.4+); best
    effort: elsewhere they go to init, as before."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)


def _left_behind(me: int) -> list[int]:
    """Live processes of this sandbox but the supervisor: its process group, and the
    children it adopted as subreaper (those that left the group included)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == me:
            continue
        try:
            with open(f"/proc/{entry}/stat", encoding="ascii", errors="replace") as handle:
                stat = handle.read()
        except OSError:
            continue  # gone meanwhile
        fields = stat[stat.rindex(")") + 2 :].split()
        state, parent, group = fields[0], int(fields[1]), int(fields[2])
        if state != "Z" and me in (group, parent):
            found.append(int(entry))
    return found


def _reap_exited() -> bool:
    """Collect every child that has ended; whether any child is still running."""
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return False
        if pid == 0:
            return True


def _end_sandbox(limit_s: float = _END_LIMIT_S) -> None:
    """Kill what the entrypoint left behind and reap it, until nothing is left (or, should a
    process keep escaping, until ``limit_s`` has passed)."""
    me = os.getpid()
    deadline = time.monotonic() + limit_s
    while True:
        left = _left_behind(me)
        for pid in left:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        running = _reap_exited()
        if (not left and not running) or time.monotonic() > deadline:
            return
        time.sleep(0.002)


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
    _become_subreaper()
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
    # The entrypoint is done: nothing it left behind outlives it. Ended before the result is
    # written, so that a sandbox read as finished has no process left but this one.
    _end_sandbox()
    _write_json(launch["result_path"], result)
    sys.stdout.flush()
    # Gone the moment the result is there, without the interpreter's teardown: whoever waits
    # for this supervisor to end (a terminate in another process) reads the result just after.
    os._exit(0)


if __name__ == "__main__":
    main()
