"""Dispatch end to end through a docker provider worker: the runner inside the container
reaches the api over the mounted Unix socket, with no network."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass

import docker
import pytest

from tests.acceptance.conftest import shell
from tests.acceptance.stack import Stack
from tests.conftest import DockerSandbox, require_bwrap_path

CODE = "def main(word, times):\n    return {'echo': ' '.join([word] * times)}\n"


@dataclass(frozen=True)
class DockerStack:
    stack: Stack
    deployment: str  # the label value of this stack's containers


@pytest.fixture(scope="module")
def docker_stack(
    postgres_database_url: str, redis_url: str, docker_sandbox: DockerSandbox
) -> Iterator[DockerStack]:
    require_bwrap_path()
    deployment = f"e2e-{uuid.uuid4().hex[:8]}"
    config = {"base_url": docker_sandbox.url, "image": docker_sandbox.image,
              "network": "host", "grace_period_s": 1, "deployment": deployment}  # fmt: skip
    stack = Stack(database_url=postgres_database_url, broker_url=redis_url,
                  provider_config={"docker": config})  # fmt: skip
    try:
        stack.start_only(["api", "scheduler", "worker-docker", "maintenance", "beat"])
        assert (
            stack.request(
                "POST", "/v1/admin/profiles", {"name": "default", "model": "m", "auth_mode": "byok"}
            )[0]
            == 201
        )
        assert stack.request("POST", "/v1/admin/pools",
                             {"org_id": "dock", "name": "containers", "provider_id": "docker",
                              "max_concurrent": 8})[0] == 201  # fmt: skip
        yield DockerStack(stack, deployment)
    finally:
        stack.stop()


def managed_containers(url: str, deployment: str) -> list[str]:
    client = docker.DockerClient(base_url=url)
    try:
        found = client.api.containers(
            all=True, filters={"label": [f"corral.deployment={deployment}"]}
        )
        return [c["Names"][0] for c in found]
    finally:
        client.close()


def dispatch(stack: Stack, message: dict[str, object]) -> str:
    status, body = stack.request("POST", "/v1/dispatch", message)
    assert status == 202, body
    return str(body["id"])


def test_items_run_in_containers_without_network_and_the_containers_are_removed(
    docker_stack: DockerStack, docker_sandbox: DockerSandbox
) -> None:
    stack = docker_stack.stack
    shell_id = dispatch(stack, shell("dock", "echo from-container; id -un; ls /sys/class/net"))
    code = shell("dock", "unused")
    code["work"] = {"kind": "code", "code": CODE, "arguments": {"word": "hi", "times": 3}}
    code_id = dispatch(stack, code)
    failing = shell("dock", "echo never", toolchain={"install_commands": ["exit 7"]})
    failing_id = dispatch(stack, failing)

    views = stack.wait_final([shell_id, code_id, failing_id], timeout_s=120)
    by_id = {view["id"]: view for view in views}
    assert by_id[shell_id]["state"] == "succeeded"
    assert by_id[shell_id]["queue"] == "provision.docker"
    assert by_id[shell_id]["sandbox"]["provider_id"] == "docker"
    _, logs = stack.request("GET", f"/v1/work-items/{shell_id}/logs")
    stdout = [line["line"] for line in logs["lines"] if line["stream"] == "stdout"]
    assert stdout == ["from-container", "corral", "lo"]  # no network but loopback
    assert by_id[code_id]["result"] == {"echo": "hi hi hi"}
    assert by_id[failing_id]["state"] == "failed"
    assert by_id[failing_id]["error"]["code"] == "install_failed"
    assert by_id[failing_id]["exit_code"] == 7

    deadline = time.monotonic() + 30
    left = managed_containers(docker_sandbox.url, docker_stack.deployment)
    while left and time.monotonic() < deadline:
        time.sleep(0.2)
        left = managed_containers(docker_sandbox.url, docker_stack.deployment)
    assert left == []


def test_a_container_killed_from_outside_fails_its_item_with_the_reason(
    docker_stack: DockerStack, docker_sandbox: DockerSandbox
) -> None:
    stack = docker_stack.stack
    item_id = dispatch(stack, shell("dock", "echo started; sleep 120"))
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
    assert final["error"]["message"] == (
        "the sandbox ended before the work reported: killed by signal 9 (exit code 137)"
    )
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and final["sandbox"]["status"] != "failed":
        time.sleep(0.2)
        final = stack.request("GET", f"/v1/work-items/{item_id}")[1]
    assert final["sandbox"]["termination_reason"] == "sandbox_lost"
