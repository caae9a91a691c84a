"""The docker provider on a real Docker Engine, beyond the contract suite."""

from __future__ import annotations

import time
import tracemalloc
import uuid
from collections.abc import Iterator
from pathlib import Path

import docker
import pytest

from corral.providers.base import SandboxState
from corral.providers.docker.provider import DEPLOYMENT_LABEL, DockerProvider, container_name
from corral.providers.errors import (
    FileTooLargeError,
    InvalidProviderConfigError,
    ProviderTimeoutError,
    ProviderUnavailableError,
    SandboxCreateError,
    SandboxPathError,
)
from tests import floods
from tests.conftest import DockerSandbox, SpecFactory
from tests.docker_engine import BASE_REPOSITORY, ROOTFS_SCRIPT, recipe_hash

SLEEP = {"command": ["sh", "-c", "echo up; exec sleep 300"]}


@pytest.fixture
def provider(docker_sandbox: DockerSandbox) -> Iterator[DockerProvider]:
    built = DockerProvider(
        {
            "base_url": docker_sandbox.url,
            "image": docker_sandbox.image,
            "network": "host",
            "grace_period_s": 1,
            "deployment": f"it-{uuid.uuid4().hex[:10]}",
        }
    )
    yield built
    for managed in built.list_managed():
        built.terminate(managed.handle)


@pytest.fixture
def engine(docker_sandbox: DockerSandbox) -> Iterator[docker.DockerClient]:
    client = docker.DockerClient(base_url=docker_sandbox.url)
    yield client
    client.close()


def test_a_container_killed_from_outside_reads_failed_with_the_reason(
    provider: DockerProvider, engine: docker.DockerClient, make_spec: SpecFactory
) -> None:
    handle = provider.provision(make_spec(provider_options=SLEEP))
    assert provider.status(handle).state is SandboxState.RUNNING
    engine.containers.get(handle.external_id).kill()
    deadline = time.monotonic() + 10
    status = provider.status(handle)
    while status.state is SandboxState.RUNNING and time.monotonic() < deadline:
        time.sleep(0.05)
        status = provider.status(handle)
    assert status.state is SandboxState.FAILED
    assert status.reason == "killed by signal 9 (exit code 137)"


def test_exit_codes_map_to_terminated_and_failed(
    provider: DockerProvider, make_spec: SpecFactory
) -> None:
    ok = provider.provision(make_spec(provider_options={"command": ["true"]}))
    bad = provider.provision(make_spec(provider_options={"command": ["sh", "-c", "exit 3"]}))
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and provider.status(bad).state is not SandboxState.FAILED:
        time.sleep(0.05)
    assert provider.status(ok).state is SandboxState.TERMINATED
    assert provider.status(bad).reason == "exited with code 3"


def test_the_end_log_is_the_end_of_the_container_s_log_read_within_its_bounds(
    provider: DockerProvider, make_spec: SpecFactory
) -> None:
    # 4 MB in one line, numbered lines, then the reason, all on stderr (the engine copies
    # stdout and stderr apart: lines of the two interleave by when each landed); exit 3.
    script = (
        "{ head -c 4000000 /dev/zero | tr '\\0' x; echo; seq 1 100; "
        "echo 'corral-test: /opt/tool is missing'; } >&2; exit 3"
    )
    handle = provider.provision(make_spec(provider_options={"command": ["sh", "-c", script]}))
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and not provider.status(handle).state.is_final:
        time.sleep(0.05)

    tail = provider.end_log(handle, max_lines=40, max_bytes=16 * 1024)
    assert tail is not None
    assert tail.splitlines() == [
        *(str(n) for n in range(62, 101)),
        "corral-test: /opt/tool is missing",
    ]
    # Of a log whose last lines hold a 4 MB one: read by its end, no more than the limit.
    wide = provider.end_log(handle, max_lines=102, max_bytes=200)
    assert wide is not None and len(wide.encode()) <= 200
    assert wide.endswith("99\n100\ncorral-test: /opt/tool is missing\n")

    provider.terminate(handle)
    assert provider.end_log(handle, max_lines=40, max_bytes=16 * 1024) is None


