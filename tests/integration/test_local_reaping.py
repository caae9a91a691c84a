"""The local provider leaves no process behind (issue 13): the worker's spawner collects the
supervisors it started without being asked about their sandboxes (another process usually
ends those), and a supervisor collects, and kills, whatever its sandbox left. The same holds
on the failure paths: a command killed by a signal, a supervisor SIGKILLed, a sandbox past
its deadline, and a worker SIGKILLed mid-provision (its sandbox outlives it, and the next
worker ends it)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from corral.providers.base import SandboxState
from corral.providers.local import supervisor
from corral.providers.local.limits import detect
from corral.providers.local.processes import await_exit, start_ticks
from corral.providers.local.provider import LocalProvider
from tests.conftest import SpecFactory, require, require_bwrap_path
from tests.processes import (
    ProcessWatch,
    all_procs,
    cmdline,
    cwd,
    read_proc,
    supervisor_of,
    zombies_below,
)


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
            supervisors.append(supervisor_of(sandbox_root, handle.external_id))
        # Nobody asks this provider about them, as when the maintenance worker ends them.
        wait_for("every supervisor to be reaped", lambda: all(gone(*s) for s in supervisors))
    assert len(watch.seen) >= 5, "the sandboxes ran in bubblewrap"
    assert watch.orphaned == {}, "no bubblewrap was handed to init"
    spawner = provider._spawner._process
    assert spawner is not None and zombies_below(spawner.pid) == []


def test_nothing_the_entrypoint_left_outlives_it_not_even_a_process_that_left_its_group(
    sandbox_root: Path, make_spec: SpecFactory
) -> None:
    provider = LocalProvider({"root_dir": sandbox_root, "isolation": "required"})
    escape = (
        "import subprocess\n"
        "child = subprocess.Popen(['sleep', '301'], start_new_session=True)\n"
        "import time; time.sleep(1)\n"
    )
    handle = provider.provision(make_spec(provider_options={"command": ["python3", "-c", escape]}))
    work = sandbox_root / handle.external_id / "work"
    # Its pid inside the sandbox's namespace says nothing here: found by its command line
    # and its working directory, the sandbox's.
    wait_for("the escapee to start", lambda: escapee_of(work) is not None)
    escapee = escapee_of(work)
    assert escapee is not None
    start = start_ticks(escapee)
    try:
        wait_for("the sandbox to end", lambda: provider.status(handle).state.is_final)
        assert gone(escapee, start), "the process that left the group was killed and reaped"
    finally:
        if not gone(escapee, start):
            os.kill(escapee, signal.SIGKILL)  # only on failure: the process this test made
        provider.terminate(handle)


def escapee_of(work: Path) -> int | None:
    """The host pid of the sandbox's ``sleep 301``, once it runs."""
    for proc in all_procs():
        if (
            proc.state != "Z"
            and cmdline(proc.pid).strip() == "sleep 301"
            and cwd(proc.pid) == str(work)
        ):
            return proc.pid
    return None


def processes_of(root: Path) -> list[int]:
    """Live processes of the sandboxes under ``root``: supervisors work there, and
    bubblewrap's command line names it."""
    return [
        proc.pid
        for proc in all_procs()
        if proc.state != "Z"
        and (str(root) in cmdline(proc.pid) or cwd(proc.pid).startswith(str(root)))
    ]


def test_an_isolated_supervisor_killed_alone_hands_no_bubblewrap_to_init(
    sandbox_root: Path, make_spec: SpecFactory, require_bwrap: str
) -> None:
    provider = LocalProvider({"root_dir": sandbox_root, "isolation": "required"})
    command = ["sleep", "300"]
    spec = make_spec(egress={"allow_network": False}, provider_options={"command": command})
    with ProcessWatch(f"{sandbox_root}/", os.getpid()) as watch:
        handle = provider.provision(spec)
        wait_for("bubblewrap to be seen", lambda: len(watch.seen) >= 2)  # outer and pid 1
        os.kill(supervisor_of(sandbox_root, handle.external_id)[0], signal.SIGKILL)
        wait_for("the sandbox to end", lambda: provider.status(handle).state.is_final)
        wait_for("no bubblewrap left", lambda: watch.left_behind() == [])
    status = provider.status(handle)
    provider.terminate(handle)
    assert status.reason is not None and "killed from outside" in status.reason
    assert watch.orphaned == {}, "bubblewrap went to the spawner, a subreaper, not to init"
    spawner = provider._spawner._process
    assert spawner is not None and zombies_below(spawner.pid) == []


