"""Several api processes on one host (``CORRAL_API_PROCESSES``), sharing its listeners.

One interpreter serves the api at most on one core; a host with more cores runs several. The
parent binds the listeners (TCP, the Unix socket) once and starts that many children, each a
fresh interpreter (``python -m corral.cli.api_child``) that inherits the listening sockets
and serves them with its own event loop: the kernel hands each new connection to
whichever child accepts it first, so an idle child takes the next one.

The parent serves nothing itself but the metrics listener: each child writes its counters and
histograms to a directory of its own run (Prometheus' multiprocess mode,
``PROMETHEUS_MULTIPROC_DIR``) and the parent's listener sums them, beside the database
gauges, so one scrape sees the whole host.

A child that dies (a SIGKILL, the kernel's OOM killer) is started again, after a pause that
doubles while children keep dying before they could serve (they say so on a pipe, once their
runtime is made) or within :data:`STEADY_S` of their start (at most :data:`MAX_PAUSE_S`); the
others keep serving meanwhile. :data:`CRASH_LIMIT` such deaths in a row (the children cannot
start: a schema or setting they refuse, however long a loaded host takes to find it) stop
the parent, non-zero.
SIGTERM or SIGINT stops the children (each finishes its requests in flight), then the parent,
with status 0.

What one process holds, each child holds for itself: the org keys it found live
(``CORRAL_API_KEY_CACHE_TTL_S``: a revocation reaches the others within it, as it reaches
other hosts' api), the runner protocol's rate buckets (a caller may make up to N times the
configured rate across N processes, as across N hosts: docs/operations.md) and the ``?wait=``
caps (per process).
"""

from __future__ import annotations

import contextlib
import logging
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType

from prometheus_client import multiprocess

from corral.shared.errors import CorralError

log = logging.getLogger("corral.api")

STEADY_S = 10.0  # a child that could serve and lived this long was not crashing at its start
READY_FD_VARIABLE = "CORRAL_API_READY_FD"  # a child writes READY there once it can serve
READY = b"r"
MAX_PAUSE_S = 30.0
CRASH_LIMIT = 5
STOP_GRACE_S = 30.0  # for in-flight requests once asked to stop; then killed
MULTIPROC_VARIABLE = "PROMETHEUS_MULTIPROC_DIR"
CHILD_MODULE = "corral.cli.api_child"  # run as a script: a child's whole process
FIRST_PAUSE_S = 0.5  # after the first crash in a row; doubled for each next


class ApiProcessesFailedError(CorralError):
    """the api's child processes kept dying at their start"""


@dataclass
class _Child:
    index: int
    process: subprocess.Popen[bytes] | None = None
    started: float = 0.0
    due: float = 0.0  # when to start it again, once dead
    ready_r: int | None = None  # the pipe it says it can serve on


