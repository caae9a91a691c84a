"""The reaper with the local provider: real processes, found by the provider's own listing."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from corral.providers.base import SandboxState
from corral.providers.local.provider import LocalProvider
from tests.conftest import SpecFactory
from tests.integration.reaping import Reaped, reaped_world


@pytest.fixture
def local(
    fresh_pg_url: str, redis_url: str, tmp_path: Path, require_bwrap: str
) -> Iterator[tuple[Reaped, LocalProvider]]:
    # Every sandbox this deployment makes exits at once with code 3, before any claim.
    provider = LocalProvider(
        {
            "root_dir": str(tmp_path / "sandboxes"),
            "isolation": "required",
            "command": ["sh", "-c", "exit 3"],
            "grace_period_s": 1,
        }
    )
    with reaped_world(fresh_pg_url, redis_url, tmp_path, provider) as world:
        # Where the api's socket would be: its directory is mounted into every sandbox.
        world.rt.settings.resolved_api_socket().parent.mkdir(parents=True, exist_ok=True)
        yield world, provider
        for managed in provider.list_managed():
            provider.terminate(managed.handle)


def test_a_process_started_directly_through_the_provider_is_terminated_as_an_orphan(
    local: tuple[Reaped, LocalProvider], make_spec: SpecFactory
) -> None:
    reaped, provider = local
    stray = provider.provision(make_spec(provider_options={"command": ["sleep", "300"]}))
    [listed] = provider.list_managed()
    assert listed.state is SandboxState.RUNNING
    pid = _supervisor_pid(provider, stray.external_id)

    report = reaped.sweep()

    assert report.orphans == [stray.metadata["sandbox_id"]]
    assert provider.list_managed() == []
    assert not _alive(pid)


def test_a_sandbox_that_exits_before_the_claim_is_requeued_then_fails_out_of_attempts(
    local: tuple[Reaped, LocalProvider],
) -> None:
    reaped, provider = local
    item_id = reaped.dispatch()
    first = reaped.sandbox(item_id)
    _wait_listed_final(provider, first.id)

    report = reaped.sweep()

    assert report.ended == {"sandbox_lost": 1} and report.requeued == [item_id]
    assert reaped.item(item_id).state == "received"
    assert provider.list_managed() == []  # the exited sandbox's directory is removed too
    reaped.route_and_provision(item_id)  # attempt 2 (the last: max_attempts is 2 here)
    _wait_listed_final(provider, reaped.sandbox(item_id).id)

    report = reaped.sweep()

    assert report.failed == [item_id]
    item = reaped.item(item_id)
    assert (item.state, item.error_code) == ("failed", "sandbox_lost")
    assert item.error_message == (
        "the sandbox ended before the work reported: exited with code 3; gave up after 2 attempts"
    )
    assert [c.termination_reason for c in reaped.costs()] == ["sandbox_lost", "sandbox_lost"]


def _wait_listed_final(provider: LocalProvider, sandbox_id: str) -> None:
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        states = {m.sandbox_id: m.state for m in provider.list_managed()}
        state = states.get(sandbox_id)
        if state is not None and state.is_final:
            return
        time.sleep(0.05)
    raise AssertionError(f"{sandbox_id} did not exit")


def _supervisor_pid(provider: LocalProvider, sandbox_id: str) -> int:
    import json

    record = json.loads((provider.root / sandbox_id / "sandbox.json").read_text())
    pid: int = record["supervisor_pid"]
    return pid


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True
