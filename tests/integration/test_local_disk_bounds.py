"""What one local sandbox can put on its host's disk: at most its deployment's bound, whatever
it writes and wherever. A flood of output stops growing the sandbox's log at ``max_log_mb``
(its end is still kept, so the end log tells how the work ended), and files in every
writable place (the work directory, its home, /tmp; one big file, many, reserved blocks)
stop at ``disk_mb`` with ENOSPC, while the host's usage grows by no more than the bound.
Real bubblewrap, real processes; each attack caps itself at a few times the bound, so that
on a host without the bound it shows "far more than the limit" without filling the disk."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from corral.providers.base import SandboxHandle
from corral.providers.errors import SandboxCreateError, SandboxPathError
from corral.providers.local import disk
from corral.providers.local.disk import find_disk_tools
from corral.providers.local.provider import LOG_TAIL_BYTES, LocalProvider
from corral.providers.local.runner_copy import COPIES_DIR
from tests.conftest import SpecFactory, require
from tests.integration.test_local_provider import output_of, wait_until_final

MIB = 1024 * 1024
DISK_MB = 64
LOG_MB = 1
# How far past the bound each attack goes at most (on a host that does not stop it).
ATTACK_CAP = 4 * DISK_MB * MIB
# Room for what is not the work's: the image's own metadata, the sandbox's records.
SLACK = 2 * MIB

# Fills each writable place in turn (removing what it wrote before the next), then all of
# them at once, and leaves that last fill in place; prints what each write reached as JSON.
FILLER = """
import errno, json, os, sys
CAP, MIB = int(sys.argv[1]), 1024 * 1024
chunk = b"x" * MIB

def fill(path):
    written, error = 0, None
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        while written < CAP:
            written += os.write(fd, chunk[: min(MIB, CAP - written)])
    except OSError as exc:
        error = errno.errorcode[exc.errno]
    finally:
        os.close(fd)
    return written, error

def many(directory):
    os.makedirs(directory, exist_ok=True)
    written, error, number = 0, None, 0
    while written < CAP and error is None:
        done, error = fill(os.path.join(directory, f"f{number}"))
        written, number = written + done, number + 1
    return written, error

def reserve(path):
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        os.posix_fallocate(fd, 0, CAP)
        return CAP, None
    except OSError as exc:
        return 0, errno.errorcode[exc.errno]
    finally:
        os.close(fd)

def clear(*paths):
    for path in paths:
        if os.path.isdir(path):
            for name in os.listdir(path):
                os.unlink(os.path.join(path, name))
            os.rmdir(path)
        elif os.path.exists(path):
            os.unlink(path)

home = os.environ["HOME"]
report = {}
for name, attack, path in [
    ("work", fill, "big"),
    ("home", fill, os.path.join(home, ".cache-big")),
    ("tmp", fill, "/tmp/big"),
    ("many", many, "many"),
    ("reserved", reserve, "reserved"),
]:
    report[name] = attack(path)
    clear(path)
report["all"] = [fill("big")[0], fill("/tmp/big")[0]]
with open("small", "w") as handle:  # deleting and writing again works
    report["small_after"] = handle.write("fine")
print("REPORT " + json.dumps(report), flush=True)
"""


def host_usage(directory: Path) -> int:
    """The bytes the files under ``directory`` take on its own filesystem (allocated blocks,
    not apparent sizes; what is mounted below it is not counted: it is not that disk)."""
    device = directory.stat().st_dev
    used = 0
    for parent, names, files in os.walk(directory):
        names[:] = [n for n in names if os.lstat(os.path.join(parent, n)).st_dev == device]
        for name in files:
            info = os.lstat(os.path.join(parent, name))
            if info.st_dev == device:
                used += info.st_blocks * 512
    return used


def _report(output: str) -> dict[str, Any]:
    line = next(line for line in output.splitlines() if line.startswith("REPORT "))
    report: dict[str, Any] = json.loads(line.removeprefix("REPORT "))
    return report


def _provider(sandbox_root: Path, **config: Any) -> LocalProvider:
    return LocalProvider(
        {
            "root_dir": sandbox_root,
            "isolation": "required",
            "disk_mb": DISK_MB,
            "max_log_mb": LOG_MB,
            **config,
        }
    )


def _run(provider: LocalProvider, make_spec: SpecFactory, command: list[str]) -> SandboxHandle:
    spec = make_spec(egress={"allow_network": False}, provider_options={"command": command})
    handle = provider.provision(spec)
    wait_until_final(provider, handle, limit=120)
    return handle


def test_files_in_every_writable_place_stop_at_the_sandboxs_disk_bound(
    require_bwrap: str, sandbox_root: Path, make_spec: SpecFactory
) -> None:
    provider = _provider(sandbox_root)
    before = host_usage(sandbox_root)
    handle = _run(provider, make_spec, ["python3", "-c", FILLER, str(ATTACK_CAP)])
    try:
        grown = host_usage(sandbox_root) - before
        report = _report(output_of(provider, handle))
        status = provider.status(handle)
    finally:
        provider.terminate(handle)

    assert status.exit_code == 0, status
    bound = DISK_MB * MIB
    for place in ("work", "home", "tmp", "many"):
        written, error = report[place]
        assert written <= bound and error == "ENOSPC", (place, report[place])
    assert report["reserved"] == [0, "ENOSPC"]
    assert sum(report["all"]) <= bound, report["all"]
    assert report["small_after"] == 4
    assert grown <= bound + LOG_MB * MIB + LOG_TAIL_BYTES + SLACK, grown


def test_an_output_flood_stops_growing_the_log_and_its_end_is_kept(
    require_bwrap: str, sandbox_root: Path, make_spec: SpecFactory
) -> None:
    """64 MiB on stdout and stderr, in a log capped at 1 MiB: the work is not stopped or
    blocked (it runs to its end and exits 0), the log keeps its head, says what was dropped,
    and ends with the work's last words, which the end log shows."""
    provider = _provider(sandbox_root)
    flood = (
        "echo first words; head -c 33554432 /dev/zero | tr '\\0' x; "
        "head -c 33554432 /dev/zero | tr '\\0' e >&2; echo; echo last words >&2"
    )
    handle = _run(provider, make_spec, ["sh", "-c", flood])
    try:
        log = sandbox_root / handle.external_id / "output.log"
        size = log.stat().st_size
        head = log.read_bytes()[:100]
        end_log = provider.end_log(handle, max_lines=5, max_bytes=4096)
        status = provider.status(handle)
        output = output_of(provider, handle)
    finally:
        provider.terminate(handle)

    assert status.exit_code == 0, status
    assert size <= LOG_MB * MIB + LOG_TAIL_BYTES + 4096, size
    assert head.startswith(b"first words\n")
    assert f"the sandbox's output is capped at {LOG_MB} MiB" in output
    assert end_log is not None and end_log.rstrip().endswith("last words"), end_log


