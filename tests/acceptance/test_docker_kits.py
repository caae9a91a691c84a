"""Kits end to end in docker sandboxes built offline: ``toolchain.kits: ["node@20"]`` makes
``node --version`` work in a container whose image has no node, from the deployment's tool
cache (this host's node, bundled with its libraries) mounted read-only; without the kit the
same command fails, and a kit the cache does not hold fails ``install_failed`` saying so."""

from __future__ import annotations

import shutil
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.acceptance.conftest import shell, start_provider_stack
from tests.acceptance.stack import Stack
from tests.conftest import DockerSandbox, require, require_bwrap_path
from tests.tool_cache import node_bundle, node_major

ORG = "kits"


@pytest.fixture(scope="module")
def tool_cache() -> Iterator[Path]:
    node = shutil.which("node")
    require(node is not None, "node")
    assert node is not None
    require(node_major(node) == "20", "node 20 on this host (the kit's version)")
    # Under /tmp with open modes: the container's user must be able to read it.
    root = Path(tempfile.mkdtemp(prefix="corral-tools-", dir="/tmp"))
    try:
        node_bundle(root, node)
        yield root
    finally:
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="module")
def kit_stack(
    postgres_database_url: str, redis_url: str, docker_sandbox: DockerSandbox, tool_cache: Path
) -> Iterator[Stack]:
    require_bwrap_path()
    config = {
        "base_url": docker_sandbox.url,
        "image": docker_sandbox.image,
        "network": "host",
        "grace_period_s": 1,
        "deployment": f"kits-{uuid.uuid4().hex[:8]}",
        "tool_cache_dir": str(tool_cache),
    }
    stack = start_provider_stack(postgres_database_url, redis_url, "docker", config, ORG)
    try:
        yield stack
    finally:
        stack.stop()


def _run(stack: Stack, message: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    status, body = stack.request("POST", "/v1/dispatch", message)
    assert status == 202, body
    [view] = stack.wait_final([body["id"]], timeout_s=120)
    assert view["queue"] == "provision.docker"
    _, logs = stack.request("GET", f"/v1/work-items/{view['id']}/logs")
    return view, [line["line"] for line in logs["lines"] if line["stream"] == "stdout"]


def test_the_node_kit_makes_node_work_in_an_image_without_it(kit_stack: Stack) -> None:
    message = shell(ORG, "node --version", toolchain={"kits": ["node@20"]})
    view, stdout = _run(kit_stack, message)
    assert view["state"] == "succeeded", view
    assert len(stdout) == 1 and stdout[0].startswith("v20."), stdout


def test_without_the_kit_the_image_has_no_node(kit_stack: Stack) -> None:
    view, stdout = _run(kit_stack, shell(ORG, "node --version"))
    assert view["state"] == "failed", view
    assert (view["error"]["code"], view["exit_code"]) == ("work_failed", 127)
    assert stdout == []


def test_a_kit_the_sandbox_cannot_have_fails_install_failed_naming_it(kit_stack: Stack) -> None:
    message = shell(ORG, "go version", toolchain={"kits": ["node@20", "go@1.22"]})
    view, _ = _run(kit_stack, message)
    assert view["state"] == "failed", view
    assert view["error"]["code"] == "install_failed"
    _, logs = kit_stack.request("GET", f"/v1/work-items/{view['id']}/logs")
    stderr = [line["line"] for line in logs["lines"] if line["stream"] == "stderr"]
    assert any(
        line.startswith("kit go@1.22 is not satisfied in this sandbox") and "go/1.22/bin" in line
        for line in stderr
    ), stderr
