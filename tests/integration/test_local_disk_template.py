"""A local sandbox's disk as it is made now: a copy of a template formatted once per size,
mounted through a loop device of its own by the kernel's calls, and started outside the host
lock. Real bubblewrap, loop devices and processes (a root worker); the steps a worker may be
killed in (SIGKILL) are killed in a process of its own."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from corral.providers.base import SandboxHandle, SandboxState
from corral.providers.errors import CapacityExhaustedError
from corral.providers.local import disk
from corral.providers.local.disk import TEMPLATES, find_disk_tools
from corral.providers.local.provider import LocalProvider
from tests.conftest import SpecFactory, require
from tests.integration.test_local_disk_bounds import host_usage

MIB = 1024 * 1024
DISK_MB = 64
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def root_worker(require_bwrap: str) -> None:
    require(os.geteuid() == 0 and find_disk_tools().usable, "a root worker with loop devices")


def _provider(sandbox_root: Path, **config: Any) -> LocalProvider:
    return LocalProvider(
        {"root_dir": sandbox_root, "isolation": "required", "disk_mb": DISK_MB, **config}
    )


def _sleeping(make_spec: SpecFactory) -> Any:
    return make_spec(
        egress={"allow_network": False}, provider_options={"command": ["sleep", "300"]}
    )


def _mount_options(path: Path) -> set[str]:
    """The options of the mount at ``path``, as this process's mount table says."""
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        fields = line.split()
        if fields[4] == str(path):
            return set(fields[5].split(","))
    raise AssertionError(f"nothing is mounted at {path}")


def _loops_backed_by(directory: Path) -> list[str]:
    """The loop devices whose backing file lies under ``directory`` (removed ones too)."""
    found = []
    for backing in Path("/sys/block").glob("loop*/loop/backing_file"):
        try:
            name = backing.read_text().strip()
        except OSError:  # detached meanwhile
            continue
        if name.startswith(f"{directory}/"):
            found.append(backing.parent.parent.name)
    return found


