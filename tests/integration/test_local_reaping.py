"""The local provider leaves no process behind (issue 13): the worker collects the
supervisors it started without being asked about their sandboxes (another process usually
ends those), and a supervisor collects, and kills, whatever its sandbox left."""

from __future__ import annotations

import os
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path

from providers.local import LocalProvider
from providers.local_processes import start_ticks
from tests.conftest import SpecFactory
from tests.processes import ProcessWatch, read_proc


def gone(pid: int, start: int | None) -> bool:
    """Whether the process that started at ``start`` is gone, reaped (a zombie is still
    there); a newcomer under its pid does not count."""
    now = read_proc(pid)
    return now is None or now.start != start


def wait_for(what: str, condition: Callable[[], object], limit_s: float = 10) -> None:
    deadline = time.monotonic() + limit_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def test_supervisors_are_collected_without_status_or_terminate_and_no_bubblewrap_is_orphaned(
    sandbox_root: Path, make_spec: SpecFactory, require_bwrap: str
) -> None:
    provider = LocalProvider({"root_dir": sandbox_root, "isolation": "required"})
    spec = {"egress": {"allow_network": False}, "provider_options": {"command": ["sleep", "0.3"]}}
    with ProcessWatch(f"{sandbox_root}/", os.getpid()) as watch:
        supervisors = []
        for _ in range(5):
            handle = provider.provision(make_spec(**spec))
            pid = provider._children[handle.external_id].pid
            supervisors.append((pid, start_ticks(pid)))
        # Nobody asks this provider about them, as when the maintenance worker ends them.
        wait_for("every supervisor to be reaped", lambda: all(gone(*s) for s in supervisors))
    assert len(watch.seen) >= 5, "the sandboxes ran in bubblewrap"
    assert watch.orphaned == {}, "no bubblewrap was handed to init"
    assert provider._children == {}


def test_nothing_the_entrypoint_left_outlives_it_not_even_a_process_that_left_its_group(
    sandbox_root: Path, make_spec: SpecFactory
) -> None:
    provider = LocalProvider({"root_dir": sandbox_root, "isolation": "off"})
    escape = (
        "import subprocess\n"
        "child = subprocess.Popen(['sleep', '300'], start_new_session=True)\n"
        "open('escapee.pid', 'w').write(str(child.pid))\n"
    )
    handle = provider.provision(
        make_spec(provider_options={"command": [sys.executable, "-c", escape]})
    )
    pid_file = sandbox_root / handle.external_id / "work" / "escapee.pid"
    wait_for("the escapee to start", lambda: pid_file.exists() and pid_file.read_text())
    escapee = int(pid_file.read_text())
    start = start_ticks(escapee)
    try:
        wait_for("the sandbox to end", lambda: provider.status(handle).state.is_final)
        assert gone(escapee, start), "the process that left the group was killed and reaped"
    finally:
        if not gone(escapee, start):
            os.kill(escapee, signal.SIGKILL)  # only on failure: the process this test made
        provider.terminate(handle)