@pytest.mark.parametrize(
    ("isolation", "code", "reason"),
    [("required", 137, "exited with code 137")],
)
def test_a_command_killed_by_a_signal_fails_and_leaves_nothing(
    sandbox_root: Path, make_spec: SpecFactory, isolation: str, code: int, reason: str
) -> None:
    if isolation == "required":
        require_bwrap_path()
    provider = LocalProvider({"root_dir": sandbox_root, "isolation": isolation})
    command = ["sh", "-c", "sleep 300 & kill -KILL $$"]
    handle = provider.provision(make_spec(provider_options={"command": command}))
    supervisor = supervisor_of(sandbox_root, handle.external_id)
    wait_for("the sandbox to end", lambda: provider.status(handle).state.is_final)
    status = provider.status(handle)
    box = f"{sandbox_root / handle.external_id}/"
    left = [pid for pid in processes_of(sandbox_root) if box in cmdline(pid)]
    provider.terminate(handle)
    assert (status.state, status.exit_code, status.reason) == (SandboxState.FAILED, code, reason)
    assert gone(*supervisor) and left == [], "the sleep in the background was killed too"


def test_an_isolated_sandbox_past_its_deadline_is_killed_and_hands_nothing_to_init(
    sandbox_root: Path, make_spec: SpecFactory, require_bwrap: str
) -> None:
    provider = LocalProvider(
        {"root_dir": sandbox_root, "isolation": "required", "grace_period_s": 0.2}
    )
    spec = make_spec(resources={"timeout_s": 1}, provider_options={"command": ["sleep", "60"]})
    with ProcessWatch(f"{sandbox_root}/", os.getpid()) as watch:
        handle = provider.provision(spec)
        wait_for("the deadline", lambda: provider.status(handle).state.is_final, limit_s=15)
        left = watch.left_behind()
    status = provider.status(handle)
    provider.terminate(handle)
    assert status.reason is not None and "deadline of 1s exceeded" in status.reason
    assert (left, watch.orphaned) == ([], {})


# A worker of its own: warms its provider up (its spawner runs), then provisions SANDBOX_ID
# when told to; the test SIGKILLs it mid-provision.
WORKER = """
import sys, time
from corral.providers.base import SandboxSpec
from corral.providers.local.provider import LocalProvider

root, sandbox_id = sys.argv[1], sys.argv[2]
provider = LocalProvider({"root_dir": root, "isolation": "required"})

def spec(sid):
    return SandboxSpec.model_validate({
        "work_item_id": f"wi-{sid}", "sandbox_id": sid, "org_id": "acme", "project_id": "web",
        "registration_token": "crt_test", "control_url": "http://127.0.0.1:9",
        "provider_options": {"command": ["sleep", "300"]}})

provider.terminate(provider.provision(spec(f"warm-{sandbox_id}")))
print(provider._spawner._process.pid, flush=True)
sys.stdin.readline()
provider.provision(spec(sandbox_id))
time.sleep(300)
"""

STAGES = {
    # The record is written; the launch may not have reached the spawner yet.
    "recorded": lambda box: (box / "sandbox.json").exists(),
    # The supervisor is forked and on the record; bubblewrap is still building the sandbox.
    "supervised": lambda box: '"supervisor_pid": null' not in _text(box / "sandbox.json"),
    # The entrypoint runs; provision() is about to return.
    "started": lambda box: (box / "started.json").exists(),
}


def _text(path: Path) -> str:
    try:
        return path.read_text()
    except FileNotFoundError:
        return '"supervisor_pid": null'


@pytest.mark.parametrize("stage", list(STAGES))
def test_a_worker_killed_mid_provision_leaves_a_sandbox_its_successor_ends(
    sandbox_root: Path, tmp_path: Path, require_bwrap: str, stage: str
) -> None:
    sandbox_id = f"sb-killed-{stage}"
    # Not a pipe: the worker's spawner writes there too, and outlives the worker.
    errors = tmp_path / "worker.err"
    with errors.open("w") as stderr:
        worker = subprocess.Popen(
            [sys.executable, "-c", WORKER, str(sandbox_root), sandbox_id],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=stderr,
            text=True,
        )
    try:
        assert worker.stdout is not None and worker.stdin is not None
        ready = worker.stdout.readline()
        assert ready, f"the worker did not start: {errors.read_text()}"
        spawner = int(ready)
        spawner_start = start_ticks(spawner)
        worker.stdin.write("go\n")
        worker.stdin.flush()
        box = sandbox_root / sandbox_id
        wait_for(f"the provision to reach {stage}", lambda: STAGES[stage](box))
    finally:
        worker.kill()
        worker.communicate()
    successor = LocalProvider({"root_dir": sandbox_root, "isolation": "required"})
    time.sleep(0.5)  # whatever the dead worker's spawner was given, it has done by now
    [managed] = successor.list_managed()
    if stage != "recorded":
        assert successor.status(managed.handle).state is SandboxState.RUNNING, "it outlived"
    successor.terminate(managed.handle)
    assert processes_of(sandbox_root) == []
    wait_for("the dead worker's spawner to end", lambda: gone(spawner, spawner_start))
    assert successor.list_managed() == []