def test_a_missing_image_is_permanent_names_the_image_and_leaves_nothing(
    provider: DockerProvider, engine: docker.DockerClient, make_spec: SpecFactory
) -> None:
    spec = make_spec(image="corral-no-such-image:1")
    with pytest.raises(SandboxCreateError, match="'corral-no-such-image:1'") as raised:
        provider.provision(spec)
    assert not raised.value.retryable
    assert engine.containers.list(all=True, filters={"name": container_name(spec.sandbox_id)}) == []


def test_an_unreachable_engine_is_transient(make_spec: SpecFactory) -> None:
    unreachable = DockerProvider({"base_url": "unix:///nonexistent/docker.sock"})
    with pytest.raises(ProviderUnavailableError) as raised:
        unreachable.provision(make_spec())
    assert raised.value.retryable
    assert not unreachable.health_check().healthy


def test_inventory_finds_a_labelled_orphan_and_ignores_unlabelled_containers(
    provider: DockerProvider, engine: docker.DockerClient, docker_sandbox: DockerSandbox
) -> None:
    labels = {
        "corral.managed": "true",
        "corral.sandbox-id": "sb-orphan",
        "corral.org-id": "acme",
        DEPLOYMENT_LABEL: provider.config.deployment,
    }
    orphan = engine.containers.run(
        docker_sandbox.image,
        entrypoint=["sleep", "300"],
        labels=labels,
        detach=True,
        network_mode="none",
    )
    stranger = engine.containers.run(
        docker_sandbox.image, entrypoint=["sleep", "300"], detach=True, network_mode="none"
    )
    try:
        found = provider.list_managed()
        assert [m.sandbox_id for m in found] == ["sb-orphan"]
        assert found[0].handle.external_id == orphan.name
        provider.terminate(found[0].handle)
        assert provider.list_managed() == []
    finally:
        stranger.remove(force=True)
        if _exists(engine, orphan.id):
            orphan.remove(force=True)


def _exists(engine: docker.DockerClient, container_id: str) -> bool:
    try:
        engine.containers.get(container_id)
    except docker.errors.NotFound:
        return False
    return True


