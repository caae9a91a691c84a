"""Process groups of local sandboxes: telling a pid from its reuse, liveness, signals,
and running one bounded command in its own group."""

from __future__ import annotations

import contextlib
import os
import select
import selectors
import signal
import subprocess
import time
from pathlib import Path

from corral.providers.base import ExecResult
from corral.providers.errors import ProviderTimeoutError
from corral.providers.size_limits import CHUNK_BYTES, ExecOutput


def _proc_stat(pid: int) -> tuple[str, int] | None:
    """The process's state letter and start time (clock ticks since boot), or None."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):  # gone before, or while, it was read
        return None
    # Field 2 (comm) may contain spaces; the fields after its closing parenthesis are fixed.
    fields = stat[stat.rindex(")") + 2 :].split()
    return fields[0], int(fields[19])


def start_ticks(pid: int) -> int | None:
    """The process's start time in clock ticks since boot: tells a pid from its reuse."""
    stat = _proc_stat(pid)
    return None if stat is None else stat[1]


def process_alive(pid: int | None, expected_ticks: int | None) -> bool:
    """Whether ``pid`` is still the process that started at ``expected_ticks`` (not a zombie)."""
    stat = None if pid is None else _proc_stat(pid)
    return stat is not None and stat[0] != "Z" and stat[1] == expected_ticks


def await_exit(pid: int | None, expected_ticks: int | None, limit_s: float) -> bool:
    """Wait until the process that started at ``expected_ticks`` has ended (a zombie has);
    whether it did within ``limit_s``. Woken by the kernel when it exits (a pidfd, which also
    holds its pid from reuse while it is waited on), not by looking every few milliseconds;
    a kernel before 5.3 is looked at every ``POLL_S``."""
    if not process_alive(pid, expected_ticks):
        return True
    assert pid is not None
    try:
        exited = os.pidfd_open(pid)
    except ProcessLookupError:  # gone since
        return True
    except OSError:  # no pidfds here
        return _poll_exit(pid, expected_ticks, limit_s)
    try:
        if not process_alive(pid, expected_ticks):  # ended, or its pid reused, before the open
            return True
        select.select([exited], [], [], limit_s)
        return not process_alive(pid, expected_ticks)
    finally:
        os.close(exited)


POLL_S = 0.002


def _poll_exit(pid: int, expected_ticks: int | None, limit_s: float) -> bool:
    deadline = time.monotonic() + limit_s
    while process_alive(pid, expected_ticks):
        if time.monotonic() > deadline:
            return False
        time.sleep(POLL_S)
    return True


def owns_group(pid: int, expected_ticks: int | None) -> bool:
    """Whether process group ``pid`` is still the sandbox's, and has members.

    The kernel does not hand out a pid while a process group still uses it as its id, so a
    group whose leader is gone is ours. A live process with that pid but another start time
    is a newcomer that reused the pid: never signal it.
    """
    ticks = start_ticks(pid)
    if ticks is None:
        return group_exists(pid)
    return ticks == expected_ticks


def group_exists(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def signal_group(pgid: int, signum: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, signum)


# The guard's kill comes this long after the caller's own, which it only backs up.
GUARD_GRACE_S = 1.0


def run_bounded(
    argv: list[str],
    *,
    cwd: Path,
    env: dict[str, str],
    timeout_s: float | None,
    max_output_bytes: int,
    guard: str | None = None,
    pass_fds: tuple[int, ...] = (),
) -> ExecResult:
    """Run ``argv`` in its own process group; kill the whole group on timeout. Of stdout and
    of stderr, at most ``max_output_bytes`` each are kept: the rest is read and dropped.

    ``guard``: coreutils' ``timeout`` (its path), which then leads the group and kills all of
    it ``GUARD_GRACE_S`` after the timeout: should this process die first (an api killed
    mid-call), the command still ends then instead of running on unwatched."""
    started = time.monotonic()
    if guard is not None and timeout_s is not None:
        argv = [guard, "--signal=KILL", f"{timeout_s + GUARD_GRACE_S:g}", *argv]
    deadline = None if timeout_s is None else started + timeout_s
    output = ExecOutput(max_output_bytes)
    with subprocess.Popen(
        argv,
        cwd=cwd,
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,
        pass_fds=pass_fds,
    ) as process:
        try:
            _read_output(process, output, deadline)
            process.wait(timeout=None if deadline is None else max(deadline - time.monotonic(), 0))
        except subprocess.TimeoutExpired as exc:
            signal_group(process.pid, signal.SIGKILL)
            process.wait()
            raise ProviderTimeoutError(
                f"command did not finish within {timeout_s}s and was killed"
            ) from exc
    elapsed = time.monotonic() - started
    guarded = guard is not None and timeout_s is not None and elapsed >= timeout_s
    if guarded and process.returncode == -signal.SIGKILL:
        # The guard was first (this process was slow to wake): a timeout all the same.
        raise ProviderTimeoutError(f"command did not finish within {timeout_s}s and was killed")
    return output.result(exit_code=process.returncode, duration_s=elapsed)


def _read_output(
    process: subprocess.Popen[bytes], output: ExecOutput, deadline: float | None
) -> None:
    """Read the process's stdout and stderr as they come, until both end, into ``output``
    (which keeps what fits). ``communicate()`` would hold all of it.

    Raises:
        subprocess.TimeoutExpired: ``deadline`` passed first.
    """
    assert process.stdout is not None and process.stderr is not None
    buffers = {process.stdout.fileno(): output.stdout, process.stderr.fileno(): output.stderr}
    with selectors.DefaultSelector() as selector:
        for descriptor in buffers:
            selector.register(descriptor, selectors.EVENT_READ)
        while selector.get_map():
            remaining = None if deadline is None else deadline - time.monotonic()
            if remaining is not None and remaining <= 0:
                raise subprocess.TimeoutExpired(process.args, 0)
            for key, _ in selector.select(remaining):
                chunk = os.read(key.fd, CHUNK_BYTES)
                if chunk:
                    buffers[key.fd].add(chunk)
                else:  # the end of this stream
                    selector.unregister(key.fd)
