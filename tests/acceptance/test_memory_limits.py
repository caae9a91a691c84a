"""Memory limits that say what happened, through real processes: an item over its
``resources.memory_mb`` in a real bubblewrap sandbox fails ``out_of_memory``, with the
sandbox's own cgroup (where this host lets corral make one) and with RLIMIT_AS (forced by
the local provider's ``resource_limits``); an item within its limit succeeds."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest

from corral.providers.local.limits import detect
from tests.acceptance.conftest import shell
from tests.acceptance.stack import Stack
from tests.conftest import require, require_bwrap_path

# Pages written, not only reserved: a cgroup counts what a process touches, RLIMIT_AS what
# it maps; both are over 128 MB here.
GREEDY_CODE = "def main(mb):\n    block = b'x' * (mb * 1024 * 1024)\n    return len(block)\n"
GREEDY_SHELL = "python3 -c \"block = b'x' * (400 * 1024 * 1024); print(len(block))\""


@pytest.fixture(scope="module", params=["cgroup", "rlimit"])
def limited_stack(
    request: pytest.FixtureRequest, postgres_database_url: str, redis_url: str
) -> Iterator[Stack]:
    require_bwrap_path()
    if request.param == "cgroup":
        require(detect("auto").kind == "cgroup", "a writable cgroup (v2 memory, or v1)")
    running = Stack(database_url=postgres_database_url, broker_url=redis_url)
    local = {
        "root_dir": str(running.sandbox_root),
        "grace_period_s": 1,
        "isolation": "required",
        "resource_limits": request.param,
    }
    running.env["CORRAL_PROVIDER_CONFIG"] = json.dumps({"local": local})
    try:
        running.start()
        running.request(
            "POST", "/v1/admin/profiles", {"name": "default", "model": "m", "auth_mode": "byok"}
        )
        status, _ = running.request(
            "POST",
            "/v1/admin/pools",
            {"org_id": _org(running), "name": "local", "provider_id": "local", "max_concurrent": 8},
        )
        assert status == 201
        yield running
    finally:
        running.stop()


def _org(stack: Stack) -> str:
    return f"org-{stack.key_prefix.split('-')[-1].rstrip(':')}"  # each stack an org of its own


def _finish(stack: Stack, message: dict[str, Any]) -> dict[str, Any]:
    status, body = stack.request("POST", "/v1/dispatch", message)
    assert status == 202, body
    [view] = stack.wait_final([body["id"]])
    return view


def _code(stack: Stack, mb: int, memory_mb: int) -> dict[str, Any]:
    message = shell(_org(stack), "unused", resources={"memory_mb": memory_mb})
    message["work"] = {"kind": "code", "code": GREEDY_CODE, "arguments": {"mb": mb}}
    return message


def test_a_code_item_over_its_memory_limit_fails_out_of_memory(limited_stack: Stack) -> None:
    view = _finish(limited_stack, _code(limited_stack, 400, memory_mb=128))
    assert view["state"] == "failed", view
    assert view["error"]["code"] == "out_of_memory", view["error"]
    assert view["error"]["message"].startswith("work ran out of memory"), view["error"]


def test_a_shell_item_over_its_memory_limit_fails_out_of_memory(limited_stack: Stack) -> None:
    view = _finish(
        limited_stack, shell(_org(limited_stack), GREEDY_SHELL, resources={"memory_mb": 128})
    )
    assert view["state"] == "failed", view
    assert view["error"]["code"] == "out_of_memory", view["error"]


def test_the_same_item_within_its_limit_succeeds(limited_stack: Stack) -> None:
    view = _finish(limited_stack, _code(limited_stack, 16, memory_mb=256))
    assert view["state"] == "succeeded", view
    assert view["result"] == 16 * 1024 * 1024
