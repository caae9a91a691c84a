"""The local provider on real processes and real bubblewrap."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import threading
import time
import tracemalloc
from collections.abc import Iterator
from pathlib import Path

import pytest

from corral.providers.base import SandboxHandle, SandboxState
from corral.providers.errors import (
    CapacityExhaustedError,
    FileTooLargeError,
    InvalidProviderConfigError,
    ProviderTimeoutError,
    SandboxCreateError,
    SandboxNotRunningError,
    SandboxPathError,
    SandboxVerificationError,
)
from corral.providers.local.isolation import base_python
from corral.providers.local.limits import detect
from corral.providers.local.provider import LocalProvider
from tests import floods
from tests.conftest import SpecFactory, require, require_bwrap_path
from tests.processes import supervisor_of


def wait_until_final(provider: LocalProvider, handle: SandboxHandle, limit: float = 10) -> None:
    deadline = time.monotonic() + limit
    while not provider.status(handle).state.is_final:
        assert time.monotonic() < deadline, "sandbox did not finish in time"
        time.sleep(0.02)


def live_members(pgid: int) -> list[str]:
    """Processes of the group that are still running (zombies wait only to be reaped)."""
    listing = subprocess.run(
        ["ps", "-o", "pid=,stat=", "-g", str(pgid)], check=False, capture_output=True, text=True
    ).stdout
    return [line.split()[0] for line in listing.splitlines() if not line.split()[1].startswith("Z")]


def output_of(provider: LocalProvider, handle: SandboxHandle) -> str:
    return "\n".join(provider.stream_logs(handle))


@pytest.fixture
def tcp_listener() -> Iterator[int]:
    """A TCP listener on 127.0.0.1 that accepts and closes connections."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(16)
    stop = threading.Event()

    def serve() -> None:
        server.settimeout(0.1)
        while not stop.is_set():
            try:
                connection, _ = server.accept()
            except TimeoutError:
                continue
            connection.close()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    yield server.getsockname()[1]
    stop.set()
    thread.join()
    server.close()


PROBE = """
import os, socket, sys
port, worker_pid = int(sys.argv[1]), int(sys.argv[2])
try:
    socket.create_connection(("127.0.0.1", port), timeout=2).close()
    print("tcp=connected")
except OSError as exc:
    print(f"tcp=refused {exc}")
print("worker_visible=" + str(os.path.exists(f"/proc/{worker_pid}")))
print("own_pid=" + str(os.getpid()))
"""


@pytest.mark.parametrize("allow_network", [False, True])
def test_bubblewrap_isolates_network_and_processes(
    require_bwrap: str,
    sandbox_root: Path,
    make_spec: SpecFactory,
    tcp_listener: int,
    allow_network: bool,
) -> None:
    # With network or without, a sandbox never shares the host's network namespace: the
    # host's loopback listener (where the control plane's services listen) is unreachable.
    provider = LocalProvider({"root_dir": sandbox_root, "isolation": "required"})
    command = ["python3", "-c", PROBE, str(tcp_listener), str(os.getpid())]
    spec = make_spec(egress={"allow_network": allow_network}, provider_options={"command": command})
    handle = provider.provision(spec)
    wait_until_final(provider, handle)
    output = output_of(provider, handle)
    provider.terminate(handle)

    assert "tcp=refused" in output, output
    # In either case the sandbox has its own pid namespace: the worker is invisible and the
    # sandbox's own pids are small.
    assert "worker_visible=False" in output
    own_pid = int(output.split("own_pid=")[1].split()[0])
    assert own_pid < 10


def test_isolation_off_under_a_root_worker_is_refused(
    sandbox_root: Path, make_spec: SpecFactory
) -> None:
    require(os.geteuid() == 0, "a root worker")
    provider = LocalProvider({"root_dir": sandbox_root, "isolation": "off"})
    spec = make_spec(egress={"allow_network": True}, provider_options={"command": ["true"]})
    with pytest.raises(SandboxCreateError, match="never runs as root"):
        provider.provision(spec)
    assert list(sandbox_root.iterdir()) == []


