"""Local sandbox start time against bubblewrap alone (issue "Dispatch at the broker's speed").

In one run, interleaved A/B/A/B:

(A) bubblewrap alone: the argv the local provider builds for a sandbox
    (``IsolationPlan.argv``, the same binds, namespaces and command), spawned directly.
(B) ``LocalProvider.provision()`` called, isolation required, for the same command.

Both clocks stop when the command is running: it opens a FIFO for writing, and a reader
process blocked in ``open()`` on the FIFO's other end reads CLOCK_MONOTONIC the moment
``open()`` returns. The reader is a process of its own, so the provider's threads never
delay the reading. The FIFO lives in a directory both sides bind read-only; under a root
worker the command runs as the sandbox's own unprivileged user (a uid of the provider's
range), so the FIFO is writable by any user (mode 0622), and (A) runs as that user too. A
command that never opens it fails the run after ``OPEN_TIMEOUT_S``, naming the FIFO and
what became of the sandbox.

Prints p50/p90 of A and B, the ratio of the medians B/A (target <= 1.5), and, for
information, when ``provision()`` returned.

Sandboxes are made where the provider makes them by default (a scratch directory under
``<CORRAL_STATE_DIR>/local-sandboxes``, removed afterwards), or under ``--root``: creating
the sandbox's directories is part of ``provision()``, and its cost depends on the file
system (on some hosts a directory under /tmp takes ten times longer to create).

Usage: python -m bench.local_start [--rounds N] [--root DIR] [--smoke]
"""

from __future__ import annotations

import argparse
import os
import select
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path

from pydantic import SecretStr

from bench.harness import WaitTimeoutError, add_smoke_flag, say_smoke, until
from corral.providers.base import SandboxHandle, SandboxSpec
from corral.providers.local.disk import SandboxDisk
from corral.providers.local.isolation import SANDBOX_LIB_DIR, find_bwrap
from corral.providers.local.provider import BASE_PATH, LocalProvider, _SandboxDir
from corral.shared.settings import CoreSettings

# Opens the FIFO for writing (the moment the reader's open() returns) and ends.
COMMAND = ("sh", "-c", ': > "$1"', "sh")
# The sandbox's user is not the FIFO's owner (root, under a root worker): any user may
# open it for writing, only its owner for reading.
FIFO_MODE = 0o622
OPEN_TIMEOUT_S = 30.0  # a sandbox starts in tens of milliseconds; this is a failure
EXIT_TIMEOUT_S = 10.0

# One line in (a FIFO path), "armed" out before blocking in open(), then the time it opened.
READER = """
import os, sys, time
for line in sys.stdin:
    print("armed", flush=True)
    fd = os.open(line.strip(), os.O_RDONLY)
    opened = time.monotonic_ns()
    os.close(fd)
    print(opened, flush=True)
"""


