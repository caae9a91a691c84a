"""What one local sandbox's processes may take of the host, and what they share with other
sandboxes. A session exec counts against its sandbox's limits (it joins the sandbox's
cgroups, or takes its RLIMIT_AS); a fork bomb stops at the sandbox's pids limit while
another sandbox starts and runs; each live sandbox runs as a uid of its own, so a per-uid
kernel quota one sandbox uses up is not another's; the egress proxy is bounded in memory
whenever the sandbox's cgroup does not limit memory. Real bubblewrap, real processes."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import platform
import signal
import subprocess
from pathlib import Path
from typing import Any

import pytest

from corral.providers.base import SandboxHandle
from corral.providers.errors import CapacityExhaustedError
from corral.providers.local.limits import detect
from corral.providers.local.provider import PROXY_MEMORY_BYTES, LocalProvider, _remove_groups
from tests.conftest import SpecFactory, require
from tests.egress_probe import proxies_under
from tests.integration.test_local_provider import wait_until_final
from tests.integration.test_local_reaping import wait_for
from tests.processes import supervisor_of

MIB = 1024 * 1024
# Pages written, not only reserved: a cgroup counts what a process touches.
GREEDY = (
    "print('started', flush=True); block = b'x' * (200 * 1024 * 1024); "
    "print('allocated', flush=True)"
)
SLEEPER = ["sleep", "300"]


def _sandbox(provider: LocalProvider, make_spec: SpecFactory, **fields: Any) -> SandboxHandle:
    """Provision a sandbox with no network that sleeps (``fields`` override the spec's)."""
    defaults: dict[str, Any] = {
        "egress": {"allow_network": False},
        "provider_options": {"command": SLEEPER},
    }
    return provider.provision(make_spec(**(defaults | fields)))


def _groups_of(listing: str) -> dict[str, str]:
    """A process's cgroup path per controller, from its /proc/PID/cgroup ("" for v2)."""
    groups = {}
    for line in listing.splitlines():
        _, controllers, path = line.split(":", 2)
        for controller in controllers.split(",") if controllers else [""]:
            groups[controller] = path
    return groups


def test_a_session_exec_sits_in_its_sandboxs_cgroups_and_within_its_memory(
    require_bwrap: str, sandbox_root: Path, make_spec: SpecFactory
) -> None:
    """The exec of a 64 MiB sandbox cannot write 200 MiB: it is in the sandbox's groups
    (memory, CPU and pids), not the api's, and the kernel kills it at the sandbox's limit."""
    mechanism = detect("auto")
    require(mechanism.kind == "cgroup", "a writable cgroup (v2 memory, or v1)")
    provider = LocalProvider(
        {"root_dir": sandbox_root, "isolation": "required", "resource_limits": "cgroup"}
    )
    handle = _sandbox(provider, make_spec, resources={"memory_mb": 64, "cpu": 0.5})
    sandbox_id = handle.external_id
    try:
        listing = provider.exec_command(handle, ["cat", "/proc/self/cgroup"], timeout_s=60)
        greedy = provider.exec_command(handle, ["python3", "-c", GREEDY], timeout_s=60)
    finally:
        provider.terminate(handle)

    assert listing.exit_code == 0, listing
    groups = _groups_of(listing.stdout)
    controllers = [""] if mechanism.version == 2 else ["memory"]
    if mechanism.version == 1 and mechanism.cpu_parent is not None:
        controllers.append("cpu")
    if mechanism.pids_parent is not None and mechanism.version == 1:
        controllers.append("pids")
    for controller in controllers:
        assert groups[controller].endswith(f"/corral-{sandbox_id}"), (controller, groups)
    assert "started" in greedy.stdout, greedy  # it ran, inside the sandbox
    assert "allocated" not in greedy.stdout, greedy
    assert greedy.exit_code != 0, greedy


def test_a_session_exec_takes_its_sandboxs_rlimit(
    require_bwrap: str, sandbox_root: Path, make_spec: SpecFactory
) -> None:
    """Without a cgroup the sandbox's memory limit is RLIMIT_AS; its execs are under it too."""
    provider = LocalProvider(
        {"root_dir": sandbox_root, "isolation": "required", "resource_limits": "rlimit"}
    )
    handle = _sandbox(provider, make_spec, resources={"memory_mb": 64})
    try:
        greedy = provider.exec_command(handle, ["python3", "-c", GREEDY], timeout_s=60)
        limits = provider.exec_command(handle, ["cat", "/proc/self/limits"], timeout_s=60)
    finally:
        provider.terminate(handle)

    assert "started" in greedy.stdout, greedy
    assert "allocated" not in greedy.stdout, greedy
    assert "MemoryError" in greedy.stderr, greedy
    [address_space] = [line for line in limits.stdout.splitlines() if "address space" in line]
    assert address_space.split()[3:5] == [str(64 * MIB)] * 2, address_space  # soft and hard


# Inside the sandbox: fork up to argv[1] sleeping children, say how many it made, and hold them.
FORK_BOMB = r"""
import os, sys, time
made = 0
for _ in range(int(sys.argv[1])):
    try:
        child = os.fork()
    except OSError:
        break
    if child == 0:
        time.sleep(300)
        os._exit(0)
    made += 1
open("bombed", "w").write(str(made))
time.sleep(300)
"""


def test_a_fork_bomb_stops_at_its_sandboxs_pids_limit_and_another_sandbox_runs(
    require_bwrap: str, sandbox_root: Path, make_spec: SpecFactory
) -> None:
    mechanism = detect("auto")
    require(mechanism.pids_parent is not None, "a writable cgroup pids controller")
    provider = LocalProvider({"root_dir": sandbox_root, "isolation": "required", "max_pids": 64})
    bomb = make_spec(
        egress={"allow_network": False},
        provider_options={"command": ["python3", "-c", FORK_BOMB, "400"]},
    )
    bomber = provider.provision(bomb)
    other = None
    try:
        bombed = sandbox_root / bomb.sandbox_id / "work" / "bombed"
        # Made, then written: read once it holds the count (an empty read raced the write).
        written = lambda: bombed.exists() and bombed.read_text()  # noqa: E731
        wait_for("the fork bomb to stop", written, limit_s=60)
        made = int(bombed.read_text())
        group = provider.limits.launch(bomb.sandbox_id, None, None, max_pids=64)
        assert group is not None and group["pids_dir"] is not None
        current = int((Path(group["pids_dir"]) / "pids.current").read_text())
        # Meanwhile another sandbox starts, and forks as it likes.
        other = _sandbox(provider, make_spec)
        forked = provider.exec_command(other, "sleep 0 & sleep 0 & wait; echo forked")
        # An exec of the bomber's is the sandbox's too: no process is left for it.
        refused = provider.exec_command(bomber, ["true"], timeout_s=30)
    finally:
        provider.terminate(bomber)
        if other is not None:
            provider.terminate(other)

    assert made < 64, made
    assert current <= 64, current
    assert forked.stdout.strip() == "forked", forked
    assert refused.exit_code != 0, refused


def test_terminate_removes_the_groups_a_supervisor_killed_from_outside_left(
    require_bwrap: str, sandbox_root: Path, make_spec: SpecFactory
) -> None:
    """Every sandbox has groups now (its pids group at least): one whose supervisor was
    killed, and so never removed them, has them removed when it is terminated."""
    provider = LocalProvider({"root_dir": sandbox_root, "isolation": "required"})
    handle = _sandbox(provider, make_spec, resources={"memory_mb": 64, "cpu": 0.5})
    record = json.loads((sandbox_root / handle.external_id / "sandbox.json").read_text())
    groups = [Path(group) for group in record["cgroups"]]
    require(bool(groups), "a writable cgroup")
    os.killpg(supervisor_of(sandbox_root, handle.external_id)[0], signal.SIGKILL)
    wait_until_final(provider, handle)
    provider.terminate(handle)
    assert [group for group in groups if group.exists()] == []


def test_a_group_still_emptying_when_the_sandbox_is_terminated_is_removed_once_it_empties(
    tmp_path: Path,
) -> None:
    """A supervisor killed from outside leaves its sandbox dying, not dead (it dies with its
    parent, a moment later): terminate waits for each group to empty before removing it,
    where rmdir alone would find it in use and leave it for good."""
    root = next(p for p in (Path("/sys/fs/cgroup/pids"), Path("/sys/fs/cgroup")) if p.is_dir())
    group = root / f"corral-test-{os.getpid()}-{tmp_path.name}"
    try:
        group.mkdir()
    except OSError:
        require(False, "a writable cgroup")  # fails in CI, as the tests beside it do
    dying = subprocess.Popen(["sleep", "0.5"])
    try:
        (group / "cgroup.procs").write_text(str(dying.pid))
        gone = subprocess.Popen(["true"])
        gone.wait()  # the supervisor: ended
        _remove_groups({"supervisor_pid": gone.pid, "supervisor_start": 0, "cgroups": [str(group)]})
        assert not group.exists()
    finally:
        dying.kill()
        dying.wait()
        with contextlib.suppress(OSError):
            group.rmdir()


# Inside the sandbox: take inotify instances until the kernel refuses one, and hold them.
INOTIFY_HOG = r"""
import ctypes, time
libc = ctypes.CDLL(None, use_errno=True)
held = 0
while held < 4096 and libc.inotify_init1(0) >= 0:
    held += 1
open("holding", "w").write(f"{held} {ctypes.get_errno()}")
time.sleep(300)
"""
INOTIFY_ONE = (
    "import ctypes, os; libc = ctypes.CDLL(None, use_errno=True); "
    "print('ok' if libc.inotify_init1(0) >= 0 else os.strerror(ctypes.get_errno()))"
)
# Far from the default sandbox user, so that other runs on this host share no quota with it.
UID_BASE = 23001


@pytest.fixture
def root_worker() -> None:
    """The root worker's case: a uid per sandbox exists only there (fails in CI elsewhere)."""
    require(os.geteuid() == 0, "root, for the root worker's case")


@pytest.mark.usefixtures("root_worker")
def test_each_live_sandbox_runs_as_its_own_uid_and_keeps_its_own_quotas(
    require_bwrap: str, sandbox_root: Path, make_spec: SpecFactory, tmp_path: Path
) -> None:
    """Sandbox A holds every inotify instance its uid may have; B's inotify_init still works,
    and what is uploaded to B is B's user's."""
    provider = LocalProvider(
        {
            "root_dir": sandbox_root,
            "isolation": "required",
            "sandbox_uid": UID_BASE,
            "sandbox_gid": UID_BASE,
        }
    )
    hog = make_spec(
        egress={"allow_network": False},
        provider_options={"command": ["python3", "-c", INOTIFY_HOG]},
    )
    first = provider.provision(hog)
    second = None
    source = tmp_path / "upload.txt"
    source.write_text("hello")
    try:
        holding = sandbox_root / hog.sandbox_id / "work" / "holding"
        wait_for("the first sandbox to hold its inotify instances", holding.exists, limit_s=60)
        held, error = (int(word) for word in holding.read_text().split())
        second = _sandbox(provider, make_spec)
        inotify = provider.exec_command(second, ["python3", "-c", INOTIFY_ONE], timeout_s=60)
        provider.upload_file(second, source, "upload.txt")
        ids = [provider.exec_command(h, "id -u; id -g").stdout.split() for h in (first, second)]
        owner = provider.exec_command(second, "stat -c '%u %g' upload.txt").stdout.split()
    finally:
        provider.terminate(first)
        if second is not None:
            provider.terminate(second)

    assert error == errno.EMFILE, (held, error)  # it took all its uid may have
    assert ids[0] != ids[1], ids
    assert ids[0] == [str(UID_BASE)] * 2, ids  # the lowest free one first
    assert owner == ids[1], (owner, ids)
    assert inotify.stdout.strip() == "ok", inotify


@pytest.mark.usefixtures("root_worker")
def test_a_sandbox_is_refused_once_every_uid_of_the_range_is_live(
    require_bwrap: str, sandbox_root: Path, make_spec: SpecFactory
) -> None:
    provider = LocalProvider(
        {
            "root_dir": sandbox_root,
            "isolation": "required",
            "sandbox_uid": UID_BASE,
            "sandbox_gid": UID_BASE,
            "sandbox_uid_count": 2,
        }
    )
    first = _sandbox(provider, make_spec)
    finished = provider.provision(make_spec(provider_options={"command": ["true"]}))
    wait_until_final(provider, finished)  # ended: its uid is free again, its files still there
    second = _sandbox(provider, make_spec)
    try:
        with pytest.raises(CapacityExhaustedError, match="uid"):
            provider.provision(make_spec(provider_options={"command": SLEEPER}))
        provider.terminate(first)
        third = _sandbox(provider, make_spec)
        uids = [provider.exec_command(h, "id -u").stdout.strip() for h in (second, third)]
        provider.terminate(third)
    finally:
        provider.terminate(first)
        provider.terminate(second)
        provider.terminate(finished)
    assert sorted(uids) == [str(UID_BASE), str(UID_BASE + 1)], uids


# Inside the sandbox: add a key to the uid's user keyring and user-session keyring (argv
# "add"), or look for one there; keyctl(2) and add_key(2) by number (x86_64, aarch64).
KEYRING_PROBE = r"""
import ctypes, platform, sys
ADD_KEY, KEYCTL = {"x86_64": (248, 250), "aarch64": (217, 219)}[platform.machine()]
libc = ctypes.CDLL(None, use_errno=True)
for keyring in (-4, -5):  # KEY_SPEC_USER_KEYRING, KEY_SPEC_USER_SESSION_KEYRING
    if sys.argv[1] == "add":
        made = libc.syscall(ADD_KEY, b"user", b"corral-left", b"tenant-a", 8, keyring)
        print("added" if made >= 0 else f"add failed {ctypes.get_errno()}")
    else:
        found = libc.syscall(KEYCTL, 10, keyring, b"user", b"corral-left", 0)  # SEARCH
        print("found" if found >= 0 else "none")
"""


@pytest.mark.usefixtures("root_worker")
def test_a_uid_handed_on_carries_no_key_of_its_last_sandbox(
    require_bwrap: str, sandbox_root: Path, make_spec: SpecFactory
) -> None:
    """The kernel keeps a uid's keyrings beyond its processes: the next sandbox given the uid
    must not find what the last one left there."""
    require(platform.machine() in ("x86_64", "aarch64"), "keyctl's number on this machine")
    provider = LocalProvider(
        {
            "root_dir": sandbox_root,
            "isolation": "required",
            "sandbox_uid": UID_BASE + 50,
            "sandbox_gid": UID_BASE + 50,
            "sandbox_uid_count": 1,
        }
    )
    adding = provider.provision(
        make_spec(provider_options={"command": ["python3", "-c", KEYRING_PROBE, "add"]})
    )
    wait_until_final(provider, adding)
    added = "\n".join(provider.stream_logs(adding))
    looking = _sandbox(provider, make_spec)  # the only uid of the range: the same one
    try:
        found = provider.exec_command(looking, ["python3", "-c", KEYRING_PROBE, "look"])
    finally:
        provider.terminate(looking)
        provider.terminate(adding)
    assert added.split() == ["added", "added"], added
    assert found.stdout.split() == ["none", "none"], found


def _address_space(pid: int) -> str:
    """The soft RLIMIT_AS of a process, as /proc tells it."""
    for line in Path(f"/proc/{pid}/limits").read_text().splitlines():
        if line.startswith("Max address space"):
            return line.split()[3]
    raise AssertionError(f"no address space line for {pid}")


@pytest.mark.parametrize("resources", [{"cpu": 0.5}, {}], ids=["cpu-only", "no-limit"])
def test_the_egress_proxy_is_bounded_in_memory_unless_the_sandboxs_cgroup_limits_memory(
    require_bwrap: str, sandbox_root: Path, make_spec: SpecFactory, resources: dict[str, float]
) -> None:
    mechanism = detect("auto")
    require(mechanism.kind == "cgroup", "a writable cgroup (v2 memory, or v1)")
    if resources:
        require(mechanism.cpu_parent is not None, "a writable cgroup cpu controller")
    provider = LocalProvider({"root_dir": sandbox_root, "isolation": "required"})
    spec = make_spec(
        resources=resources,
        egress={"allow_network": True},
        provider_options={"command": SLEEPER},
    )
    handle = provider.provision(spec)
    try:
        proxies = proxies_under(sandbox_root / spec.sandbox_id)
        limits = {_address_space(pid) for pid in proxies}
    finally:
        provider.terminate(handle)
    assert proxies, "the proxy runs"
    assert limits == {str(PROXY_MEMORY_BYTES)}, limits