def _wait_for(what: str, condition: Callable[[], object], limit_s: float = 10) -> None:
    deadline = time.monotonic() + limit_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def _killed_child(script: str) -> None:
    """Run ``script`` in a Python process of its own; it must end killed by SIGKILL."""
    child = subprocess.run(
        [sys.executable, "-c", script],
        env={**os.environ, "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert child.returncode == -signal.SIGKILL, (child.returncode, child.stderr)


def test_each_sandbox_gets_a_sparse_copy_of_one_template_mounted_nosuid_nodev_and_released(
    root_worker: None, sandbox_root: Path, make_spec: SpecFactory
) -> None:
    provider = _provider(sandbox_root)
    handles = [provider.provision(_sleeping(make_spec)) for _ in range(3)]
    templates = sorted((sandbox_root / TEMPLATES).glob("*.img"))
    try:
        images = [(sandbox_root / h.external_id / "disk.img").stat() for h in handles]
        options = [_mount_options(sandbox_root / h.external_id / "disk") for h in handles]
        work = [_mount_options(sandbox_root / h.external_id / "work") for h in handles]
        loops = _loops_backed_by(sandbox_root)
        written = provider.exec_command(handles[0], ["sh", "-c", "echo mine > note; cat note"])
        others = [provider.exec_command(h, ["ls", "-A"]).stdout for h in handles[1:]]
    finally:
        for handle in handles:
            provider.terminate(handle)

    assert len(templates) == 1, templates  # one per size, made once
    assert all(image.st_size == DISK_MB * MIB for image in images)
    assert all(image.st_blocks * 512 < MIB for image in images), "copied sparse"
    assert all({"nosuid", "nodev"} <= found for found in options + work), (options, work)
    assert len(set(loops)) == 3, loops  # a loop device each
    assert written.stdout == "mine\n" and others == ["", ""], others  # each its own files
    assert not any((sandbox_root / h.external_id).exists() for h in handles)
    _wait_for("the loop devices to be freed", lambda: not _loops_backed_by(sandbox_root))
    # What stays on the host: the template alone, its few written blocks.
    assert host_usage(sandbox_root) < MIB, host_usage(sandbox_root)


def test_sandboxes_started_side_by_side_keep_the_hosts_limit(
    root_worker: None, sandbox_root: Path, make_spec: SpecFactory
) -> None:
    """Eight provisions at once on a host limit of three: each place is held from the
    moment its record is written, so exactly three start, whatever their disks' timing."""
    provider = _provider(sandbox_root, max_concurrent=3)

    def provision(_: int) -> SandboxHandle | CapacityExhaustedError:
        try:
            return provider.provision(_sleeping(make_spec))
        except CapacityExhaustedError as exc:
            return exc

    with ThreadPoolExecutor(max_workers=8) as pool:
        outcomes = list(pool.map(provision, range(8)))
    started = [one for one in outcomes if isinstance(one, SandboxHandle)]
    refused = [one for one in outcomes if isinstance(one, CapacityExhaustedError)]
    try:
        states = [provider.status(h).state for h in started]
        loops = _loops_backed_by(sandbox_root)
    finally:
        for handle in started:
            provider.terminate(handle)

    assert len(started) == 3 and len(refused) == 5, (started, refused)
    assert states == [SandboxState.RUNNING] * 3
    assert len(set(loops)) == 3, loops


def test_a_worker_killed_while_making_the_template_leaves_none_half_made(
    root_worker: None, sandbox_root: Path, make_spec: SpecFactory
) -> None:
    """Killed once mkfs.ext4 has formatted the file but before it is renamed a template:
    no template is there, and the next provision makes a whole one (the leftover goes)."""
    _killed_child(
        "import os, signal\n"
        "from pathlib import Path\n"
        "from corral.providers.local import disk\n"
        "real = disk._run\n"
        "def run_then_die(argv, doing):\n"
        "    real(argv, doing)\n"
        "    os.kill(os.getpid(), signal.SIGKILL)\n"
        "disk._run = run_then_die\n"
        f"root, size = Path({str(sandbox_root)!r}), {DISK_MB * MIB}\n"
        "disk.disk_template(disk.find_disk_tools(), root, size)\n"
    )
    leftovers = [p.name for p in (sandbox_root / TEMPLATES).iterdir() if p.name != ".lock"]

    provider = _provider(sandbox_root)
    handle = provider.provision(_sleeping(make_spec))
    try:
        wrote = provider.exec_command(handle, ["sh", "-c", "echo fine > f && cat f"]).stdout
    finally:
        provider.terminate(handle)
    after = sorted(p.name for p in (sandbox_root / TEMPLATES).iterdir() if p.name != ".lock")

    assert len(leftovers) == 1 and leftovers[0].endswith(".tmp"), leftovers
    assert wrote == "fine\n"
    assert after == [f"ext4-{DISK_MB * MIB}-{disk.FORMAT_ID}.img"], after


def test_a_worker_killed_with_the_disk_mounted_before_the_start_leaves_it_to_terminate(
    root_worker: None, sandbox_root: Path, make_spec: SpecFactory
) -> None:
    """Killed once the image is mounted and its work directory bound, before the sandbox's
    supervisor starts: its record holds its place (a limit of one refuses another), and
    terminate, from another process, unmounts it, frees its loop device and removes it."""
    spec = _sleeping(make_spec)
    _killed_child(
        "import os, signal\n"
        "from corral.providers.base import SandboxSpec\n"
        "from corral.providers.local.provider import LocalProvider\n"
        "from corral.providers.local.spawner import SupervisorSpawner\n"
        "SupervisorSpawner.spawn = lambda *args: os.kill(os.getpid(), signal.SIGKILL)\n"
        f"provider = LocalProvider({{'root_dir': {str(sandbox_root)!r}, "
        f"'isolation': 'required', 'disk_mb': {DISK_MB}}})\n"
        f"provider.provision(SandboxSpec.model_validate_json({spec.model_dump_json()!r}))\n"
    )
    box = sandbox_root / spec.sandbox_id
    mounted = [_mount_options(box / "disk"), _mount_options(box / "work")]
    provider = _provider(sandbox_root, max_concurrent=1)
    [managed] = provider.list_managed()
    with pytest.raises(CapacityExhaustedError):
        provider.provision(_sleeping(make_spec))

    provider.terminate(managed.handle)

    assert managed.sandbox_id == spec.sandbox_id
    assert all({"nosuid", "nodev"} <= found for found in mounted), mounted
    assert not box.exists()
    assert provider.status(managed.handle).state is SandboxState.TERMINATED
    _wait_for("the loop device to be freed", lambda: not _loops_backed_by(box))
    second = provider.provision(_sleeping(make_spec))  # its place is free again
    provider.terminate(second)
