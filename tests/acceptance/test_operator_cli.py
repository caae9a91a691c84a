"""The operator's commands against real processes on Redis and PostgreSQL: `corral status`
and `corral dispatch --wait` when nothing runs, and when the stack does."""

from __future__ import annotations

import subprocess
import uuid
from collections.abc import Iterator

import pytest

from tests.acceptance.stack import CORRAL, Stack


def corral(stack: Stack, *args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*CORRAL, *args],
        env=stack.env,
        cwd=stack.state_dir,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


@pytest.fixture
def idle_stack(postgres_database_url: str, redis_url: str) -> Iterator[Stack]:
    """The environment of a stack none of whose processes runs."""
    idle = Stack(database_url=postgres_database_url, broker_url=redis_url)
    try:
        yield idle
    finally:
        idle.stop()


def test_with_nothing_running_status_says_none_answered_and_dispatch_says_what_to_start(
    idle_stack: Stack,
) -> None:
    org = f"idle-{uuid.uuid4().hex[:8]}"
    for command in (
        ["profiles", "create", "--name", "default", "--model", "m", "--auth-mode", "byok"],
        ["pools", "create", "--org", org, "--name", "local", "--provider", "local"],
    ):
        assert corral(idle_stack, *command).returncode == 0
    waited = corral(
        idle_stack,
        "dispatch",
        "--org",
        org,
        "--project",
        "web",
        "--wait",
        "--timeout",
        "2",
        "--",
        "echo",
        "hi",
    )
    assert waited.returncode == 124  # the wait ended first: the message waits for a scheduler
    assert "sending through the broker" in waited.stderr  # no api answers on this stack
    assert "no scheduler answered (Celery inspect, 1 s)" in waited.stderr
    assert "start `corral scheduler`" in waited.stderr
    assert "no scheduler has written it yet" in waited.stderr
    status = corral(idle_stack, "status")
    assert status.returncode == 0, status.stderr
    assert "none answered: start `corral scheduler`" in status.stdout
    assert "does not answer (from CORRAL_API_HOST/PORT)" in status.stdout
    dispatch_line = next(line for line in status.stdout.splitlines() if "dispatch" in line)
    assert dispatch_line.split() == ["dispatch", "1"]  # the message waits for a scheduler


def test_on_a_running_stack_status_lists_the_processes_and_wait_prints_the_output(
    stack: Stack,
) -> None:
    org = stack.make_org(f"ops-{uuid.uuid4().hex[:8]}")
    waited = corral(
        stack,
        "dispatch",
        "--org",
        org,
        "--project",
        "web",
        "--wait",
        "--",
        "echo",
        "hello from the stack",
    )
    assert waited.returncode == 0, waited.stderr
    item_id, output = waited.stdout.splitlines()
    assert output == "hello from the stack"
    assert "no scheduler answered" not in waited.stderr
    assert "] routed to pool local on queue provision.local" in waited.stderr
    assert "] succeeded exit 0" in waited.stderr
    status = corral(stack, "status")
    assert status.returncode == 0, status.stderr
    nodes = [line.split()[0] for line in status.stdout.splitlines() if "@" in line]
    assert any(node.startswith("scheduler@") for node in nodes), status.stdout
    assert any(node.startswith("worker-local@") for node in nodes), status.stdout
    assert f"{stack.api_url} answers" in status.stdout
    logs = corral(stack, "logs", item_id, "-f")
    assert logs.stdout.splitlines() == ["hello from the stack"]
