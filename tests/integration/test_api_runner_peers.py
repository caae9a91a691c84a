"""The runner rate limits on the api's Unix socket, kept per sandbox: callers in pid
namespaces of their own (bubblewrap, as the local provider starts a sandbox) call
``/v1/runner/register`` on the api served by uvicorn as ``corral api`` serves it, over real
PostgreSQL. One sandbox's flood, however it dresses it up, costs another sandbox nothing."""

from __future__ import annotations

import os
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest
from pydantic import SecretStr

from corral.scheduler.api.server import bind_unix, make_server
from corral.shared import runtime
from corral.shared.broker import celery_app
from corral.shared.settings import CoreSettings
from corral.shared.store.db import Database
from tests.conftest import require
from tests.integration.test_api import ADMIN
from tests.unix_callers import (
    answers,
    caller_argv,
    entered,
    nested,
    orphaned,
    sandboxed,
    script,
)

REFUSED = "429"
ANSWERED = "401"  # a made-up registration token: answered, not rate limited


@pytest.fixture
def api_socket(
    pg_db: Database, postgres_database_url: str, monkeypatch: pytest.MonkeyPatch
) -> Iterator[Path]:
    """The api on a Unix socket; registrations: 2 at once, then one per 100 s per caller."""
    # Forwarded-for headers believed from anyone: a sandbox's made-up one must not count.
    monkeypatch.setenv("FORWARDED_ALLOW_IPS", "*")
    settings = CoreSettings(
        database_url=postgres_database_url,
        admin_token=SecretStr(ADMIN),
        broker_url="memory://",
        register_rate_per_s=0.01,
        register_burst=2,
    )
    celery_app.configure(settings)
    runtime.install(runtime.Runtime(settings=settings, db=pg_db))
    with tempfile.TemporaryDirectory(prefix="corral-peers-") as directory:
        path = Path(directory) / "api.sock"
        listener = bind_unix(path)
        server = make_server(log_level="warning")
        thread = threading.Thread(target=server.run, kwargs={"sockets": [listener]})
        thread.start()
        try:
            deadline = time.monotonic() + 30
            while not server.started:
                assert thread.is_alive() and time.monotonic() < deadline
                time.sleep(0.01)
            yield path
        finally:
            server.should_exit = True
            thread.join(timeout=30)
            listener.close()
            runtime.reset()


def run(command: Sequence[str]) -> dict[str, list[str]]:
    """What each caller of ``command`` was answered."""
    done = subprocess.run(command, capture_output=True, text=True, timeout=60, check=True)
    return answers(done.stdout)


def test_a_sandbox_flooding_register_on_the_unix_socket_costs_another_sandbox_nothing(
    api_socket: Path, require_bwrap: str
) -> None:
    flood = run(sandboxed(require_bwrap, caller_argv(api_socket, "flood", 6)))
    assert flood["flood"] == [ANSWERED] * 2 + [REFUSED] * 4
    other = run(sandboxed(require_bwrap, caller_argv(api_socket, "other", 2)))
    assert other["other"] == [ANSWERED] * 2


def test_a_sandbox_gets_no_fresh_bucket_from_setsid_orphans_nested_namespaces_or_headers(
    api_socket: Path, require_bwrap: str
) -> None:
    tries = script(
        caller_argv(api_socket, "plain", 2),
        caller_argv(api_socket, "setsid", 1, "setsid"),
        orphaned(caller_argv(api_socket, "orphan", 1, "orphan")),
        caller_argv(api_socket, "chain", 1, "chain:20"),
        nested(caller_argv(api_socket, "nested", 1)),
        caller_argv(api_socket, "forwarded", 3, "xff"),
    )
    assert run(sandboxed(require_bwrap, tries)) == {
        "plain": [ANSWERED] * 2,
        "setsid": [REFUSED],
        "orphan": [REFUSED],
        "chain": [REFUSED],
        "nested": [REFUSED],
        "forwarded": [REFUSED] * 3,
    }
    other = run(sandboxed(require_bwrap, caller_argv(api_socket, "other", 1)))
    assert other["other"] == [ANSWERED]


def test_a_command_run_in_a_sandbox_from_the_host_counts_as_the_sandbox(
    api_socket: Path, require_bwrap: str
) -> None:
    # nsenter --pid, as the local provider runs a session's command, needs root.
    require(os.geteuid() == 0, "root (to enter a pid namespace)")
    flood = caller_argv(api_socket, "flood", 3)
    with subprocess.Popen(
        sandboxed(require_bwrap, script(flood, ["sleep", "120"])),
        stdout=subprocess.PIPE,
        text=True,
    ) as sandbox:
        try:
            assert sandbox.stdout is not None
            assert answers(sandbox.stdout.readline()) == {"flood": [ANSWERED] * 2 + [REFUSED]}
            first = _namespace_init(sandbox.pid)
            for index in range(3):  # each a process of its own, each with a host parent
                label = f"exec{index}"
                command = entered(first, caller_argv(api_socket, label, 1))
                assert run(command) == {label: [REFUSED]}
        finally:
            sandbox.kill()
    other = run(sandboxed(require_bwrap, caller_argv(api_socket, "other", 1)))
    assert other["other"] == [ANSWERED]


def _namespace_init(bwrap_pid: int) -> int:
    """The first process of the pid namespace bubblewrap ``bwrap_pid`` made: its child."""
    children = Path(f"/proc/{bwrap_pid}/task/{bwrap_pid}/children")
    deadline = time.monotonic() + 10
    while not (found := children.read_text().split()):
        assert time.monotonic() < deadline
        time.sleep(0.01)
    return int(found[0])
