"""The Docker test harness gives each run an engine of its own, and the next run stops the
engine of a run that was killed before it could stop its own."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

from tests.conftest import IN_CI, require
from tests.docker_engine import DockerEngine, _is_alive, ensure_engine, stop_abandoned_engines

REPO = Path(__file__).resolve().parents[2]
# A test run of its own: it starts its engine, says where, and waits to be killed.
RUN = (
    "from tests.docker_engine import ensure_engine; import time; "
    "engine = ensure_engine(); print(engine.socket, engine.pid, flush=True); time.sleep(600)"
)


def _engine() -> DockerEngine:
    if os.environ.get("CORRAL_TEST_DOCKER_HOST"):
        require(False, "a private engine (CORRAL_TEST_DOCKER_HOST names a shared one)")
    try:
        return ensure_engine(install=IN_CI)
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
