"""Who a local sandbox runs as, and what its work can learn of its runner: the real runner
(``python -m runner``) in a real bubblewrap sandbox, under this (root) worker, against a fake
control plane on a Unix socket."""

from __future__ import annotations

import os
import shlex
import time
from pathlib import Path

import pytest

from corral.providers.base import SandboxHandle
from corral.providers.local.provider import LocalProvider
from tests.conftest import SpecFactory
from tests.unit.test_runner import (
    SESSION,
    TOKEN,
    FakeControlPlane,
    PlaneFactory,
    control_plane,  # noqa: F401 - the fixture
    shell,
)

SCANNER = (Path(__file__).resolve().parents[1] / "token_scan.py").read_text()
CANARY = "crs_canary-0123456789"  # the work's own: the scan must find it, and only it

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="the root worker's case: needs root")


def _finished(provider: LocalProvider, handle: SandboxHandle, limit_s: float = 60) -> None:
    deadline = time.monotonic() + limit_s
    while not provider.status(handle).state.is_final:
        assert time.monotonic() < deadline, "the sandbox did not finish in time"
        time.sleep(0.05)


def _reachable(plane: FakeControlPlane) -> FakeControlPlane:
    """Open the fake's socket as the api opens its own (a 0755 directory, a 0666 socket)."""
    socket = Path(plane.url.removeprefix("unix://"))
    socket.parent.chmod(0o755)
    socket.chmod(0o666)
    return plane


def _run(plane: FakeControlPlane, sandbox_root: Path, make_spec: SpecFactory) -> list[str]:
    """Run the plane's item in an isolated local sandbox; the work's standard output."""
    provider = LocalProvider({"root_dir": sandbox_root, "isolation": "required"})
    spec = make_spec(
        registration_token=TOKEN, control_url=plane.url, egress={"allow_network": False}
    )
    handle = provider.provision(spec)
    _finished(provider, handle)
    output = "\n".join(provider.stream_logs(handle))
    provider.terminate(handle)
    assert plane.completion()["exit_code"] == 0, (plane.lines(), output)
    return plane.lines("stdout")


def test_the_work_runs_as_the_unprivileged_sandbox_user_under_a_root_worker(
    require_bwrap: str,
    control_plane: PlaneFactory,  # noqa: F811
    sandbox_root: Path,
    make_spec: SpecFactory,
) -> None:
    assert os.geteuid() == 0  # the worker's case this is about
    work = (
        "id -u; id -g; id -G; grep -E '^Cap(Eff|Prm|Bnd)' /proc/self/status; "
        "touch mine && ls -n mine"
    )
    plane = _reachable(control_plane(shell(work), unix=True))

    out = _run(plane, sandbox_root, make_spec)

    assert out[:3] == ["10001", "10001", "10001"], out
    assert [line.split()[1] for line in out[3:6]] == ["0000000000000000"] * 3, out
    assert " 10001 10001 " in out[6], out  # what the work makes is the sandbox user's


def test_a_work_that_scans_every_process_finds_no_token_of_the_runner(
    require_bwrap: str,
    control_plane: PlaneFactory,  # noqa: F811
    sandbox_root: Path,
    make_spec: SpecFactory,
) -> None:
    """/proc/*/environ, cmdline and readable memory of every process the work can see: the
    runner's are closed to it, and the only token anywhere is the canary the work holds."""
    work = f"python3 -c {shlex.quote(SCANNER)}"
    plane = _reachable(control_plane(shell(work, env={"CANARY": CANARY}), unix=True))

    out = _run(plane, sandbox_root, make_spec)

    assert "scan done" in out, out
    [runner] = [line for line in out if line.startswith("scanned") and "-m runner" in line]
    assert "environ=denied mem=denied" in runner, runner
    found = [line for line in out if line.startswith("found")]
    # The scan works: it finds the canary in the work's shell, in its environ and memory.
    assert any("in=environ token=crs_canary" in line for line in found), out
    assert any("in=mem token=crs_canary" in line for line in found), out
    assert all(line.endswith(f"token={CANARY[:10]}...") for line in found), found
    assert TOKEN[:10] != CANARY[:10] != SESSION[:10]  # so a leak could not pass as the canary


def test_exec_and_uploads_act_as_the_configured_sandbox_user(
    require_bwrap: str, sandbox_root: Path, make_spec: SpecFactory, tmp_path: Path
) -> None:
    provider = LocalProvider(
        {
            "root_dir": sandbox_root,
            "isolation": "required",
            "sandbox_uid": 10002,
            "sandbox_gid": 10003,
        }
    )
    handle = provider.provision(make_spec(provider_options={"command": ["sleep", "30"]}))
    source = tmp_path / "upload.txt"
    source.write_text("hello")
    provider.upload_file(handle, source, "nested/dir/upload.txt")
    result = provider.exec_command(
        handle, "id -u; id -g; ls -n nested/dir/upload.txt; echo more >> nested/dir/upload.txt"
    )
    provider.terminate(handle)

    assert result.exit_code == 0, result
    lines = result.stdout.splitlines()
    assert lines[:2] == ["10002", "10003"], lines
    assert " 10002 10003 " in lines[2], lines  # the sandbox user may change what it was given


def test_the_runner_starts_without_the_hosts_site(
    require_bwrap: str,
    control_plane: PlaneFactory,  # noqa: F811
    sandbox_root: Path,
    make_spec: SpecFactory,
) -> None:
    """The runner holds the sandbox's tokens: its interpreter runs with -S, so no .pth file,
    sitecustomize or user site (the home is the work's) runs code in it."""
    work = "tr '\\0' ' ' < /proc/$PPID/cmdline; echo"
    plane = _reachable(control_plane(shell(work), unix=True))

    out = _run(plane, sandbox_root, make_spec)

    assert out and out[0].split()[1:] == ["-S", "-m", "runner"], out
