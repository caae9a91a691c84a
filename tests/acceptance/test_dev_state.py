"""`corral dev` owns its state directory: a second one on it is refused and leaves the first
whole, and stopping it (Ctrl-C, SIGTERM) ends the sandboxes it started, their supervisors and
its spawner too."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest
from sqlalchemy import select

from corral.shared.store.db import make_engine
from corral.shared.store.models import WorkItem
from tests.acceptance.dev_process import DevProcess, in_state_dir, running_dev, until
from tests.processes import Proc, cmdline, descendants, read_proc


def test_a_second_dev_on_the_same_state_directory_is_refused_and_the_first_is_unharmed() -> None:
    with running_dev() as first:
        files = {name: (first.state_dir / name).read_bytes() for name in ("admin-token", "api-url")}
        socket = first.state_dir / "run" / "api.sock"
        socket_inode = socket.stat().st_ino
        second = first.corral("dev", timeout=60)
        assert second.returncode != 0
        said = second.stderr.strip().splitlines()
        assert len(said) == 1, second.stderr  # one line, no traceback
        assert f"pid {first.pid}" in said[0] and first.api_url in said[0]
        assert str(first.state_dir) in said[0]
        # Nothing of the first's was touched: its token still opens its api.
        for name, content in files.items():
            assert (first.state_dir / name).read_bytes() == content
        assert socket.stat().st_ino == socket_inode
        status, body = first.request("GET", "/v1/admin/pools?org=acme")
        assert status == 200, body
        assert first.process is not None and first.process.poll() is None


def test_the_lock_goes_with_the_process_so_the_next_dev_starts() -> None:
    with running_dev() as first:
        assert first.stop(signal.SIGTERM) == 0
        following = DevProcess(first.state_dir)
        try:
            assert following.start().answers()
        finally:
            following.kill()


def alive(procs: list[Proc]) -> list[Proc]:
    """Those of ``procs`` still running (the same pid and start time)."""
    found = []
    for proc in procs:
        now = read_proc(proc.pid)
        if now is not None and now.start == proc.start and now.state != "Z":
            found.append(now)
    return found


@pytest.mark.parametrize("number", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c", "sigterm"])
def test_stopping_dev_ends_the_sandboxes_it_started(number: signal.Signals) -> None:
    with running_dev() as dev:
        dev.setup_pool()
        message = {
            "org": "acme",
            "project": "web",
            "profile": "default",
            "work": {"kind": "shell", "command": "sleep 300"},
            "egress": {"allow_network": True},  # runs without bubblewrap's network too
        }
        status, body = dev.request("POST", "/v1/dispatch", message)
        assert status == 202, body
        item_id = body["id"]

        def running() -> bool:
            return bool(dev.request("GET", f"/v1/work-items/{item_id}")[1]["state"] == "running")

        until(running, f"{item_id} did not start running:\n{dev.log()}", timeout_s=60)
        # The spawner, the supervisor, bubblewrap, the runner and the work: every process
        # under dev, and those at work in its sandbox root.
        started = descendants(dev.pid)
        in_sandboxes = in_state_dir(dev.state_dir / "local-sandboxes")
        assert in_sandboxes, "no process runs in the sandbox root"
        assert any("supervisor.py" in cmdline(p.pid) for p in started), started

        assert dev.stop(number) == 0, dev.log()
        until(
            lambda: not alive([*started, *in_sandboxes]),
            f"processes left after corral dev stopped: {alive([*started, *in_sandboxes])}",
            timeout_s=30,
        )
        assert not in_state_dir(dev.state_dir)
        assert "corral dev: ending 1 sandbox(es)" in dev.log()
        assert _item(dev.state_dir, item_id) == ("failed", "sandbox_lost", "corral dev stopped")


def _item(state_dir: Path, item_id: str) -> tuple[str, str | None, str | None]:
    engine = make_engine(f"sqlite:///{state_dir / 'corral.db'}")
    try:
        with engine.connect() as connection:
            row = connection.execute(
                select(WorkItem.state, WorkItem.error_code, WorkItem.error_message).where(
                    WorkItem.id == item_id
                )
            ).one()
    finally:
        engine.dispose()
    message = row.error_message or ""
    return row.state, row.error_code, message.split(";")[0] if message else None