def test_a_full_sandbox_refuses_an_upload_by_name_and_works_again_once_it_has_room(
    require_bwrap: str, sandbox_root: Path, make_spec: SpecFactory, tmp_path: Path
) -> None:
    provider = _provider(sandbox_root)
    spec = make_spec(
        egress={"allow_network": False}, provider_options={"command": ["sleep", "300"]}
    )
    handle = provider.provision(spec)
    source = tmp_path / "payload"
    source.write_bytes(b"y" * MIB)
    try:
        fill = provider.exec_command(
            handle, ["sh", "-c", f"head -c {ATTACK_CAP} /dev/zero > big; echo $?"], timeout_s=120
        )
        with pytest.raises(SandboxPathError, match="no space left"):
            provider.upload_file(handle, source, "payload")
        assert provider.exec_command(handle, ["rm", "big"], timeout_s=60).exit_code == 0
        provider.upload_file(handle, source, "payload")
        copied = tmp_path / "copied"
        provider.download_file(handle, "payload", copied)
    finally:
        provider.terminate(handle)

    assert "No space left on device" in fill.stderr, fill
    assert copied.read_bytes() == source.read_bytes()


def test_the_health_check_says_how_the_disk_is_bounded(
    require_bwrap: str, sandbox_root: Path
) -> None:
    message = _provider(sandbox_root).health_check().message
    if os.geteuid() == 0:
        assert f"disk: {DISK_MB} MiB per sandbox" in message, message
    else:
        assert "disk: not bounded" in message, message
    assert f"output log: at most {LOG_MB} MiB" in message, message


@pytest.fixture
def not_root(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The provider as a worker that is not root sees it (sandboxes run as the worker)."""
    monkeypatch.setattr(os, "geteuid", lambda: 65534)
    find_disk_tools.cache_clear()
    yield
    find_disk_tools.cache_clear()


def test_a_worker_that_is_not_root_bounds_tmp_and_says_the_work_directory_is_not_bounded(
    require_bwrap: str, sandbox_root: Path, make_spec: SpecFactory, not_root: None
) -> None:
    """No image without root: /tmp is a tmpfs of ``disk_mb`` (ENOSPC there), the output is
    bounded as ever, and the health check says the work directory is not."""
    provider = _provider(sandbox_root)
    fill_tmp = (
        "import errno, os, sys\n"
        "fd = os.open('/tmp/big', os.O_WRONLY | os.O_CREAT, 0o600)\n"
        "written = 0\n"
        "try:\n"
        f"    while written < {ATTACK_CAP}: written += os.write(fd, b'x' * 1048576)\n"
        "except OSError as exc: print('REPORT', written, errno.errorcode[exc.errno])\n"
        "else: print('REPORT', written, None)\n"
    )
    handle = _run(provider, make_spec, ["python3", "-c", fill_tmp])
    try:
        output = output_of(provider, handle)
    finally:
        provider.terminate(handle)
    message = provider.health_check().message

    _, written, error = next(line for line in output.splitlines() if "REPORT" in line).split()
    assert int(written) <= DISK_MB * MIB and error == "ENOSPC", output
    assert "disk: not bounded: the work directory (the worker is not root" in message, message
    assert f"its /tmp a tmpfs of {DISK_MB} MiB" in message, message


def test_a_root_worker_that_cannot_make_an_image_refuses_rather_than_run_unbounded(
    require_bwrap: str,
    sandbox_root: Path,
    make_spec: SpecFactory,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    require(os.geteuid() == 0, "a root worker")
    monkeypatch.setattr(disk, "LOOP_CONTROL", str(sandbox_root / "no-loop-control"))
    find_disk_tools.cache_clear()
    try:
        provider = _provider(sandbox_root)
        health = provider.health_check()
        with pytest.raises(SandboxCreateError, match="no loop devices") as refused:
            provider.provision(make_spec(egress={"allow_network": False}))
        unbounded = _provider(sandbox_root, disk_mb=None)
        handle = _run(unbounded, make_spec, ["true"])
        unbounded.terminate(handle)
    finally:
        find_disk_tools.cache_clear()

    assert "set disk_mb to null" in refused.value.message
    assert not health.healthy and "no loop devices" in health.message, health
    # Nothing of either sandbox is left: the lock, and the runner package the second one
    # imported (providers/local/runner_copy.py: the provider's, kept for the next).
    left = sorted(path.name for path in sandbox_root.iterdir())
    assert left == [".lock", COPIES_DIR], "nothing was made"