class FifoClock:
    """Tells when a command opened a FIFO, from a reader process of its own."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.reader = subprocess.Popen(
            [sys.executable, "-I", "-c", READER],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            bufsize=0,
        )

    def arm(self) -> Path:
        """A fresh FIFO the reader is (about to be) blocked on."""
        fifo = self.directory / f"go-{uuid.uuid4().hex[:8]}"
        os.mkfifo(fifo)
        os.chmod(fifo, FIFO_MODE)  # not the umask's: the sandbox's user writes to it
        assert self.reader.stdin is not None
        self.reader.stdin.write(f"{fifo}\n".encode())
        armed = self._line(5.0, f"the FIFO reader to take {fifo}")
        assert armed == "armed", armed
        time.sleep(0.005)  # the reader is in open() well before any sandbox can be
        return fifo

    def opened_at(self, fifo: Path) -> int:
        """When the command opened ``fifo`` (CLOCK_MONOTONIC, ns).

        Raises:
            WaitTimeoutError: nothing opened it within OPEN_TIMEOUT_S; the reader is released.
        """
        try:
            line = self._line(OPEN_TIMEOUT_S, f"the sandbox's command to open {fifo}")
        except WaitTimeoutError:
            # Release the reader from its open(), so that the clock can close.
            os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
            self._line(5.0, f"the FIFO reader to return from opening {fifo}")
            fifo.unlink()
            raise
        fifo.unlink()
        return int(line)

    def _line(self, timeout_s: float, what: str) -> str:
        """The reader's next line, within ``timeout_s``."""
        assert self.reader.stdout is not None
        pipe = self.reader.stdout.fileno()
        line = b""
        deadline = time.monotonic() + timeout_s
        while not line.endswith(b"\n"):
            ready, _, _ = select.select([pipe], [], [], max(0.0, deadline - time.monotonic()))
            if not ready:
                raise WaitTimeoutError(f"waited {timeout_s:g} s for {what}")
            chunk = os.read(pipe, 64)
            if not chunk:
                raise RuntimeError(f"the FIFO reader exited ({self.reader.poll()}) before {what}")
            line += chunk
        return line.decode().strip()

    def close(self) -> None:
        assert self.reader.stdin is not None
        self.reader.stdin.close()
        try:
            self.reader.wait(timeout=2)
        except subprocess.TimeoutExpired:  # still blocked on a FIFO nobody opened
            self.reader.kill()
            self.reader.wait()


def make_spec(fifo: Path) -> SandboxSpec:
    sandbox_id = f"sb-bench-{uuid.uuid4().hex[:10]}"
    return SandboxSpec(
        work_item_id=f"wi-{sandbox_id}",
        sandbox_id=sandbox_id,
        org_id="bench",
        project_id="bench",
        registration_token=SecretStr("crt_bench"),
        control_url="http://127.0.0.1:9",
        provider_options={"command": [*COMMAND, str(fifo)]},
    )


def bubblewrap_alone(provider: LocalProvider, clock: FifoClock, work: Path) -> float:
    """(A) Seconds from spawning bubblewrap with the provider's argv to the command running:
    its namespaces, binds and, under a root worker, its user (setpriv, a uid of the range)."""
    fifo = clock.arm()
    spec = make_spec(fifo)
    box = _SandboxDir(work, spec.sandbox_id)
    box.work.mkdir(parents=True)
    # The sandbox's /tmp where the provider's disk image would hold it: a plain directory
    # here (making and mounting the image is part of what B costs).
    tmp = SandboxDisk(box.path).tmp
    tmp.mkdir(parents=True)
    tmp.chmod(0o1777)
    bwrap = find_bwrap(provider.config.bwrap_path)
    assert bwrap is not None
    run_as = provider._run_as(bwrap)  # the range's first uid: the one B's sandbox gets
    if run_as is not None:
        os.chown(box.work, run_as[1], run_as[2])
    plan = provider._isolation_plan(spec, box, bwrap, run_as)  # the provider's own arguments
    env = {
        "PATH": BASE_PATH,
        "HOME": str(box.work),
        "PYTHONPATH": SANDBOX_LIB_DIR,
        **spec.sandbox_env(),
    }
    started = time.monotonic_ns()
    process = subprocess.Popen(
        plan.argv([*COMMAND, str(fifo)]),
        cwd=box.work,
        env=env,
        stdin=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        opened = clock.opened_at(fifo)
    except WaitTimeoutError as error:
        process.kill()
        raise WaitTimeoutError(f"{error} (A: bubblewrap exited with {process.wait()})") from error
    until(lambda: process.poll() is not None, "bubblewrap alone to exit (A)", EXIT_TIMEOUT_S)
    shutil.rmtree(box.path)
    return (opened - started) / 1e9


def through_provider(provider: LocalProvider, clock: FifoClock, returned: list[float]) -> float:
    """(B) Seconds from provision() being called to the command running."""
    fifo = clock.arm()
    spec = make_spec(fifo)
    started = time.monotonic_ns()
    handle = provider.provision(spec)
    returned.append((time.monotonic_ns() - started) / 1e9)
    try:
        opened = clock.opened_at(fifo)
    except WaitTimeoutError as error:
        raise WaitTimeoutError(f"{error} (B: {_ended(provider, handle)})") from error
    until(
        lambda: provider.status(handle).state.is_final,
        f"the provider's sandbox {handle.external_id} to end (B)",
        EXIT_TIMEOUT_S,
        poll_s=0.005,
    )
    provider.terminate(handle)
    return (opened - started) / 1e9


def _ended(provider: LocalProvider, handle: SandboxHandle) -> str:
    """What became of a sandbox whose command did not start, and its output's tail."""
    status = provider.status(handle)
    provider.terminate(handle)
    box = _SandboxDir(provider.root, handle.external_id)
    log = box.path / "output.log"
    output = log.read_text(errors="replace")[-400:].strip() if log.exists() else ""
    return f"the sandbox is {status.state.value}: {status.reason}; its output: {output!r}"


def percentile(values: list[float], fraction: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(fraction * (len(ordered) - 1)))]