def test_the_container_gets_only_the_spec_env_limits_and_no_network(
    provider: DockerProvider,
    engine: docker.DockerClient,
    make_spec: SpecFactory,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("CORRAL_WORKER_ONLY", "must-not-leak")
    limits = {"cpu": 0.5, "memory_mb": 256}
    spec = make_spec(
        provider_options=SLEEP,
        env={"FROM_SPEC": "yes"},
        resources=limits,
        egress={"allow_network": False},
    )
    handle = provider.provision(spec)
    attrs = engine.containers.get(handle.external_id).attrs
    env = dict(item.split("=", 1) for item in attrs["Config"]["Env"])
    assert env["FROM_SPEC"] == "yes"
    assert env["CORRAL_REGISTRATION_TOKEN"] == spec.registration_token.get_secret_value()
    assert "CORRAL_WORKER_ONLY" not in env
    host = attrs["HostConfig"]
    assert (host["NetworkMode"], host["NanoCpus"], host["Memory"]) == (
        "none",
        500_000_000,
        256 << 20,
    )
    assert host["PidsLimit"] == 1024
    assert attrs["Config"]["Labels"]["corral.sandbox-id"] == spec.sandbox_id
    probe = provider.exec_command(handle, ["ls", "/sys/class/net"])
    assert probe.stdout.split() == ["lo"]  # loopback only


def test_a_read_only_root_keeps_the_work_directory_writable(
    docker_sandbox: DockerSandbox, make_spec: SpecFactory
) -> None:
    provider = DockerProvider(
        {
            "base_url": docker_sandbox.url,
            "image": docker_sandbox.image,
            "read_only_root": True,
            "grace_period_s": 1,
            "deployment": f"ro-{uuid.uuid4().hex[:8]}",
        }
    )
    handle = provider.provision(make_spec(provider_options=SLEEP))
    try:
        assert provider.exec_command(handle, ["touch", "/etc/corral-probe"]).exit_code != 0
        assert provider.exec_command(handle, ["touch", "/work/ok"]).exit_code == 0
    finally:
        provider.terminate(handle)


def test_the_sandbox_image_runs_as_10001(
    provider: DockerProvider, engine: docker.DockerClient, make_spec: SpecFactory
) -> None:
    handle = provider.provision(make_spec(provider_options=SLEEP))
    assert engine.containers.get(handle.external_id).attrs["Config"]["User"] == "10001:10001"
    assert provider.exec_command(handle, ["id", "-u"]).stdout.split() == ["10001"]


def test_an_image_whose_user_is_root_runs_as_the_sandbox_user_with_a_writable_work_directory(
    docker_sandbox: DockerSandbox, engine: docker.DockerClient, make_spec: SpecFactory
) -> None:
    base = f"{BASE_REPOSITORY}:{recipe_hash(ROOTFS_SCRIPT)}"  # the imported root file system
    assert engine.images.get(base).attrs["Config"].get("User") in (None, "")  # root's
    provider = DockerProvider(
        {
            "base_url": docker_sandbox.url,
            "image": base,
            "grace_period_s": 1,
            "deployment": f"root-{uuid.uuid4().hex[:8]}",
        }
    )
    handle = provider.provision(make_spec(provider_options={"command": ["/bin/sleep", "300"]}))
    try:
        probe = provider.exec_command(
            handle, "/usr/bin/id -u; /usr/bin/touch /work/mine && echo ok"
        )
    finally:
        provider.terminate(handle)
    assert probe.stdout.split() == ["10001", "ok"], probe


@pytest.mark.parametrize("user", ["0", "root", "0:0", "root:10001", ""])
def test_root_is_refused_as_the_configured_user(user: str) -> None:
    with pytest.raises(InvalidProviderConfigError, match="never run as root"):
        DockerProvider({"user": user} if user else {"sandbox_user": user})


def test_exec_honours_user_workdir_and_timeout(
    provider: DockerProvider, make_spec: SpecFactory
) -> None:
    handle = provider.provision(make_spec(provider_options=SLEEP))
    provider.exec_command(handle, ["mkdir", "-p", "/work/sub"])
    where = provider.exec_command(handle, ["sh", "-c", "pwd; id -u"], cwd="sub", user="0")
    assert where.stdout.split() == ["/work/sub", "0"]
    with pytest.raises(ProviderTimeoutError):
        provider.exec_command(handle, ["sleep", "30"], timeout_s=0.5)


FLOOD = 50 * 1024 * 1024  # what a command prints, or a file holds, far past the limit
LIMIT = floods.LIMIT


def test_exec_keeps_no_more_than_the_limit_of_a_flood_of_output(
    provider: DockerProvider, make_spec: SpecFactory
) -> None:
    handle = provider.provision(make_spec(provider_options=SLEEP))
    flood = floods.flood(FLOOD)
    result, peak = floods.peak_while(
        lambda: provider.exec_command(handle, flood, timeout_s=60, max_output_bytes=LIMIT)
    )
    assert (result.stdout, result.stderr) == ("x" * LIMIT, "e" * LIMIT)
    assert result.truncated and result.exit_code == 3  # it ran to its end all the same
    assert peak < 8 * 1024 * 1024, peak  # 100 MB went through; a few chunks were held
    quiet = provider.exec_command(handle, ["echo", "quiet"], max_output_bytes=LIMIT)
    assert (quiet.stdout, quiet.truncated) == ("quiet\n", False)


def test_a_download_over_the_limit_is_refused_before_a_byte_is_copied(
    provider: DockerProvider, make_spec: SpecFactory, tmp_path: Path
) -> None:
    handle = provider.provision(make_spec(provider_options=SLEEP))
    made = provider.exec_command(handle, floods.big_and_fitting_files(FLOOD))
    assert made.exit_code == 0, made
    target = tmp_path / "download" / "file"
    tracemalloc.start()
    try:
        with pytest.raises(FileTooLargeError) as refused:
            provider.download_file(handle, "big.bin", target, max_bytes=LIMIT)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert refused.value.max_bytes == LIMIT
    assert not target.exists() and peak < 4 * 1024 * 1024, peak  # refused by its stated size
    with pytest.raises(SandboxPathError, match="not a regular file"):
        provider.download_file(handle, ".", target, max_bytes=LIMIT)
    provider.download_file(handle, "fits.bin", target, max_bytes=LIMIT)
    assert target.read_bytes() == b"\0" * LIMIT