def test_isolation_auto_without_bubblewrap_is_refused_not_degraded(
    sandbox_root: Path, make_spec: SpecFactory
) -> None:
    provider = LocalProvider({"root_dir": sandbox_root, "bwrap_path": "no-such-bwrap"})
    spec = make_spec(egress={"allow_network": True}, provider_options={"command": ["true"]})
    with pytest.raises(SandboxCreateError, match="apt-get install bubblewrap"):
        provider.provision(spec)
    health = provider.health_check()
    assert not health.healthy and "bubblewrap" in health.message
    assert list(sandbox_root.iterdir()) == []


def test_isolated_sandbox_sees_no_host_secrets(
    require_bwrap: str, sandbox_root: Path, make_spec: SpecFactory
) -> None:
    provider = LocalProvider({"root_dir": sandbox_root, "isolation": "required"})
    handle = provider.provision(make_spec(provider_options={"command": ["sleep", "30"]}))
    result = provider.exec_command(
        handle, "ls /etc/shadow /root 2>&1; touch /usr/x 2>&1; touch ok && echo writable"
    )
    provider.terminate(handle)
    assert "No such file" in result.stdout
    assert "Read-only file system" in result.stdout
    assert "writable" in result.stdout


@pytest.mark.parametrize("isolation", ["auto"])
def test_environment_is_only_the_spec_env_and_control_url_and_the_token_on_a_pipe(
    sandbox_root: Path, make_spec: SpecFactory, isolation: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("WORKER_ONLY_SECRET", "must-not-leak")
    provider = LocalProvider({"root_dir": sandbox_root, "isolation": isolation})
    command = ["sh", "-c", 'env; echo; echo "token:$(cat <&"$CORRAL_REGISTRATION_TOKEN_FD")"']
    spec = make_spec(env={"GREETING": "hi"}, provider_options={"command": command})
    handle = provider.provision(spec)
    wait_until_final(provider, handle)
    lines = list(provider.stream_logs(handle))
    provider.terminate(handle)
    token_lines = [line.removeprefix("token:") for line in lines if line.startswith("token:")]
    env = dict(line.split("=", 1) for line in lines[: lines.index("")] if "=" in line)

    assert "WORKER_ONLY_SECRET" not in env
    assert env["GREETING"] == "hi"
    # The token is in no environment block: the entrypoint gets it on an inherited pipe.
    assert token_lines == [spec.registration_token.get_secret_value()]
    assert spec.registration_token.get_secret_value() not in env.values()
    assert env["CORRAL_CONTROL_URL"] == spec.control_url
    # Beyond those: a fixed PATH/HOME, the runner's import path, and the locale Python sets.
    extras = set(env) - {"GREETING", "CORRAL_REGISTRATION_TOKEN_FD", "CORRAL_CONTROL_URL"}
    extras -= {"HTTP_PROXY", "HTTPS_PROXY", "http_proxy", "https_proxy"}  # corral's proxy
    extras -= {"CORRAL_EGRESS_PROXY_PORT", "CORRAL_EGRESS_PROXY_SOCKET"}
    assert extras <= {
        "CORRAL_SANDBOX_ID",
        "PATH",
        "HOME",
        "PYTHONPATH",
        "PWD",
        "LC_CTYPE",
        "SHLVL",
        "_",
    }


def test_terminate_kills_the_whole_process_group(
    sandbox_root: Path, make_spec: SpecFactory
) -> None:
    provider = LocalProvider({"root_dir": sandbox_root, "isolation": "required"})
    command = ["sh", "-c", "sleep 300 & sleep 300 & wait"]
    handle = provider.provision(make_spec(provider_options={"command": command}))
    time.sleep(0.3)
    pgid, _ = supervisor_of(sandbox_root, handle.external_id)
    assert len(live_members(pgid)) >= 4  # supervisor, sh and two sleeps
    provider.terminate(handle)
    assert live_members(pgid) == []


def test_deadline_kills_the_sandbox_and_says_so(sandbox_root: Path, make_spec: SpecFactory) -> None:
    provider = LocalProvider(
        {"root_dir": sandbox_root, "isolation": "required", "grace_period_s": 0.2}
    )
    spec = make_spec(resources={"timeout_s": 1}, provider_options={"command": ["sleep", "60"]})
    handle = provider.provision(spec)
    wait_until_final(provider, handle)
    status = provider.status(handle)
    provider.terminate(handle)
    assert status.state is SandboxState.FAILED
    assert status.reason is not None and "deadline of 1s exceeded" in status.reason


def test_exit_codes_map_to_states(sandbox_root: Path, make_spec: SpecFactory) -> None:
    provider = LocalProvider({"root_dir": sandbox_root, "isolation": "required"})
    ok = provider.provision(make_spec(provider_options={"command": ["true"]}))
    bad = provider.provision(make_spec(provider_options={"command": ["sh", "-c", "exit 3"]}))
    wait_until_final(provider, ok)
    wait_until_final(provider, bad)
    assert provider.status(ok).state is SandboxState.TERMINATED
    failed = provider.status(bad)
    provider.terminate(ok)
    provider.terminate(bad)
    assert (failed.state, failed.exit_code, failed.reason) == (
        SandboxState.FAILED,
        3,
        "exited with code 3",
    )


def test_the_end_log_is_the_end_of_what_the_sandbox_printed_read_within_its_bounds(
    sandbox_root: Path, make_spec: SpecFactory
) -> None:
    provider = LocalProvider({"root_dir": sandbox_root, "isolation": "required"})
    # 8 MB on stdout, most of it one line, then the reason on stderr, and an early exit.
    script = (
        "head -c 8000000 /dev/zero | tr '\\0' x; echo; seq 1 100; "
        "echo 'corral-test: /opt/tool is missing' >&2; exit 3"
    )
    handle = provider.provision(make_spec(provider_options={"command": ["sh", "-c", script]}))
    wait_until_final(provider, handle)

    tail = provider.end_log(handle, max_lines=40, max_bytes=16 * 1024)
    assert tail is not None
    assert tail.splitlines() == [
        *(str(n) for n in range(62, 101)),
        "corral-test: /opt/tool is missing",
    ]
    small = provider.end_log(handle, max_lines=40, max_bytes=100)
    assert small is not None and len(small.encode()) <= 100
    assert small.endswith("corral-test: /opt/tool is missing\n")

    provider.terminate(handle)
    assert provider.end_log(handle, max_lines=40, max_bytes=16 * 1024) is None


def test_memory_limit_stops_a_greedy_sandbox(sandbox_root: Path, make_spec: SpecFactory) -> None:
    provider = LocalProvider(
        {"root_dir": sandbox_root, "isolation": "required", "resource_limits": "rlimit"}
    )
    assert "limits: RLIMIT_AS" in provider.health_check().message
    greedy = ["python3", "-c", "block = bytearray(512 * 1024 * 1024)"]
    spec = make_spec(resources={"memory_mb": 128}, provider_options={"command": greedy})
    handle = provider.provision(spec)
    wait_until_final(provider, handle)
    assert provider.status(handle).state is SandboxState.FAILED
    assert "MemoryError" in output_of(provider, handle)
    provider.terminate(handle)


# Written, not only reserved: a cgroup counts the pages a process touches.
TOUCHING = ["python3", "-c", "block = b'x' * (512 * 1024 * 1024)"]


@pytest.mark.parametrize("isolation", ["required"])
def test_a_sandbox_over_its_cgroup_limit_ends_out_of_memory(
    sandbox_root: Path, make_spec: SpecFactory, isolation: str
) -> None:
    if isolation == "required":
        require_bwrap_path()
    require(detect("auto").kind == "cgroup", "a writable cgroup (v2 memory, or v1)")
    provider = LocalProvider(
        {"root_dir": sandbox_root, "isolation": isolation, "resource_limits": "cgroup"}
    )
    assert "limits: cgroup v" in provider.health_check().message
    spec = make_spec(
        resources={"memory_mb": 96, "cpu": 0.5},
        provider_options={"command": TOUCHING},
        egress={"allow_network": True},
    )
    handle = provider.provision(spec)
    group = provider.limits.launch(spec.sandbox_id, 96 * 1024 * 1024, None)
    assert group is not None and Path(group["memory_dir"]).is_dir()  # its own, while it runs
    wait_until_final(provider, handle, limit=30)
    status = provider.status(handle)
    assert status.state is SandboxState.FAILED
    assert status.reason is not None and status.reason.startswith("out_of_memory"), status
    assert not Path(group["memory_dir"]).exists()  # removed at the end
    provider.terminate(handle)


def test_a_cpu_request_becomes_the_sandbox_groups_quota(
    sandbox_root: Path, make_spec: SpecFactory
) -> None:
    mechanism = detect("auto")
    require(mechanism.cpu_parent is not None, "a writable cgroup cpu controller")
    provider = LocalProvider({"root_dir": sandbox_root, "isolation": "required"})
    sleeper = ["python3", "-c", "import time; time.sleep(30)"]
    spec = make_spec(resources={"cpu": 0.5}, provider_options={"command": sleeper})
    handle = provider.provision(spec)
    group = provider.limits.launch(spec.sandbox_id, None, 0.5)
    assert group is not None and group["cpu_dir"] is not None
    cpu_dir = Path(group["cpu_dir"])
    if mechanism.version == 2:
        assert (cpu_dir / "cpu.max").read_text().split() == ["50000", "100000"]
    else:
        assert (cpu_dir / "cpu.cfs_quota_us").read_text().strip() == "50000"
    pids = (cpu_dir / "cgroup.procs").read_text().split()
    assert pids, "the sandbox's processes are in its group"
    provider.terminate(handle)
    assert not cpu_dir.exists()


def test_within_its_cgroup_limit_a_sandbox_runs_as_usual(
    sandbox_root: Path, make_spec: SpecFactory
) -> None:
    require(detect("auto").kind == "cgroup", "a writable cgroup (v2 memory, or v1)")
    provider = LocalProvider({"root_dir": sandbox_root, "isolation": "required"})
    modest = ["python3", "-c", "block = b'x' * (16 * 1024 * 1024); print('fine')"]
    spec = make_spec(resources={"memory_mb": 256}, provider_options={"command": modest})
    handle = provider.provision(spec)
    wait_until_final(provider, handle)
    assert provider.status(handle).state is SandboxState.TERMINATED
    assert "fine" in output_of(provider, handle)
    provider.terminate(handle)


def test_a_restarted_worker_finds_and_terminates_its_sandboxes(
    sandbox_root: Path, make_spec: SpecFactory
) -> None:
    first = LocalProvider({"root_dir": sandbox_root, "isolation": "required"})
    spec = make_spec(provider_options={"command": ["sleep", "300"]})
    first.provision(spec)

    restarted = LocalProvider({"root_dir": sandbox_root, "isolation": "required"})
    [managed] = restarted.list_managed()
    assert managed.sandbox_id == spec.sandbox_id
    assert managed.labels["corral.work-item-id"] == spec.work_item_id
    assert restarted.status(managed.handle).state is SandboxState.RUNNING
    restarted.terminate(managed.handle)
    assert restarted.status(managed.handle).state is SandboxState.TERMINATED
    assert first.status(managed.handle).state is SandboxState.TERMINATED


def test_a_supervisor_killed_from_outside_reads_as_failed(
    sandbox_root: Path, make_spec: SpecFactory
) -> None:
    provider = LocalProvider({"root_dir": sandbox_root, "isolation": "required"})
    handle = provider.provision(make_spec(provider_options={"command": ["sleep", "300"]}))
    os.killpg(supervisor_of(sandbox_root, handle.external_id)[0], 9)
    wait_until_final(provider, handle)
    status = provider.status(handle)
    provider.terminate(handle)
    assert status.state is SandboxState.FAILED
    assert status.reason is not None and "killed from outside" in status.reason


def test_capacity_limit_refuses_the_next_sandbox(
    sandbox_root: Path, make_spec: SpecFactory
) -> None:
    provider = LocalProvider(
        {"root_dir": sandbox_root, "isolation": "required", "max_concurrent": 1}
    )
    first = provider.provision(make_spec(provider_options={"command": ["sleep", "300"]}))
    with pytest.raises(CapacityExhaustedError, match="limit of 1"):
        provider.provision(make_spec(provider_options={"command": ["sleep", "300"]}))
    provider.terminate(first)
    second = provider.provision(make_spec(provider_options={"command": ["sleep", "300"]}))
    provider.terminate(second)


def test_exec_timeout_kills_the_command(sandbox_root: Path, make_spec: SpecFactory) -> None:
    provider = LocalProvider({"root_dir": sandbox_root, "isolation": "required"})
    handle = provider.provision(make_spec(provider_options={"command": ["sleep", "300"]}))
    started = time.monotonic()
    with pytest.raises(ProviderTimeoutError, match=r"0\.5s"):
        provider.exec_command(handle, "sleep 30", timeout_s=0.5)
    assert time.monotonic() - started < 5
    provider.terminate(handle)


FLOOD = 50 * 1024 * 1024  # what a command prints, far past the limit
LIMIT = floods.LIMIT


def test_exec_keeps_no_more_than_the_limit_of_a_flood_of_output(
    sandbox_root: Path, make_spec: SpecFactory
) -> None:
    provider = LocalProvider({"root_dir": sandbox_root, "isolation": "required"})
    handle = provider.provision(make_spec(provider_options={"command": ["sleep", "300"]}))
    flood = floods.flood(FLOOD)
    tracemalloc.start()
    try:
        result = provider.exec_command(handle, flood, timeout_s=60, max_output_bytes=LIMIT)
        _, flood_peak = tracemalloc.get_traced_memory()
        tracemalloc.reset_peak()
        with pytest.raises(ProviderTimeoutError):  # prints for ever: ends at its timeout
            provider.exec_command(handle, ["yes"], timeout_s=0.5, max_output_bytes=LIMIT)
        _, endless_peak = tracemalloc.get_traced_memory()
        quiet = provider.exec_command(handle, ["echo", "quiet"], max_output_bytes=LIMIT)
    finally:
        tracemalloc.stop()
        provider.terminate(handle)
    assert (result.stdout, result.stderr) == ("x" * LIMIT, "e" * LIMIT)
    assert result.truncated and result.exit_code == 3  # it ran to its end all the same
    # 100 MB went through this process; it never held more than a few chunks of it.
    assert flood_peak < 4 * 1024 * 1024, flood_peak
    assert endless_peak < 4 * 1024 * 1024, endless_peak
    assert (quiet.stdout, quiet.truncated) == ("quiet\n", False)


def test_a_download_over_the_limit_is_refused_before_a_byte_is_copied(
    sandbox_root: Path, make_spec: SpecFactory, tmp_path: Path
) -> None:
    provider = LocalProvider({"root_dir": sandbox_root, "isolation": "required"})
    handle = provider.provision(make_spec(provider_options={"command": ["sleep", "300"]}))
    made = provider.exec_command(handle, floods.big_and_fitting_files(FLOOD))
    assert made.exit_code == 0, made
    os.mkfifo(sandbox_root / handle.external_id / "work" / "pipe")
    target = tmp_path / "download" / "file"
    written_before = floods.bytes_written()
    try:
        with pytest.raises(FileTooLargeError) as refused:
            provider.download_file(handle, "big.bin", target, max_bytes=LIMIT)
        written = floods.bytes_written() - written_before
        # A FIFO is no file to copy: refused at once, not waited on for a writer.
        with pytest.raises(SandboxPathError, match="not a regular file"):
            provider.download_file(handle, "pipe", target, max_bytes=LIMIT)
        provider.download_file(handle, "fits.bin", target, max_bytes=LIMIT)
    finally:
        provider.terminate(handle)
    assert refused.value.max_bytes == LIMIT
    assert written < LIMIT, written  # refused by its size: nothing of it was written here
    assert target.read_bytes() == b"\0" * LIMIT


def test_an_exec_env_path_never_picks_the_host_program_that_enters_the_sandbox(
    require_bwrap: str, sandbox_root: Path, make_spec: SpecFactory, tmp_path: Path
) -> None:
    """The sandbox's work directory is at its host path inside: a command there can write
    an executable named nsenter, and an exec's env may name that directory in PATH. The host
    side of the exec (run by the api, as its user) must not run it."""
    provider = LocalProvider({"root_dir": sandbox_root, "isolation": "required"})
    handle = provider.provision(make_spec(provider_options={"command": ["sleep", "300"]}))
    hit = tmp_path / "host-ran-the-sandbox-program"
    try:
        workdir = provider.exec_command(handle, ["pwd"]).stdout.strip()
        plant = f"printf '#!/bin/sh\\necho ran > {hit}\\n' > nsenter && chmod +x nsenter"
        assert provider.exec_command(handle, plant).exit_code == 0
        result = provider.exec_command(handle, ["/bin/true"], env={"PATH": workdir})
    finally:
        provider.terminate(handle)
    assert not hit.exists(), "the host ran a program the sandbox wrote"
    assert result.exit_code == 0, result


def test_an_exec_in_an_isolated_sandbox_whose_namespaces_are_unknown_runs_nowhere(
    require_bwrap: str, sandbox_root: Path, make_spec: SpecFactory, tmp_path: Path
) -> None:
    """Its supervisor did not see bubblewrap's namespaces (setup slower than it waits): the
    command is refused, not run on the host."""
    provider = LocalProvider({"root_dir": sandbox_root, "isolation": "required"})
    handle = provider.provision(make_spec(provider_options={"command": ["sleep", "300"]}))
    started = sandbox_root / handle.external_id / "started.json"
    hit = tmp_path / "ran-on-the-host"
    try:
        assert provider.exec_command(handle, ["true"]).exit_code == 0
        started.write_text(json.dumps({**json.loads(started.read_text()), "ns_pid": None}))
        with pytest.raises(SandboxNotRunningError, match="no namespaces"):
            provider.exec_command(handle, f"echo ran > {hit}")
    finally:
        provider.terminate(handle)
    assert not hit.exists()


def test_exec_joins_the_sandbox_namespaces(
    require_bwrap: str, sandbox_root: Path, make_spec: SpecFactory
) -> None:
    provider = LocalProvider({"root_dir": sandbox_root, "isolation": "required"})
    spec = make_spec(
        egress={"allow_network": False},
        provider_options={"command": ["bash", "-c", "exec -a corral-entrypoint sleep 300"]},
    )
    handle = provider.provision(spec)
    result = provider.exec_command(handle, "hostname; ps -eo args")
    provider.terminate(handle)
    assert result.stdout.splitlines()[0] == f"corral-{spec.sandbox_id}"
    assert "corral-entrypoint" in result.stdout  # it sees the sandbox's own processes


def test_symlinks_cannot_lead_file_transfers_outside(
    sandbox_root: Path, make_spec: SpecFactory, tmp_path: Path
) -> None:
    provider = LocalProvider({"root_dir": sandbox_root, "isolation": "required"})
    handle = provider.provision(make_spec(provider_options={"command": ["sleep", "300"]}))
    provider.exec_command(handle, ["ln", "-s", "/etc", "escape"])
    with pytest.raises(SandboxPathError, match="outside the sandbox"):
        provider.download_file(handle, "escape/hostname", tmp_path / "x")
    provider.terminate(handle)


def test_isolation_required_without_bubblewrap_fails_clearly(
    sandbox_root: Path, make_spec: SpecFactory
) -> None:
    provider = LocalProvider(
        {"root_dir": sandbox_root, "isolation": "required", "bwrap_path": "no-such-bwrap"}
    )
    with pytest.raises(SandboxCreateError, match="apt-get install bubblewrap"):
        provider.provision(make_spec(provider_options={"command": ["true"]}))
    assert not provider.health_check().healthy
    assert list(sandbox_root.iterdir()) == []


def test_no_network_without_isolation_is_refused(
    sandbox_root: Path, make_spec: SpecFactory
) -> None:
    provider = LocalProvider({"root_dir": sandbox_root, "isolation": "off"})
    spec = make_spec(egress={"allow_network": False}, provider_options={"command": ["true"]})
    with pytest.raises(SandboxCreateError, match="allow_network=false needs bubblewrap"):
        provider.provision(spec)


def test_gpu_requests_are_refused_before_allocation(
    sandbox_root: Path, make_spec: SpecFactory
) -> None:
    provider = LocalProvider({"root_dir": sandbox_root, "isolation": "required"})
    with pytest.raises(InvalidProviderConfigError, match="no GPUs"):
        provider.provision(make_spec(resources={"gpu": 1}))
    assert list(sandbox_root.iterdir()) == []


def test_a_sandbox_that_cannot_start_is_a_verification_error(
    require_bwrap: str, sandbox_root: Path, make_spec: SpecFactory
) -> None:
    provider = LocalProvider(
        {
            "root_dir": sandbox_root,
            "isolation": "required",
            "read_only_binds": ["/no/such/host/path"],
        }
    )
    with pytest.raises(SandboxVerificationError, match="did not start"):
        provider.provision(make_spec(provider_options={"command": ["true"]}))
    assert provider.list_managed() == []


def test_an_isolated_entrypoint_that_fails_at_once_is_a_failure_not_a_start_error(
    require_bwrap: str, sandbox_root: Path, make_spec: SpecFactory
) -> None:
    provider = LocalProvider({"root_dir": sandbox_root, "isolation": "required"})
    handle = provider.provision(make_spec(provider_options={"command": ["sh", "-c", "exit 3"]}))
    wait_until_final(provider, handle)
    assert provider.status(handle).exit_code == 3
    provider.terminate(handle)


@pytest.mark.parametrize("program", ["/no/such/binary", "no-such-program"])
def test_a_configured_entrypoint_that_does_not_exist_is_refused_before_allocation(
    sandbox_root: Path, make_spec: SpecFactory, program: str
) -> None:
    provider = LocalProvider({"root_dir": sandbox_root, "command": [program]})
    with pytest.raises(SandboxCreateError, match=program):
        provider.provision(make_spec())
    assert list(sandbox_root.iterdir()) == []


def test_a_pools_entrypoint_is_never_looked_up_on_the_host(
    require_bwrap: str, sandbox_root: Path, make_spec: SpecFactory, tmp_path: Path
) -> None:
    # A pool's command is the tenant's: whether a host path exists must not change the
    # answer (an oracle of the host's files). Both fail the same way, in the sandbox.
    secret_dir = tmp_path / "host-only"
    secret_dir.mkdir()
    (secret_dir / "present").write_text("")
    provider = LocalProvider({"root_dir": sandbox_root, "isolation": "required"})
    outcomes = []
    for program in (secret_dir / "present", secret_dir / "absent"):
        handle = provider.provision(make_spec(provider_options={"command": [str(program)]}))
        wait_until_final(provider, handle)
        outcomes.append(provider.status(handle).state)
        provider.terminate(handle)
    assert outcomes == [SandboxState.FAILED, SandboxState.FAILED]


def test_binds_under_tmp_survive_the_private_tmp(
    require_bwrap: str, sandbox_root: Path, make_spec: SpecFactory, tmp_path: Path
) -> None:
    tool = tmp_path / "tools"
    tool.mkdir()
    (tool / "hello").write_text("#!/bin/sh\necho hello from a bound tool\n")
    (tool / "hello").chmod(0o755)
    provider = LocalProvider(
        {"root_dir": sandbox_root, "isolation": "required", "read_only_binds": [str(tool)]}
    )
    script = f"import subprocess; subprocess.run([{str(tool / 'hello')!r}])"
    handle = provider.provision(make_spec(provider_options={"command": ["python3", "-c", script]}))
    wait_until_final(provider, handle)
    output = output_of(provider, handle)
    status = provider.status(handle)
    provider.terminate(handle)
    assert status.state is SandboxState.TERMINATED, output
    assert "hello from a bound tool" in output


def test_a_sandboxs_runner_imports_bytecode_compiled_once_on_the_host(
    require_bwrap: str, sandbox_root: Path, make_spec: SpecFactory
) -> None:
    # The runner package is bound read-only: a runner that had to compile it would do so at
    # every start. Every runner module imported inside the sandbox comes from bytecode.
    provider = LocalProvider({"root_dir": sandbox_root, "isolation": "required"})
    command = [base_python(), "-S", "-v", "-c", "import runner.main"]
    handle = provider.provision(make_spec(provider_options={"command": command}))
    wait_until_final(provider, handle)
    output = output_of(provider, handle)
    provider.terminate(handle)

    imported = set(re.findall(r"^import '(runner[\w.]*)'", output, re.MULTILINE))
    from_bytecode = set(
        re.findall(r"code object from '\S*?/(runner/\S*?)__pycache__/(\w+)\.", output)
    )
    assert {"runner", "runner.main", "runner.control"} <= imported, output[-2000:]
    loaded = {
        f"{path.replace('/', '.')}{name}".replace(".__init__", "") for path, name in from_bytecode
    }
    assert imported <= loaded, sorted(imported - loaded)