def row(name: str, values: list[float]) -> str:
    p50, p90 = 1000 * percentile(values, 0.5), 1000 * percentile(values, 0.9)
    return f"| {name} | {p50:.1f} ms | {p90:.1f} ms | {len(values)} |"


def _commit() -> str:
    def git(*args: str) -> str:
        run = subprocess.run(["git", *args], check=False, capture_output=True, text=True)
        return run.stdout.strip()

    changed = git("status", "--porcelain", "--untracked-files=no")
    return (git("log", "-1", "--format=%h %s") or "(unknown)") + (" + changes" if changed else "")


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--root", type=Path, default=CoreSettings().state_dir / "local-sandboxes")
    add_smoke_flag(parser)
    args = parser.parse_args()
    if args.smoke:
        args.rounds = 1
    say_smoke(args.smoke)
    load_before = os.getloadavg()[0]
    args.root.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix="bench-", dir=args.root))
    fifos, work = scratch / "fifos", scratch / "bwrap-alone"
    fifos.mkdir()
    work.mkdir()
    provider = LocalProvider(
        {
            "root_dir": scratch / "sandboxes",
            "isolation": "required",
            "read_only_binds": [str(fifos)],
        }
    )
    clock = FifoClock(fifos)
    alone: list[float] = []
    ours: list[float] = []
    returned: list[float] = []
    sides: list[Callable[[], float]] = [
        lambda: bubblewrap_alone(provider, clock, work),
        lambda: through_provider(provider, clock, returned),
    ]
    try:
        for side in sides:  # first-use costs (page cache, the provider's first start)
            side()
        returned.clear()
        for _ in range(args.rounds):
            alone.append(sides[0]())
            ours.append(sides[1]())
    finally:
        clock.close()
        shutil.rmtree(scratch, ignore_errors=True)
    user = f"uid {provider.config.sandbox_uid}" if os.geteuid() == 0 else "the worker's user"
    _report(f"sandboxes under {args.root}, run as {user}", load_before, alone, ours, returned)


def _report(
    where: str, load_before: float, alone: list[float], ours: list[float], returned: list[float]
) -> None:
    print(f"{time.strftime('%Y-%m-%d %H:%M')} at commit {_commit()}")
    print(f"load average (1 min): {load_before:.2f} before, {os.getloadavg()[0]:.2f} after")
    print(where)
    print("| measurement | p50 | p90 | rounds |\n|---|---|---|---|")
    print(row("(A) bubblewrap alone: spawn -> command running", alone))
    print(row("(B) provision() called -> command running", ours))
    print(row("provision() called -> provision() returned", returned))
    ratio = statistics.median(ours) / statistics.median(alone)
    print(f"B/A (ratio of the medians): {ratio:.2f} (target <= 1.5)")


if __name__ == "__main__":
    main()