def test_a_spawner_killed_from_outside_leaves_its_sandboxes_running_and_is_replaced(
    sandbox_root: Path, make_spec: SpecFactory, require_bwrap: str
) -> None:
    provider = LocalProvider({"root_dir": sandbox_root, "isolation": "required"})
    command = ["sh", "-c", "sleep 1; echo done"]
    first = provider.provision(make_spec(provider_options={"command": command}))
    spawner = provider._spawner._process
    assert spawner is not None
    os.kill(spawner.pid, signal.SIGKILL)
    wait_for("the spawner to be collected", lambda: spawner.returncode is not None)
    second = provider.provision(make_spec(provider_options={"command": command}))
    assert provider._spawner._process is not spawner, "a new spawner took over"
    for handle in (first, second):
        wait_for("the sandbox to end", lambda h=handle: provider.status(h).state.is_final)
        assert provider.status(handle).state is SandboxState.TERMINATED
        assert "done" in list(provider.stream_logs(handle))
        provider.terminate(handle)
    assert processes_of(sandbox_root) == []


def test_a_supervisors_wait_for_a_process_ends_when_it_does_and_not_for_another(
    tmp_path: Path,
) -> None:
    """await_exit (terminate's and status's wait for a supervisor): woken by the exit, a
    zombie counts as ended, a pid whose start time is not the one asked about is not waited
    for, and one still running at the limit is reported so."""
    quick = subprocess.Popen(["sleep", "0.3"])
    slow = subprocess.Popen(["sleep", "30"])
    try:
        began = time.monotonic()
        assert await_exit(quick.pid, start_ticks(quick.pid), 10.0)
        waited = time.monotonic() - began
        os.waitid(os.P_PID, quick.pid, os.WEXITED | os.WNOWAIT)  # a zombie until collected
        zombie = read_proc(quick.pid)
        assert zombie is not None and zombie.state == "Z"
        assert await_exit(quick.pid, start_ticks(quick.pid), 10.0)
        ticks = start_ticks(slow.pid)
        assert ticks is not None
        assert await_exit(slow.pid, ticks + 1, 10.0), "another process under the pid"
        began = time.monotonic()
        assert not await_exit(slow.pid, ticks, 0.2)
        limited = time.monotonic() - began
    finally:
        slow.kill()
        slow.wait()
        quick.wait()
    assert 0.2 <= waited < 5, waited
    assert 0.2 <= limited < 5, limited


def test_what_a_sandbox_left_is_its_groups_members_and_the_supervisors_children() -> None:
    """The supervisor's list of what to kill at a sandbox's end, where the sandbox has a
    group: a process of the group in a session of its own whose parent lives on (neither
    the supervisor's child nor in its process group), and a child outside the group; not
    the supervisor, nor a child that has ended (a zombie)."""
    parent = detect("auto").pids_parent
    require(parent is not None, "a pids cgroup this process may write")
    assert parent is not None
    group = parent / f"corral-test-{os.getpid()}-{time.monotonic_ns()}"
    group.mkdir()
    joined = subprocess.Popen(
        [sys.executable, "-c", LEAVES_A_GRANDCHILD],
        stdout=subprocess.PIPE,
        text=True,
        preexec_fn=lambda: (group / "cgroup.procs").write_text(str(os.getpid())),  # noqa: PLW1509
    )
    outside = subprocess.Popen(["sleep", "30"])
    ended = subprocess.Popen(["true"])
    try:
        assert joined.stdout is not None
        grandchild = int(joined.stdout.readline())
        os.waitid(os.P_PID, ended.pid, os.WEXITED | os.WNOWAIT)
        left = supervisor._left_behind(os.getpid(), [str(group)])
        walked = supervisor._walk_proc(os.getpid())
    finally:
        for process in (joined, outside):
            process.kill()
            process.wait()
        assert joined.stdout is not None
        joined.stdout.close()
        ended.wait()
        with contextlib.suppress(ProcessLookupError):
            os.kill(grandchild, signal.SIGKILL)
        wait_for("the group to empty", lambda: not (group / "cgroup.procs").read_text().split())
        group.rmdir()
    assert {joined.pid, grandchild, outside.pid} <= set(left), (left, grandchild)
    assert os.getpid() not in left and ended.pid not in left
    assert grandchild not in walked, "the walk of /proc finds it only once its parent is gone"


LEAVES_A_GRANDCHILD = """
import subprocess, time
child = subprocess.Popen(["sleep", "30"], start_new_session=True)
print(child.pid, flush=True)
time.sleep(30)
"""