@dataclass
class ApiProcesses:
    """``count`` children serving ``sockets``; :meth:`run` supervises them until stopped."""

    count: int
    sockets: list[socket.socket]
    metrics_dir: Path
    crashes: int = 0
    children: list[_Child] = field(default_factory=list)
    _stopping: bool = False

    def run(self) -> None:
        """Serve until SIGTERM or SIGINT.

        Raises:
            ApiProcessesFailedError: :data:`CRASH_LIMIT` children in a row died before they
                were steady.
        """
        wake_r, wake_w = os.pipe()
        os.set_blocking(wake_w, False)
        previous = {
            number: signal.signal(number, self._on_signal)
            for number in (signal.SIGTERM, signal.SIGINT, signal.SIGCHLD)
        }
        old_fd = signal.set_wakeup_fd(wake_w)
        try:
            self.children = [_Child(index) for index in range(self.count)]
            for child in self.children:
                self._start(child)
            while not self._stopping:
                self._wait(wake_r)
                self._reap()
        finally:
            self._stop_all()
            signal.set_wakeup_fd(old_fd)
            for number, handler in previous.items():
                signal.signal(number, handler)
            os.close(wake_r)
            os.close(wake_w)

    def _on_signal(self, number: int, _frame: FrameType | None) -> None:
        if number in (signal.SIGTERM, signal.SIGINT):
            self._stopping = True

    def _wait(self, wake_r: int) -> None:
        """Until a signal, or the next dead child's restart is due."""
        due = [child.due for child in self.children if child.process is None]
        timeout = max(0.0, min(due) - time.monotonic()) if due else None
        with contextlib.suppress(InterruptedError):
            ready, _, _ = select.select([wake_r], [], [], timeout)
            if ready:
                os.read(wake_r, 512)

    def _reap(self) -> None:
        now = time.monotonic()
        for child in self.children:
            if child.process is not None and (status := child.process.poll()) is not None:
                self._died(child, status, now)
            if child.process is None and child.due <= now and not self._stopping:
                self._start(child)

    def _died(self, child: _Child, status: int, now: float) -> None:
        pid = child.process.pid if child.process else 0
        child.process = None
        _mark_dead(self.metrics_dir, pid)
        if self._stopping:
            return
        lived = now - child.started
        served = _was_ready(child)
        self.crashes = self.crashes + 1 if lived < STEADY_S or not served else 0
        how = f"signal {-status}" if status < 0 else f"status {status}"
        log.error(
            "api process %d (pid %d) ended by %s after %.1f s; starting it again",
            child.index,
            pid,
            how,
            lived,
        )
        if self.crashes >= CRASH_LIMIT:
            raise ApiProcessesFailedError(
                f"{self.crashes} api processes in a row ended before they could serve or within "
                f"{STEADY_S:.0f} s of their start; their own log lines above say why (fix "
                "that, or run one process with CORRAL_API_PROCESSES=1 to see it in the "
                "foreground)"
            )
        pause = min(MAX_PAUSE_S, FIRST_PAUSE_S * 2 ** (self.crashes - 1))
        child.due = now + pause if self.crashes else now

    def _start(self, child: _Child) -> None:
        fds = [sock.fileno() for sock in self.sockets]
        ready_r, ready_w = os.pipe()
        env = {
            **os.environ,
            MULTIPROC_VARIABLE: str(self.metrics_dir),
            READY_FD_VARIABLE: str(ready_w),
        }
        try:
            child.process = subprocess.Popen(
                [sys.executable, "-m", CHILD_MODULE, str(os.getpid()), str(child.index)]
                + [str(fd) for fd in fds],
                pass_fds=[*fds, ready_w],
                env=env,
                # Not our process group's: a terminal's Ctrl-C reaches the parent, which
                # stops the children in order rather than all at once mid-request.
                start_new_session=True,
            )
        except BaseException:
            os.close(ready_r)
            raise
        finally:
            os.close(ready_w)  # the child's alone: its end is the pipe's end
        child.ready_r = ready_r
        child.started = time.monotonic()
        log.info("api process %d started (pid %d)", child.index, child.process.pid)

    def _stop_all(self) -> None:
        alive = [child.process for child in self.children if child.process is not None]
        for process in alive:
            with contextlib.suppress(ProcessLookupError):
                process.terminate()
        deadline = time.monotonic() + STOP_GRACE_S
        for process in alive:
            try:
                process.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.warning("api process pid %d did not stop in time; killed", process.pid)
                process.kill()
                process.wait()
            _mark_dead(self.metrics_dir, process.pid)


def _was_ready(child: _Child) -> bool:
    """Whether the dead ``child`` had said it could serve; its pipe is closed."""
    if child.ready_r is None:
        return False
    try:
        return os.read(child.ready_r, 1) == READY  # its writer is gone: no wait
    finally:
        os.close(child.ready_r)
        child.ready_r = None


def _mark_dead(metrics_dir: Path, pid: int) -> None:
    """Drop a dead child's live gauges; its counters stay in the sums."""
    with contextlib.suppress(OSError):
        # untyped in prometheus_client
        multiprocess.mark_process_dead(pid, str(metrics_dir))  # type: ignore[no-untyped-call]


def new_metrics_dir(state_dir: Path) -> Path:
    """An empty directory for this run's children's metric files."""
    state_dir.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix="api-metrics-", dir=state_dir))


def remove_metrics_dir(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)
