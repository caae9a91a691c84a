"""Every line of ``make bench`` runs in its smoke mode (``--smoke``: tiny sizes, one round) to
the end and prints its figures; no speed is asked of it (docs/benchmarks.md).

The runs go a few at a time (one at a time beside pytest-xdist's other workers), in the
Makefile's order (the longest first), started when the module's first test begins; each test
waits for its own. The docker benchmark runs last, on the session's engine. A run past its
deadline is killed and fails its test, naming it."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import psycopg
import pytest
import redis
from sqlalchemy import make_url

from bench.dispatch import POSTGRES, REDIS
from bench.harness import SMOKE_NOTICE
from tests.benchmarks import REPO, bench_lines
from tests.conftest import DockerSandbox, require
from tests.docker_engine import ENGINE_HOST_VARIABLE

DOCKER = "bench.docker_overhead"
# What each benchmark needs beyond Python; a new one is added here with what it needs.
NEEDS: dict[str, tuple[str, ...]] = {
    "bench.dispatch": ("postgres", "redis", "bwrap"),
    "bench.warm": ("postgres", "redis", "bwrap"),
    "bench.fairness": ("postgres", "redis", "bwrap"),
    "bench.latency": ("postgres", "redis"),
    "bench.routing": ("postgres", "redis"),
    "bench.http_intake": ("postgres", "redis"),
    "bench.provisions": ("postgres", "redis"),
    "bench.console": ("postgres",),
    "bench.reaper": ("postgres",),
    "bench.statements": ("postgres",),
    "bench.local_start": ("bwrap",),
    DOCKER: ("docker",),
}
WHAT = {
    "postgres": f"PostgreSQL at {POSTGRES}",
    "redis": f"Redis at {REDIS}",
    "bwrap": "bubblewrap (apt-get install bubblewrap)",
}
# Runs at once: each starts processes of its own, on a machine of 2 cores. Under pytest-xdist
# the other workers' tests already take the machine, and this module's runs go one at a time.
PARALLEL = 1 if os.environ.get("PYTEST_XDIST_WORKER") else 3
RUN_TIMEOUT_S = 200.0  # one smoke run, from its start
LINES = bench_lines()
NOT_DOCKER = [line for line in LINES if line[1] != DOCKER]


def _key(line: list[str]) -> str:
    """A Makefile line's name: its module and arguments (``bench.routing --what scale``)."""
    return " ".join(line[1:])


def _available() -> dict[str, bool]:
    """Which of what the benchmarks need is here (the docker engine is the session's)."""
    try:
        plain = make_url(POSTGRES).set(drivername="postgresql")
        with psycopg.connect(plain.render_as_string(hide_password=False), connect_timeout=5):
            postgres = True
    except psycopg.Error:
        postgres = False
    client = redis.Redis.from_url(REDIS, socket_timeout=5)
    try:
        redis_up = bool(client.ping())
    except redis.RedisError:
        redis_up = False
    finally:
        client.close()
    return {"postgres": postgres, "redis": redis_up, "bwrap": shutil.which("bwrap") is not None}


@dataclass
class Run:
    """One smoke run: its process, while it runs, then how it ended."""

    line: list[str]
    out: Path
    err: Path
    process: subprocess.Popen[bytes] | None = None
    started: float = 0.0
    returncode: int | None = None
    timed_out: bool = False

    def output(self) -> str:
        return self.out.read_text(errors="replace") if self.out.exists() else ""

    def tail(self) -> str:
        error = self.err.read_text(errors="replace") if self.err.exists() else ""
        return f"--- stdout\n{self.output()[-3000:]}\n--- stderr\n{error[-3000:]}"


