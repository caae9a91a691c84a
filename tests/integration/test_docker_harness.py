"""The Docker test harness gives each run an engine of its own (which the pytest-xdist
workers of the run share), and the next run stops the engine of a run that was killed before
it could stop its own."""

from __future__ import annotations

import fcntl
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

from tests.conftest import IN_CI, require
from tests.docker_engine import (
    DockerEngine,
    _exclusive,
    _is_alive,
    ensure_engine,
    stop_abandoned_engines,
)

REPO = Path(__file__).resolve().parents[2]
# A test run of its own: it starts its engine, says where, and waits to be killed.
RUN = (
    "from tests.docker_engine import ensure_engine; import time; "
    "engine = ensure_engine(); print(engine.socket, engine.pid, flush=True); time.sleep(600)"
)


def _engine(run_id: str | None = None) -> DockerEngine:
    if os.environ.get("CORRAL_TEST_DOCKER_HOST"):
        require(False, "a private engine (CORRAL_TEST_DOCKER_HOST names a shared one)")
    try:
        return ensure_engine(install=IN_CI, run_id=run_id)
    except Exception as exc:
        require(False, f"a Docker Engine ({exc})")
        raise


def test_each_run_has_its_own_engine_and_a_killed_runs_engine_is_stopped() -> None:
    ours = _engine()
    other = subprocess.Popen(
        [sys.executable, "-c", RUN], cwd=REPO, stdout=subprocess.PIPE, start_new_session=True
    )
    try:
        assert other.stdout is not None
        socket, pid = other.stdout.readline().split()
        killed_engine = int(pid)
        assert Path(os.fsdecode(socket)) != ours.socket
        os.killpg(other.pid, signal.SIGKILL)  # the other run dies; its engine keeps running
        other.wait()
        assert _is_alive(killed_engine)

        removed = stop_abandoned_engines()
        assert Path(os.fsdecode(socket)).parent in removed
        assert not _is_alive(killed_engine)
        assert ours.socket.exists(), "an engine in use was stopped"
    finally:
        if other.poll() is None:
            os.killpg(other.pid, signal.SIGKILL)
            other.wait()
        assert other.stdout is not None
        other.stdout.close()
        ours.stop()
    assert not ours.socket.parent.exists()


def test_the_workers_of_one_run_share_its_engine_and_the_last_to_stop_it_removes_it() -> None:
    run = f"t{uuid.uuid4().hex[:12]}"
    first = _engine(run)
    second = _engine(run)
    try:
        assert first.started_here and not second.started_here
        assert second.socket == first.socket and second.pid == first.pid
        assert first.socket.parent.name.endswith(run)
        first.stop()  # the worker that started it is done: the other still uses it
        assert first.pid is not None and _is_alive(first.pid)
        assert first.socket.exists()
    finally:
        first.stop()
        second.stop()
    assert first.pid is not None and not _is_alive(first.pid)
    assert not first.socket.parent.exists()


def _waits_for_lock(path: Path) -> bool:
    """Whether a flock on ``path`` has a waiter (/proc/locks marks one with ``->``)."""
    inode = f":{path.stat().st_ino} "
    return any(
        "->" in line and inode in line for line in Path("/proc/locks").read_text().splitlines()
    )


def test_a_lock_waited_for_while_the_last_user_removes_its_directory_is_taken_anew(
    tmp_path: Path,
) -> None:
    lock = tmp_path / "run" / "start.lock"
    held: list[bool] = []

    def take() -> None:
        with _exclusive(lock):
            probe = os.open(lock, os.O_RDWR)
            try:  # a second open file of the path: refused while ours is the lock on it
                fcntl.flock(probe, fcntl.LOCK_EX | fcntl.LOCK_NB)
                held.append(False)
            except BlockingIOError:
                held.append(True)
            finally:
                os.close(probe)

    waiter = threading.Thread(target=take)
    with _exclusive(lock):
        waiter.start()
        deadline = time.monotonic() + 10
        while not _waits_for_lock(lock):
            assert time.monotonic() < deadline, "the second taker never waited for the lock"
            time.sleep(0.01)
        shutil.rmtree(lock.parent)  # as the last user of an engine does, holding the lock
    waiter.join(10)
    assert held == [True], "the waiter took the lock of the file the path now names"
