"""Runs one step (a command) as a subprocess, streaming its output, until it ends or must stop.

Each step gets its own process group, so that stopping it reaches everything it started:
a cancel from the control plane or the work phase's deadline sends SIGTERM to the group,
waits ``grace_s`` for the step to exit, then SIGKILLs whatever is left.
"""

from __future__ import annotations

import os
import select
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence

from .diagnostics import logger
from .logs import MAX_LINE_BYTES
from .records import record

TYPE_CHECKING = False  # not typing's: see corral.runner.records
if TYPE_CHECKING:
    from typing import IO, Literal

    Interruption = Literal["cancelled", "timed_out"]

LineSink = Callable[[str, str], None]

POLL_S = 0.05
GRACE_S = 5.0
# After a step exits, how long its output may still take to drain. A background process it
# left behind may hold the pipes open for ever; its later lines still arrive, unwaited for.
DRAIN_S = 1.0


class Cancellation:
    """Set once, from any thread or a signal handler, when the work must stop.

    Deliberately lock-free (one attribute assignment): a signal handler runs on the main
    thread between bytecodes and must never wait for a lock that thread may hold.
    """

    def __init__(self) -> None:
        self.reason: str | None = None

    def cancel(self, reason: str) -> None:
        if self.reason is None:
            self.reason = reason


@record
class StepOutcome:
    """How a step ended: its exit status, and whether the runner stopped it."""

    returncode: int
    interrupted: Interruption | None = None


def run_step(
    argv: Sequence[str],
    *,
    env: Mapping[str, str],
    sink: LineSink,
    cancellation: Cancellation,
    deadline: float | None = None,
    grace_s: float = GRACE_S,
) -> StepOutcome:
    """Run ``argv`` in the current directory; ``deadline`` is a ``time.monotonic()`` value.

    Output goes to ``sink(stream, line)`` line by line as it is produced.
    """
    interrupted = _interruption(cancellation, deadline)
    if interrupted is not None:
        return StepOutcome(returncode=-signal.SIGTERM, interrupted=interrupted)
    try:
        process = subprocess.Popen(
            list(argv),
            env=dict(env),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,
        )
    except OSError as error:
        sink("system", f"could not start {argv[0]}: {error}")
        return StepOutcome(returncode=127)
    assert process.stdout is not None
    assert process.stderr is not None
    readers = [_pump(process.stdout, "stdout", sink), _pump(process.stderr, "stderr", sink)]
    interrupted = _wait(process, cancellation, deadline)
    if interrupted is not None:
        _stop_group(process, grace_s)
    for reader in readers:
        reader.join(timeout=DRAIN_S)
    return StepOutcome(returncode=process.wait(), interrupted=interrupted)


def _interruption(cancellation: Cancellation, deadline: float | None) -> Interruption | None:
    if cancellation.reason is not None:
        return "cancelled"
    if deadline is not None and time.monotonic() >= deadline:
        return "timed_out"
    return None


def _wait(
    process: subprocess.Popen[bytes], cancellation: Cancellation, deadline: float | None
) -> Interruption | None:
    """Wait for the step to exit, waking every ``POLL_S`` to notice a cancel or the deadline.

    Blocked on the process's pidfd where there is one: ``Popen.wait(timeout)`` polls with
    sleeps of its own, about ten wake-ups per ``POLL_S``, which a long step pays for in CPU.
    """
    try:
        pidfd = os.pidfd_open(process.pid)
    except (AttributeError, OSError):  # not Linux 5.3+, or refused (a seccomp filter)
        pidfd = None
    try:
        while True:
            interrupted = _interruption(cancellation, deadline)
            if interrupted is not None:
                return interrupted
            timeout = POLL_S
            if deadline is not None:
                timeout = max(0.0, min(POLL_S, deadline - time.monotonic()))
            if pidfd is not None:
                select.select([pidfd], [], [], timeout)
                timeout = 0.0  # readable or not: the wait below only reaps
            try:
                process.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                continue
            return None
    finally:
        if pidfd is not None:
            os.close(pidfd)


def _stop_group(process: subprocess.Popen[bytes], grace_s: float) -> None:
    """SIGTERM the step's group, wait up to ``grace_s`` for the step, then SIGKILL the rest."""
    _signal_group(process.pid, signal.SIGTERM)
    try:
        process.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        logger.warning("step did not exit %.0fs after SIGTERM; sending SIGKILL", grace_s)
    # Also reaches anything in the group that outlived the step itself.
    _signal_group(process.pid, signal.SIGKILL)
    process.wait()


def _signal_group(pgid: int, signum: int) -> None:
    try:
        os.killpg(pgid, signum)
    except ProcessLookupError:
        pass  # the group is already empty
    except PermissionError as error:
        logger.warning("could not signal process group %d: %s", pgid, error)


def _pump(pipe: IO[bytes], stream: str, sink: LineSink) -> threading.Thread:
    """Start a thread that feeds ``pipe``'s lines to ``sink`` until end of file."""

    def pump() -> None:
        with pipe:
            for line in _lines(pipe):
                sink(stream, line)

    thread = threading.Thread(target=pump, name=f"corral-{stream}", daemon=True)
    thread.start()
    return thread


def _lines(pipe: IO[bytes]) -> Iterator[str]:
    """Decoded lines without their line ending; an overlong line is cut, its rest skipped."""
    limit = MAX_LINE_BYTES + 1
    skipping = False
    while True:
        chunk = pipe.readline(limit)
        if not chunk:
            return
        if not skipping:
            yield chunk.rstrip(b"\r\n").decode("utf-8", errors="replace")
        skipping = not chunk.endswith(b"\n")