@dataclass
class SmokeRuns:
    """Smoke runs started in order, ``PARALLEL`` at a time, each killed at its deadline."""

    directory: Path
    env: dict[str, str]
    runs: dict[str, Run] = field(default_factory=dict)
    pending: list[str] = field(default_factory=list)

    def add(self, line: list[str]) -> None:
        key = _key(line)
        slug = key.replace(" ", "_").replace("-", "")
        out, err = self.directory / f"{slug}.out", self.directory / f"{slug}.err"
        self.runs[key] = Run(line, out, err)
        self.pending.append(key)

    def result(self, key: str) -> Run:
        """Run ``key`` once it has ended (the others go on meanwhile)."""
        run = self.runs[key]
        while run.returncode is None and not run.timed_out:
            self._advance()
            time.sleep(0.2)
        return run

    def _advance(self) -> None:
        running = [run for run in self.runs.values() if run.process and run.returncode is None]
        for run in running:
            run.returncode = run.process.poll() if run.process else None
            if run.returncode is None and time.monotonic() - run.started > RUN_TIMEOUT_S:
                self._kill(run)
                run.timed_out = True
        slots = PARALLEL - sum(run.returncode is None and not run.timed_out for run in running)
        while slots > 0 and self.pending:
            self._start(self.runs[self.pending.pop(0)])
            slots -= 1

    def _start(self, run: Run) -> None:
        with run.out.open("wb") as out, run.err.open("wb") as err:
            run.process = subprocess.Popen(
                [sys.executable, *run.line, "--smoke"],
                cwd=REPO,
                env=self.env,
                stdout=out,
                stderr=err,
                start_new_session=True,
            )
        run.started = time.monotonic()

    def stop(self) -> None:
        for run in self.runs.values():
            if run.process is not None and run.process.poll() is None:
                self._kill(run)

    @staticmethod
    def _kill(run: Run) -> None:
        assert run.process is not None
        with contextlib.suppress(ProcessLookupError):  # it ended meanwhile
            os.killpg(run.process.pid, signal.SIGKILL)
        run.process.wait()


def _env(**extra: str) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(REPO), **extra}


@pytest.fixture(scope="module")
def available() -> dict[str, bool]:
    return _available()


@pytest.fixture(scope="module")
def smoke_runs(
    available: dict[str, bool], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[SmokeRuns]:
    """The smoke runs of every line but docker's whose needs are here, under way."""
    runs = SmokeRuns(tmp_path_factory.mktemp("bench-smoke"), _env())
    for line in LINES:
        needs = NEEDS.get(line[1], ())
        if line[1] != DOCKER and all(available[need] for need in needs):
            runs.add(line)
    try:
        yield runs
    finally:
        runs.stop()


def _check(run: Run) -> None:
    """It ended by itself, well, having printed the smoke notice first and figures after."""
    name = _key(run.line)
    assert not run.timed_out, f"{name} ran past {RUN_TIMEOUT_S:g} s and was killed\n{run.tail()}"
    assert run.returncode == 0, f"{name} exited with {run.returncode}\n{run.tail()}"
    lines = [line for line in run.output().splitlines() if line.strip()]
    said = bool(lines) and lines[0] == SMOKE_NOTICE
    assert said, f"{name} did not say first that it was a smoke run\n{run.tail()}"
    figures = [line for line in lines[1:] if any(character.isdigit() for character in line)]
    assert figures, f"{name} printed no figure\n{run.tail()}"


@pytest.mark.parametrize("line", NOT_DOCKER, ids=[_key(line) for line in NOT_DOCKER])
def test_the_benchmark_runs_to_the_end_in_its_smoke_mode(
    line: list[str], smoke_runs: SmokeRuns, available: dict[str, bool]
) -> None:
    assert line[1] in NEEDS, f"say what {line[1]} needs in NEEDS"
    for need in NEEDS[line[1]]:
        require(available[need], WHAT[need])
    _check(smoke_runs.result(_key(line)))


def test_the_docker_benchmark_runs_to_the_end_in_its_smoke_mode(
    docker_sandbox: DockerSandbox, tmp_path: Path
) -> None:
    [line] = [line for line in LINES if line[1] == DOCKER]
    runs = SmokeRuns(tmp_path, _env(**{ENGINE_HOST_VARIABLE: docker_sandbox.url}))
    runs.add(line)
    try:
        _check(runs.result(_key(line)))
    finally:
        runs.stop()


_FAKE_BENCHMARK = """
import sys, time
print({notice!r}, flush=True)
kind = sys.argv[1]
if kind == "hang":
    time.sleep(600)
elif kind == "crash":
    raise SystemExit(3)
elif kind == "silent":
    print("done, and nothing measured")
else:
    print("1 item in 0.1 s")
"""


def test_the_smoke_runner_fails_a_benchmark_that_hangs_crashes_or_prints_no_figure(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(sys.modules[__name__], "RUN_TIMEOUT_S", 3.0)
    script = tmp_path / "fake_benchmark.py"
    script.write_text(_FAKE_BENCHMARK.format(notice=SMOKE_NOTICE))
    runs = SmokeRuns(tmp_path, _env())
    expected = {
        "hang": "ran past 3 s and was killed",
        "crash": "exited with 3",
        "silent": "printed no figure",
    }
    for kind in [*expected, "fine"]:
        runs.add([str(script), kind])
    try:
        for kind, message in expected.items():
            with pytest.raises(AssertionError, match=message):
                _check(runs.result(kind))
        _check(runs.result("fine"))  # the runner itself passes a benchmark that works
    finally:
        runs.stop()
