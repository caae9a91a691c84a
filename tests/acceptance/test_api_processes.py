"""``corral api`` with ``CORRAL_API_PROCESSES=2``: two children share the listeners, each
serves on its own, their metrics are summed on the parent's one listener, a killed child is
replaced while the other answers, and the children end with the parent, however it ends."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from tests.acceptance.conftest import shell
from tests.acceptance.stack import Stack
from tests.processes import read_proc

ORG = "procs"


def _children(pid: int) -> list[int]:
    path = Path(f"/proc/{pid}/task/{pid}/children")
    return sorted(int(each) for each in path.read_text().split()) if path.exists() else []


@contextmanager
def _two_process_api(postgres_database_url: str, redis_url: str) -> Iterator[Stack]:
    stack = Stack(
        database_url=postgres_database_url,
        broker_url=redis_url,
        extra_env={"CORRAL_API_PROCESSES": "2"},
    )
    try:
        stack.start_only(["api"])
        stack.until(lambda: len(_children(stack.processes["api"].pid)) == 2, "two children")
        yield stack
    finally:
        stack.stop()


@pytest.fixture
def api(postgres_database_url: str, redis_url: str) -> Iterator[Stack]:
    with _two_process_api(postgres_database_url, redis_url) as stack:
        yield stack


@contextmanager
def _stopped(pid: int) -> Iterator[None]:
    """``pid`` stopped (SIGSTOP): it accepts no connection meanwhile."""
    os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(pid, signal.SIGCONT)


def _expired(org: str, number: int) -> dict[str, object]:
    """A message already past its expiry: a dispatch error item, counted where it was taken."""
    past = (datetime.now(UTC) - timedelta(minutes=1)).isoformat()
    return shell(org, f"echo {number}", expires_at=past, idempotency_key=f"procs-{number}")


def _counted(stack: Stack) -> float:
    return sum(
        value
        for sample, value in stack.scrape(stack.api_metrics_port).items()
        if sample.startswith("corral_dispatch_errors_total{") and 'code="expired"' in sample
    )


def test_each_child_serves_alone_and_the_parent_sums_their_metrics(api: Stack) -> None:
    api.make_org(ORG)
    first, second = _children(api.processes["api"].pid)
    number = 0
    for serving, stopped in ((first, second), (second, first)):
        with _stopped(stopped):
            # Every connection is taken by the one child still running.
            for _ in range(5):
                number += 1
                status, body = api.request("POST", "/v1/dispatch", _expired(ORG, number))
                assert status == 202, body
                assert body["state"] == "dispatch_error"
            assert read_proc(serving) is not None
    files = {path.name for path in Path(api.state_dir).glob("api-metrics-*/*.db")}
    assert any(str(first) in name for name in files), files
    assert any(str(second) in name for name in files), files
    assert _counted(api) == 10  # both children's counts, on the parent's listener


def test_a_killed_child_is_replaced_while_the_other_answers(api: Stack) -> None:
    parent = api.processes["api"].pid
    victim, survivor = _children(parent)
    os.kill(victim, signal.SIGKILL)
    answered = 0
    deadline = time.monotonic() + 60
    while victim in _children(parent) or len(_children(parent)) < 2:
        assert time.monotonic() < deadline, api.logs()
        status, _ = api.request("GET", "/healthz")
        assert status == 200
        answered += 1
    assert answered > 0
    replacement = next(pid for pid in _children(parent) if pid not in (victim, survivor))
    assert survivor in _children(parent)
    with _stopped(survivor):  # the new child serves alone
        api.wait_for_api()
    assert read_proc(replacement) is not None
    assert "ended by signal 9" in api.log_path("api").read_text()


def test_sigterm_stops_the_children_and_exits_0(api: Stack) -> None:
    process = api.processes["api"]
    children = _children(process.pid)
    socket_path = api.state_dir / "run" / "api.sock"
    assert socket_path.exists()
    process.send_signal(signal.SIGTERM)
    assert process.wait(timeout=60) == 0
    assert all(read_proc(pid) is None for pid in children)
    assert not socket_path.exists()
    assert not list(Path(api.state_dir).glob("api-metrics-*"))


def test_the_children_end_with_a_killed_parent_and_free_the_port(api: Stack) -> None:
    process = api.processes["api"]
    children = _children(process.pid)
    process.kill()
    process.wait()
    api.processes.pop("api")
    api.until(lambda: all(read_proc(pid) is None for pid in children), "the children ended")
    with socket.create_server(("127.0.0.1", api.port)):  # nobody holds the port any more
        pass


def test_children_that_cannot_start_stop_the_parent_non_zero(api: Stack) -> None:
    """The schema moves back under a running api: each replacement child refuses to start,
    and after five of them the parent gives up, non-zero, with one line saying why."""
    process = api.processes["api"]
    head = _psql(api.database_url, "SELECT version_num FROM alembic_version")
    _psql(api.database_url, "UPDATE alembic_version SET version_num = '0001'")
    try:
        for pid in _children(process.pid):
            os.kill(pid, signal.SIGKILL)
        assert process.wait(timeout=120) != 0
    finally:
        _psql(api.database_url, f"UPDATE alembic_version SET version_num = '{head}'")
    api.processes.pop("api")
    log = api.log_path("api").read_text()
    assert "the database schema is not current" in log
    assert "in a row ended before they could serve" in log
    assert "Traceback" not in log


def _psql(url: str, statement: str) -> str:
    done = subprocess.run(
        ["psql", url.replace("postgresql+psycopg://", "postgresql://"), "-Atqc", statement],
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()
