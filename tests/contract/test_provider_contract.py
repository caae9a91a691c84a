"""The contract every provider passes: lifecycle, early option validation, and each
optional ability it declares, exercised for real."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import pytest

from corral.providers.base import (
    SandboxHandle,
    SandboxProvider,
    SandboxState,
    SupportsCapacityQuery,
    SupportsCodeInterpreter,
    SupportsEndLog,
    SupportsExec,
    SupportsFiles,
    SupportsInventory,
    SupportsLogs,
    SupportsPauseResume,
)
from corral.providers.errors import InvalidProviderConfigError, SandboxPathError
from tests.conftest import SpecFactory
from tests.contract.conftest import READY_LINE, ProviderCase, all_cases, cases_with

Build = Callable[[ProviderCase], SandboxProvider]


def wait_for_state(
    provider: SandboxProvider, handle: SandboxHandle, states: set[SandboxState]
) -> SandboxState:
    deadline = time.monotonic() + 10
    state = provider.status(handle).state
    while state not in states and time.monotonic() < deadline:
        time.sleep(0.02)
        state = provider.status(handle).state
    return state


def start(case: ProviderCase, provider: SandboxProvider, make_spec: SpecFactory) -> SandboxHandle:
    spec = make_spec(provider_options=case.long_running_options)
    handle = provider.provision(spec)
    running = {SandboxState.READY, SandboxState.RUNNING}
    assert wait_for_state(provider, handle, running) in running
    return handle


@pytest.mark.parametrize("case", cases_with())
def test_lifecycle_provision_status_terminate_twice(
    case: ProviderCase, provider_for: Build, make_spec: SpecFactory
) -> None:
    provider = provider_for(case)
    spec = make_spec(provider_options=case.long_running_options)
    handle = provider.provision(spec)

    assert handle.provider_id == provider.id
    assert handle.org_id == spec.org_id
    assert spec.registration_token.get_secret_value() not in handle.model_dump_json()
    running = {SandboxState.READY, SandboxState.RUNNING}
    assert wait_for_state(provider, handle, running) in running

    provider.terminate(handle)
    assert provider.status(handle).state is SandboxState.TERMINATED
    provider.terminate(handle)  # a second terminate is harmless
    assert provider.status(handle).state is SandboxState.TERMINATED


@pytest.mark.parametrize("case", cases_with())
def test_provisioning_the_same_sandbox_twice_makes_one(
    case: ProviderCase, provider_for: Build, make_spec: SpecFactory
) -> None:
    provider = provider_for(case)
    spec = make_spec(provider_options=case.long_running_options)
    first = provider.provision(spec)
    second = provider.provision(spec)
    assert first.external_id == second.external_id
    if isinstance(provider, SupportsInventory):
        owned = [m for m in provider.list_managed() if m.sandbox_id == spec.sandbox_id]
        assert len(owned) == 1


@pytest.mark.parametrize("case", cases_with())
def test_unknown_options_are_rejected_before_anything_is_allocated(
    case: ProviderCase, provider_for: Build, make_spec: SpecFactory
) -> None:
    provider = provider_for(case)
    spec = make_spec(provider_options={**case.long_running_options, "no_such_option": 1})
    with pytest.raises(InvalidProviderConfigError, match="no_such_option") as raised:
        provider.provision(spec)
    assert "Allowed keys" in str(raised.value)
    if isinstance(provider, SupportsInventory):
        assert provider.list_managed() == []
    if isinstance(provider, SupportsCapacityQuery):
        assert provider.capacity().in_use == 0


@pytest.mark.parametrize("case", all_cases())
def test_declared_abilities_match_what_is_implemented(
    case: ProviderCase, provider_for: Build
) -> None:
    provider = provider_for(case)
    capabilities = provider.capabilities
    assert capabilities.supports_pause_resume == isinstance(provider, SupportsPauseResume)
    assert capabilities.supports_capacity_query == isinstance(provider, SupportsCapacityQuery)
    # Interactive sessions need both: commands and files.
    both = isinstance(provider, SupportsExec) and isinstance(provider, SupportsFiles)
    assert capabilities.supports_exec_files == both
    # A code interpreter runs code items alone; every other provider runs both kinds.
    interpreter = isinstance(provider, SupportsCodeInterpreter)
    assert capabilities.work_kinds == (("code",) if interpreter else ("shell", "code"))
    assert provider.health_check().healthy


@pytest.mark.parametrize("case", cases_with(SupportsLogs))
def test_logs_carry_the_sandbox_output(
    case: ProviderCase, provider_for: Build, make_spec: SpecFactory
) -> None:
    provider = provider_for(case)
    handle = start(case, provider, make_spec)
    assert isinstance(provider, SupportsLogs)
    deadline = time.monotonic() + 10
    lines: list[str] = []
    while READY_LINE not in lines and time.monotonic() < deadline:
        lines = list(provider.stream_logs(handle))
        time.sleep(0.02)
    assert READY_LINE in lines


@pytest.mark.parametrize("case", cases_with(SupportsEndLog))
def test_the_end_log_holds_the_last_output_within_its_bounds(
    case: ProviderCase, provider_for: Build, make_spec: SpecFactory
) -> None:
    provider = provider_for(case)
    handle = start(case, provider, make_spec)
    assert isinstance(provider, SupportsEndLog)
    deadline = time.monotonic() + 10
    tail: str | None = None
    while (tail is None or READY_LINE not in tail) and time.monotonic() < deadline:
        tail = provider.end_log(handle, max_lines=40, max_bytes=1024)
        time.sleep(0.02)
    assert tail is not None and READY_LINE in tail.splitlines()
    assert provider.end_log(handle, max_lines=0, max_bytes=1024) in ("", None)
    short = provider.end_log(handle, max_lines=40, max_bytes=5)
    assert short is not None and len(short.encode()) <= 5


@pytest.mark.parametrize("case", cases_with(SupportsExec))
def test_exec_returns_output_and_exit_codes(
    case: ProviderCase, provider_for: Build, make_spec: SpecFactory
) -> None:
    provider = provider_for(case)
    handle = start(case, provider, make_spec)
    assert isinstance(provider, SupportsExec)

    echoed = provider.exec_command(handle, ["echo", "hello", "sandbox"])
    assert (echoed.exit_code, echoed.stdout) == (0, "hello sandbox\n")

    env = provider.exec_command(handle, ["env"], env={"CORRAL_CONTRACT": "yes"})
    assert "CORRAL_CONTRACT=yes" in env.stdout.splitlines()

    failed = provider.exec_command(handle, ["cat", "no-such-file"])
    assert failed.exit_code != 0
    assert "no-such-file" in failed.stderr


@pytest.mark.parametrize("case", cases_with(SupportsFiles))
def test_files_round_trip_and_stay_inside_the_sandbox(
    case: ProviderCase, provider_for: Build, make_spec: SpecFactory, tmp_path: Path
) -> None:
    provider = provider_for(case)
    handle = start(case, provider, make_spec)
    assert isinstance(provider, SupportsFiles)
    source = tmp_path / "in.txt"
    source.write_bytes(b"payload \x00\xff bytes")

    provider.upload_file(handle, source, "inbox/in.txt")
    provider.download_file(handle, "inbox/in.txt", tmp_path / "out.txt")
    assert (tmp_path / "out.txt").read_bytes() == source.read_bytes()
    if isinstance(provider, SupportsExec):
        seen = provider.exec_command(handle, ["cat", "inbox/in.txt"])
        assert seen.stdout.startswith("payload")

    for escape in ("../outside.txt", "/etc/passwd", "inbox/../../x"):
        with pytest.raises(SandboxPathError):
            provider.upload_file(handle, source, escape)
        with pytest.raises(SandboxPathError):
            provider.download_file(handle, escape, tmp_path / "stolen")
    assert not (tmp_path / "stolen").exists()


@pytest.mark.parametrize("case", cases_with(SupportsPauseResume))
def test_pause_and_resume(case: ProviderCase, provider_for: Build, make_spec: SpecFactory) -> None:
    provider = provider_for(case)
    handle = start(case, provider, make_spec)
    assert isinstance(provider, SupportsPauseResume)
    provider.pause(handle)
    assert provider.status(handle).state is SandboxState.READY
    provider.resume(handle)
    assert provider.status(handle).state is SandboxState.RUNNING


@pytest.mark.parametrize("case", cases_with(SupportsInventory))
def test_inventory_lists_owned_sandboxes_by_label(
    case: ProviderCase, provider_for: Build, make_spec: SpecFactory
) -> None:
    provider = provider_for(case)
    handle = start(case, provider, make_spec)
    assert isinstance(provider, SupportsInventory)
    [managed] = provider.list_managed()
    assert managed.handle.external_id == handle.external_id
    assert managed.labels["corral.managed"] == "true"
    assert managed.labels["corral.sandbox-id"] == managed.sandbox_id
    assert managed.labels["corral.org-id"] == "acme"
    provider.terminate(handle)
    assert provider.list_managed() == []


@pytest.mark.parametrize("case", cases_with(SupportsCapacityQuery))
def test_capacity_counts_live_sandboxes(
    case: ProviderCase, provider_for: Build, make_spec: SpecFactory
) -> None:
    provider = provider_for(case)
    assert isinstance(provider, SupportsCapacityQuery)
    before = provider.capacity().in_use
    handle = start(case, provider, make_spec)
    assert provider.capacity().in_use == before + 1
    provider.terminate(handle)
    assert provider.capacity().in_use == before


@pytest.mark.parametrize(
    "case", [c for c in cases_with(SupportsInventory) if c.values[0].exiting_options]
)
def test_the_inventory_lists_a_live_sandbox_and_one_that_ended_with_their_states(
    case: ProviderCase, provider_for: Build, make_spec: SpecFactory
) -> None:
    provider = provider_for(case)
    assert isinstance(provider, SupportsInventory)
    live = start(case, provider, make_spec)
    exiting = provider.provision(make_spec(provider_options=case.exiting_options))
    final = {SandboxState.TERMINATED, SandboxState.FAILED}
    assert wait_for_state(provider, exiting, final) is SandboxState.FAILED  # exit code 3

    listed = {m.handle.external_id: m.state for m in provider.list_managed()}

    # The reaper trusts a final state in a listing (and checks it with status()); a live
    # sandbox must never be listed as ended.
    assert listed[live.external_id] in (None, SandboxState.READY, SandboxState.RUNNING)
    assert listed[exiting.external_id] in (None, *final)
    provider.terminate(exiting)
    assert exiting.external_id not in {m.handle.external_id for m in provider.list_managed()}


# -- code interpreters ----------------------------------------------------------------------

SUM = (
    "import sys\n"
    "def main(a, b):\n"
    "    print('adding')\n"
    "    print('warn', file=sys.stderr)\n"
    "    return a + b\n"
)


@pytest.mark.parametrize("case", cases_with(SupportsCodeInterpreter))
def test_run_code_calls_main_and_ends_its_sandbox(
    case: ProviderCase, provider_for: Build, make_spec: SpecFactory
) -> None:
    provider = provider_for(case)
    assert isinstance(provider, SupportsCodeInterpreter)
    spec = make_spec(env={"WORK_VAR": "set"})
    handles: list[SandboxHandle] = []
    run = provider.run_code(spec, SUM, {"a": 20, "b": 22}, timeout_s=10, on_execute=handles.append)
    assert (run.exit_code, run.result, run.error, run.timed_out) == (0, 42, None, False)
    assert run.stdout == "adding\n" and "warn" in run.stderr
    [handle] = handles  # called once, just before the execute call
    assert handle.provider_id == provider.id and handle.org_id == spec.org_id
    assert spec.registration_token.get_secret_value() not in handle.model_dump_json()
    assert provider.status(handle).state is SandboxState.TERMINATED  # ended afterwards


@pytest.mark.parametrize("case", cases_with(SupportsCodeInterpreter))
def test_run_code_gives_the_work_env_and_never_the_token(
    case: ProviderCase, provider_for: Build, make_spec: SpecFactory
) -> None:
    provider = provider_for(case)
    assert isinstance(provider, SupportsCodeInterpreter)
    source = (
        "import os\ndef main():\n"
        "    return [os.environ.get(k) for k in ('WORK_VAR', 'CORRAL_REGISTRATION_TOKEN')]\n"
    )
    run = provider.run_code(make_spec(env={"WORK_VAR": "set"}), source, {}, timeout_s=10)
    assert run.result == ["set", None]


@pytest.mark.parametrize("case", cases_with(SupportsCodeInterpreter))
def test_run_code_reports_a_failing_main_and_a_timeout(
    case: ProviderCase, provider_for: Build, make_spec: SpecFactory
) -> None:
    provider = provider_for(case)
    assert isinstance(provider, SupportsCodeInterpreter)
    failed = provider.run_code(
        make_spec(), "def main():\n    raise OSError('disk')\n", {}, timeout_s=10
    )
    assert failed.exit_code != 0 and failed.error == "main() raised OSError: disk"
    slow = "import time\ndef main():\n    time.sleep(20)\n"
    late = provider.run_code(make_spec(), slow, {}, timeout_s=1)
    assert late.timed_out and late.exit_code == 124


@pytest.mark.parametrize("case", cases_with(SupportsCodeInterpreter))
def test_run_code_executes_nothing_when_on_execute_refuses(
    case: ProviderCase, provider_for: Build, make_spec: SpecFactory
) -> None:
    provider = provider_for(case)
    assert isinstance(provider, SupportsCodeInterpreter)
    seen: list[SandboxHandle] = []

    def refuse(handle: SandboxHandle) -> None:
        seen.append(handle)
        raise LookupError("the attempt is no longer ours")

    with pytest.raises(LookupError):
        provider.run_code(make_spec(), SUM, {"a": 1, "b": 1}, timeout_s=5, on_execute=refuse)
    assert provider.status(seen[0]).state is SandboxState.TERMINATED


@pytest.mark.parametrize("case", cases_with(SupportsCodeInterpreter))
def test_run_code_rejects_unknown_options_before_anything_is_made(
    case: ProviderCase, provider_for: Build, make_spec: SpecFactory
) -> None:
    provider = provider_for(case)
    assert isinstance(provider, SupportsCodeInterpreter)
    with pytest.raises(InvalidProviderConfigError, match="no_such_option"):
        provider.run_code(make_spec(provider_options={"no_such_option": 1}), SUM, {}, timeout_s=5)
