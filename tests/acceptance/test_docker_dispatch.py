"""Dispatch end to end through a docker provider worker: the runner inside the container
reaches the api over the mounted Unix socket, with no network; with the engine's default
runtime (runc), under gVisor (runsc), and with a read-only root filesystem."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import docker
import pytest

from tests.acceptance.conftest import shell, start_provider_stack
from tests.acceptance.stack import Stack
from tests.conftest import RUNSC, DockerSandbox, require_bwrap_path

CODE = "def main(word, times):\n    return {'echo': ' '.join([word] * times)}\n"
RUNC = "runc"  # the engine's default runtime
# runc with a read-only root filesystem: the runner needs only /work and /tmp (tmpfs) writable.
READ_ONLY = "runc-read-only"
# A command, and what it prints, that tells where the container runs: runc shows the
# container's network interfaces (loopback only), gVisor's kernel announces itself.
WHERE = {
    RUNC: ("ls /sys/class/net", ["lo"]),
    RUNSC: ("dmesg | grep -q gVisor && echo gvisor", ["gvisor"]),
}


@dataclass(frozen=True)
class DockerStack:
    stack: Stack
    deployment: str  # the label value of this stack's containers
    runtime: str
    org: str  # the org whose pool this stack's worker serves


@pytest.fixture(scope="module", params=[RUNC, RUNSC, READ_ONLY])
def docker_stack(
    request: pytest.FixtureRequest,
    postgres_database_url: str,
    redis_url: str,
    docker_sandbox: DockerSandbox,
) -> Iterator[DockerStack]:
    require_bwrap_path()
    runtime = RUNC if request.param == READ_ONLY else request.param
    if runtime == RUNSC:
        request.getfixturevalue("docker_runsc")
    deployment = f"e2e-{uuid.uuid4().hex[:8]}"
    config = {
        "base_url": docker_sandbox.url,
        "image": docker_sandbox.image,
        # gVisor's network stack refuses the host's namespace; these sandboxes have none.
        "network": "host" if runtime == RUNC else "none",
        "runtime": None if runtime == RUNC else runtime,
        "grace_period_s": 1,
        "deployment": deployment,
        "read_only_root": request.param == READ_ONLY,
    }
    org = f"dock-{request.param}"  # the stacks share the session's database: a pool each
    stack = start_provider_stack(postgres_database_url, redis_url, "docker", config, org)
    try:
        yield DockerStack(stack, deployment, runtime, org)
    finally:
        stack.stop()


def managed_containers(url: str, deployment: str) -> list[str]:
    client = docker.DockerClient(base_url=url)
    try:
        found = client.api.containers(
            all=True, filters={"label": [f"corral.deployment={deployment}"]}
        )
        return [c["Names"][0].lstrip("/") for c in found]
    finally:
        client.close()


def dispatch(stack: Stack, message: dict[str, object]) -> str:
    status, body = stack.request("POST", "/v1/dispatch", message)
    assert status == 202, body
    return str(body["id"])


def run_one(docker_stack: DockerStack, url: str, message: dict[str, object]) -> dict[str, Any]:
    """Dispatch ``message``, wait for its end, and check its container was removed."""
    stack = docker_stack.stack
    [view] = stack.wait_final([dispatch(stack, message)], timeout_s=120)
    assert view["queue"] == "provision.docker"
    assert view["sandbox"]["provider_id"] == "docker"
    deadline = time.monotonic() + 30
    while view["sandbox"]["external_id"] in managed_containers(url, docker_stack.deployment):
        assert time.monotonic() < deadline, "the container was not removed"
        time.sleep(0.2)
    return view


def test_a_shell_command_runs_in_a_container_with_no_network(
    docker_stack: DockerStack, docker_sandbox: DockerSandbox
) -> None:
    where, printed = WHERE[docker_stack.runtime]
    message = shell(docker_stack.org, f"echo from-container; id -un; {where}")
    view = run_one(docker_stack, docker_sandbox.url, message)
    assert view["state"] == "succeeded"
    _, logs = docker_stack.stack.request("GET", f"/v1/work-items/{view['id']}/logs")
    stdout = [line["line"] for line in logs["lines"] if line["stream"] == "stdout"]
    # The runner reached the api over the mounted Unix socket: the box has no network.
    assert stdout == ["from-container", "corral", *printed]


def test_a_code_item_returns_its_result(
    docker_stack: DockerStack, docker_sandbox: DockerSandbox
) -> None:
    message = shell(docker_stack.org, "unused")
    message["work"] = {"kind": "code", "code": CODE, "arguments": {"word": "hi", "times": 3}}
    view = run_one(docker_stack, docker_sandbox.url, message)
    assert view["state"] == "succeeded"
    assert view["result"] == {"echo": "hi hi hi"}


def test_a_failing_install_step_fails_the_item(
    docker_stack: DockerStack, docker_sandbox: DockerSandbox
) -> None:
    message = shell(docker_stack.org, "echo never", toolchain={"install_commands": ["exit 7"]})
    view = run_one(docker_stack, docker_sandbox.url, message)
    assert view["state"] == "failed"
    assert view["error"]["code"] == "install_failed"
    assert view["exit_code"] == 7


def test_a_container_killed_from_outside_fails_its_item_with_the_reason(
    docker_stack: DockerStack, docker_sandbox: DockerSandbox
) -> None:
    stack = docker_stack.stack
    item_id = dispatch(stack, shell(docker_stack.org, "echo started; sleep 120"))
    deadline = time.monotonic() + 60
    view = stack.request("GET", f"/v1/work-items/{item_id}")[1]
    while view["state"] != "running" and time.monotonic() < deadline:
        time.sleep(0.2)
        view = stack.request("GET", f"/v1/work-items/{item_id}")[1]
    assert view["state"] == "running"
    client = docker.DockerClient(base_url=docker_sandbox.url)
    try:
        client.containers.get(view["sandbox"]["external_id"]).kill()
    finally:
        client.close()

    [final] = stack.wait_final([item_id], timeout_s=60)
    assert final["state"] == "failed"
    assert final["error"]["code"] == "sandbox_lost"
    # The reason, then the end of the container's own log (its runner had registered).
    reason, _, last_lines = final["error"]["message"].partition("; last lines: ")
    assert (
        reason == "the sandbox ended before the work reported: killed by signal 9 (exit code 137)"
    )
    assert "registered" in last_lines
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and final["sandbox"]["status"] != "failed":
        time.sleep(0.2)
        final = stack.request("GET", f"/v1/work-items/{item_id}")[1]
    assert final["sandbox"]["termination_reason"] == "sandbox_lost"
