"""The daytona provider through the official SDK against the Daytona stand-in on loopback: what a
sandbox is made with, where the token goes, which credential is used, how API errors are
classified, how statuses read, and what the inventory lists (the contract suite covers the
lifecycle, exec, files and logs)."""

from __future__ import annotations

import contextlib
import gc
import json
import os
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
from daytona import CreateSandboxFromSnapshotParams, Daytona, DaytonaConfig

from corral.providers.base import SandboxHandle, SandboxState
from corral.providers.credentials import CredentialResolver, InMemoryCredentialStore
from corral.providers.daytona.provider import DaytonaProvider
from corral.providers.errors import (
    CredentialMissingError,
    CredentialRejectedError,
    FileTooLargeError,
    InvalidProviderConfigError,
    ProviderTimeoutError,
    ProviderUnavailableError,
    RateLimitedError,
    SandboxCreateError,
    SandboxNotRunningError,
    SandboxPathError,
)
from tests import floods
from tests.conftest import SpecFactory
from tests.standins.daytona import DaytonaStandin

SECRET_KEY = "a-secret-key-for-the-tests-only-Q7x2M9p4"
SLEEPER = ["sh", "-c", "exec sleep 300"]


_built: list[DaytonaProvider] = []


@pytest.fixture
def standin(daytona_standin: DaytonaStandin) -> Iterator[DaytonaStandin]:
    yield daytona_standin
    daytona_standin.clear_faults()
    while _built:  # their SDK clients' sockets closed now, not by a later garbage collection
        _built.pop().close()


def build(
    standin: DaytonaStandin,
    *,
    environ: dict[str, str] | None = None,
    store: InMemoryCredentialStore | None = None,
    **config: Any,
) -> DaytonaProvider:
    provider = DaytonaProvider(
        {
            "api_url": standin.api_url,
            "request_timeout_s": 5,
            "deployment": f"it-{uuid.uuid4().hex[:8]}",
            "command": SLEEPER,
            **config,
        }
    )
    keys = {"CORRAL_DAYTONA_API_KEY": standin.api_key} if environ is None else environ
    provider.use_credentials(CredentialResolver(store, secret_key=SECRET_KEY, environ=keys))
    _built.append(provider)
    return provider


def by_sandbox_id(spec_sandbox_id: str, org_id: str = "acme") -> SandboxHandle:
    """The handle corral's cleanup terminates after a failed provision: the sandbox id."""
    metadata = {"org_id": org_id, "sandbox_id": spec_sandbox_id}
    return SandboxHandle(provider_id="daytona", external_id=spec_sandbox_id, metadata=metadata)


def test_a_sandbox_is_made_from_the_snapshot_with_token_labels_and_intervals_and_the_runner_runs(
    standin: DaytonaStandin, make_spec: SpecFactory
) -> None:
    provider = build(standin, snapshot="corral-runner", command=["python3", "-m", "runner"])
    spec = make_spec(resources={"timeout_s": 1190}, env={"CI": "true"}, pool_id="pool-1")

    handle = provider.provision(spec)

    made = standin.sandbox(handle.external_id)
    token = spec.registration_token.get_secret_value()
    assert (made.name, made.snapshot, made.dockerfile) == (spec.sandbox_id, "corral-runner", None)
    assert made.env["CORRAL_REGISTRATION_TOKEN"] == token
    assert made.env["CORRAL_CONTROL_URL"] == spec.control_url
    assert made.env["CORRAL_SANDBOX_ID"] == spec.sandbox_id
    assert made.env["CI"] == "true"
    assert {k: v for k, v in made.labels.items() if k.startswith("corral.")} == {
        "corral.managed": "true",
        "corral.sandbox-id": spec.sandbox_id,
        "corral.org-id": "acme",
        "corral.work-item-id": spec.work_item_id,
        "corral.pool-id": "pool-1",
        "corral.deployment": provider.config.deployment,
    }
    # Auto-stop after the work's timeout (in whole minutes, rounded up), deleted once stopped.
    assert (made.auto_stop_interval, made.auto_delete_interval) == (20, 0)
    assert made.public is False
    # The runner is the one command of its session, started detached.
    [(line, _)] = standin.sessions(made.id)["corral-runner"]
    assert line == "python3 -m runner"
    # The token went in the create body's env and nowhere else: not in a label, a command
    # line, a URL or a header.
    carriers = [
        (r.method, r.path)
        for r in standin.requests()
        if token in f"{r.path} {r.query} {r.headers} {r.body!r}"
    ]
    assert carriers == [("POST", "/api/sandbox")]
    assert token not in str(made.labels) + line
    provider.terminate(handle)


def test_an_image_sandbox_gets_the_specs_resources_rounded_up_and_options_choose_the_source(
    standin: DaytonaStandin, make_spec: SpecFactory
) -> None:
    provider = build(standin, disk_gb=8)
    spec = make_spec(
        resources={"cpu": 1.5, "memory_mb": 3000},
        provider_options={"image": "python:3.12-slim"},
    )
    handle = provider.provision(spec)
    made = standin.sandbox(handle.external_id)
    assert made.dockerfile == "FROM python:3.12-slim\n"
    assert (made.cpu, made.memory, made.disk) == (2, 3, 8)
    assert made.snapshot is None

    other = provider.provision(make_spec(provider_options={"snapshot": "bigger"}))
    assert standin.sandbox(other.external_id).snapshot == "bigger"
    assert standin.sandbox(other.external_id).create_body.get("cpu") is None  # the snapshot's

    before = len(standin.requests(method="POST", path="/api/sandbox"))
    with pytest.raises(InvalidProviderConfigError, match="not both"):
        provider.provision(make_spec(provider_options={"snapshot": "a", "image": "b"}))
    assert len(standin.requests(method="POST", path="/api/sandbox")) == before
    for made_handle in (handle, other):
        provider.terminate(made_handle)


def test_a_second_provision_finds_the_first_and_a_stranger_by_that_name_is_refused(
    standin: DaytonaStandin, make_spec: SpecFactory
) -> None:
    provider = build(standin)
    spec = make_spec()
    first, second = provider.provision(spec), provider.provision(spec)
    assert first.external_id == second.external_id
    assert [m.sandbox_id for m in provider.list_managed()] == [spec.sandbox_id]
    provider.terminate(first)

    stranger = make_spec()
    sdk = _sdk(standin)
    made = sdk.create(CreateSandboxFromSnapshotParams(name=stranger.sandbox_id), timeout=10)
    with pytest.raises(SandboxCreateError, match="did not make"):
        provider.provision(stranger)
    sdk.delete(made)


def _sdk(standin: DaytonaStandin) -> Daytona:
    return Daytona(DaytonaConfig(**standin.sdk_config()))


def test_status_follows_the_runner_and_the_sandbox(
    standin: DaytonaStandin, make_spec: SpecFactory
) -> None:
    provider = build(standin)
    ok = provider.provision(make_spec(provider_options={"command": ["true"]}))
    failing = provider.provision(make_spec(provider_options={"command": ["sh", "-c", "exit 3"]}))
    running = provider.provision(make_spec())

    assert _final(provider, ok) == (SandboxState.TERMINATED, "exited", 0)
    assert _final(provider, failing) == (SandboxState.FAILED, "exited with code 3", 3)
    assert provider.status(running).state is SandboxState.RUNNING

    standin.break_sandbox(running.external_id, "the runner host is gone")
    status = provider.status(running)
    assert (status.state, status.reason) == (
        SandboxState.FAILED,
        "sandbox error: the runner host is gone",
    )
    with pytest.raises(SandboxNotRunningError, match="not running"):
        provider.exec_command(running, ["true"])
    for handle in (ok, failing, running):
        provider.terminate(handle)
        assert provider.status(handle).state is SandboxState.TERMINATED


def _final(provider: DaytonaProvider, handle: SandboxHandle) -> tuple[Any, Any, Any]:
    deadline = time.monotonic() + 10
    status = provider.status(handle)
    while not status.state.is_final and time.monotonic() < deadline:
        time.sleep(0.05)
        status = provider.status(handle)
    return status.state, status.reason, status.exit_code


def test_followed_logs_are_the_runners_output_until_it_ends(
    standin: DaytonaStandin, make_spec: SpecFactory
) -> None:
    provider = build(standin)
    script = "echo one; sleep 0.6; echo two >&2; sleep 0.6; printf three"
    handle = provider.provision(make_spec(provider_options={"command": ["sh", "-c", script]}))
    assert list(provider.stream_logs(handle, follow=True)) == ["one", "two", "three"]
    provider.terminate(handle)
    assert list(provider.stream_logs(handle, follow=True)) == []  # gone: nothing, at once


def test_auto_stop_ends_a_sandbox_after_the_works_timeout(
    standin: DaytonaStandin, make_spec: SpecFactory
) -> None:
    deleted = build(standin)  # auto-delete at once, the default
    kept = build(standin, auto_delete_minutes=-1)
    gone = deleted.provision(make_spec(resources={"timeout_s": 600}))
    stopped = kept.provision(make_spec(resources={"timeout_s": 600}))
    standin.advance(9 * 60)
    # (not status(): a toolbox call is an event, which puts the auto-stop off, as at Daytona)
    assert standin.sandbox(gone.external_id).state == "started"

    standin.advance(61)  # ten minutes without an event
    status = deleted.status(gone)
    assert (status.state, status.reason) == (SandboxState.TERMINATED, "sandbox no longer exists")
    status = kept.status(stopped)
    assert (status.state, status.reason) == (SandboxState.TERMINATED, "sandbox stopped")
    assert [m.state for m in kept.list_managed()] == [SandboxState.TERMINATED]
    kept.terminate(stopped)
    assert kept.list_managed() == []


def test_a_sandbox_stopped_and_started_again_at_daytona_has_lost_its_runner(
    standin: DaytonaStandin, make_spec: SpecFactory
) -> None:
    provider = build(standin, auto_delete_minutes=-1)
    handle = provider.provision(make_spec())
    sdk = _sdk(standin)
    sandbox = sdk.get(handle.external_id)
    sdk.stop(sandbox)  # by hand, in Daytona's dashboard say: its processes end
    status = provider.status(handle)
    assert (status.state, status.reason) == (SandboxState.TERMINATED, "sandbox stopped")
    with pytest.raises(SandboxNotRunningError, match="stopped"):
        provider.exec_command(handle, ["true"])

    sdk.start(sandbox)
    status = provider.status(handle)  # started, but nothing restarts corral's runner
    assert (status.state, status.reason) == (SandboxState.READY, "the runner has not started")
    provider.terminate(handle)


def test_terminate_finds_a_sandbox_by_its_name_and_a_gone_one_is_done(
    standin: DaytonaStandin, make_spec: SpecFactory
) -> None:
    provider = build(standin)
    spec = make_spec()
    handle = provider.provision(spec)
    provider.terminate(by_sandbox_id(spec.sandbox_id))  # corral's cleanup path
    assert handle.external_id in standin.destroyed()
    provider.terminate(handle)  # gone: done, nothing sent but the look-up
    assert not standin.requests(method="DELETE", path=f"/api/sandbox/{handle.external_id}")[1:]

    raced = provider.provision(make_spec())
    standin.fail_next(404, method="DELETE", path="/api/sandbox/")  # deleted meanwhile
    provider.terminate(raced)
    standin.clear_faults()
    provider.terminate(raced)
    assert provider.status(raced).state is SandboxState.TERMINATED


def test_the_inventory_lists_this_deployments_sandboxes_by_label(
    standin: DaytonaStandin, make_spec: SpecFactory
) -> None:
    mine, theirs = build(standin), build(standin)
    kept = mine.provision(make_spec())
    ended = mine.provision(make_spec())
    other = theirs.provision(make_spec())
    mine.terminate(ended)
    sdk = _sdk(standin)
    unlabelled = sdk.create(CreateSandboxFromSnapshotParams(labels={"corral.managed": "true"}))

    [listed] = mine.list_managed()
    assert listed.handle.external_id == kept.external_id
    assert listed.handle.org_id == "acme"
    assert listed.labels["corral.deployment"] == mine.config.deployment
    assert listed.state is None  # started: only status() tells whether its runner ended
    assert listed.started_at is not None
    [query] = standin.requests(method="GET", path="/api/sandbox")[-1:]
    assert json.loads(query.query["labels"][0]) == {
        "corral.managed": "true",
        "corral.deployment": mine.config.deployment,
    }
    for provider, handle in ((mine, kept), (theirs, other)):
        provider.terminate(handle)
    sdk.delete(unlabelled)


def test_the_orgs_stored_credential_wins_over_the_environment(
    standin: DaytonaStandin, make_spec: SpecFactory
) -> None:
    store = InMemoryCredentialStore()
    provider = build(standin, environ={"CORRAL_DAYTONA_API_KEY": "dtn_wrong"}, store=store)
    assert provider.credentials is not None
    provider.credentials.put("acme", "daytona", standin.api_key)
    handle = provider.provision(make_spec())
    assert handle.external_id in standin.sandboxes()
    with pytest.raises(CredentialRejectedError, match="fix CORRAL_DAYTONA_API_KEY"):
        provider.list_managed()  # no org: the deployment-wide key, which is wrong here
    assert not provider.health_check().healthy
    provider.terminate(handle)


def test_a_missing_credential_names_both_ways_to_set_one(
    standin: DaytonaStandin, make_spec: SpecFactory
) -> None:
    provider = build(standin, environ={})
    with pytest.raises(CredentialMissingError) as raised:
        provider.provision(make_spec())
    assert "corral credentials set --org acme --provider daytona" in raised.value.message
    assert "CORRAL_DAYTONA_API_KEY" in raised.value.message
    with pytest.raises(CredentialMissingError, match="maintenance worker"):
        provider.list_managed()
    health = provider.health_check()
    assert not health.healthy and health.message.startswith("no credential:")
    for_org = provider.health_check(org_id="acme")
    assert not for_org.healthy and "corral credentials set --org acme" in for_org.message


@pytest.mark.parametrize("status", [401, 403])
def test_authorization_failures_are_permanent_and_name_the_credential(
    standin: DaytonaStandin, make_spec: SpecFactory, status: int
) -> None:
    provider = build(standin)
    standin.fail_next(status, times=None, method="POST", path="/api/sandbox")
    with pytest.raises(CredentialRejectedError) as raised:
        provider.provision(make_spec(org_id="globex"))
    assert not raised.value.retryable
    assert f"({status})" in raised.value.message
    assert "corral credentials set --org globex --provider daytona" in raised.value.message
    assert standin.api_key not in raised.value.message


def test_a_wrong_key_is_rejected_by_the_api_itself(
    standin: DaytonaStandin, make_spec: SpecFactory
) -> None:
    provider = build(standin, environ={"CORRAL_DAYTONA_API_KEY": "dtn_not-the-key"})
    with pytest.raises(CredentialRejectedError, match=r"\(401\)"):
        provider.provision(make_spec())


@pytest.mark.parametrize("status", [429, 500, 502, 503])
def test_rate_limits_and_server_errors_are_transient(
    standin: DaytonaStandin, make_spec: SpecFactory, status: int
) -> None:
    provider = build(standin)
    standin.fail_next(status, times=3, method="POST", path="/api/sandbox")
    expected = RateLimitedError if status == 429 else ProviderUnavailableError
    with pytest.raises(expected) as raised:
        provider.provision(make_spec())
    assert raised.value.retryable
    assert f"({status})" in raised.value.message or "rate-limiting" in raised.value.message
    standin.clear_faults()
    handle = provider.provision(make_spec())  # and it works once Daytona recovers
    provider.terminate(handle)


def test_a_hung_api_is_a_transient_timeout_and_cleanup_finds_what_it_made(
    standin: DaytonaStandin, make_spec: SpecFactory
) -> None:
    provider = build(standin, create_timeout_s=1, request_timeout_s=1)
    spec = make_spec()
    standin.delay_next(2.5, method="POST", path="/api/sandbox")
    with pytest.raises(ProviderTimeoutError) as raised:
        provider.provision(spec)
    assert raised.value.retryable
    # Its traceback holds this frame, which would hold it in a cycle, and with it the socket
    # of the response the SDK's timeout left open, to some later test's garbage collection.
    del raised
    # Daytona made it all the same once the request went through; corral's cleanup
    # terminates the sandbox id, which finds it by name.
    deadline = time.monotonic() + 5
    while spec.sandbox_id not in {s.name for s in standin.sandboxes().values()}:
        assert time.monotonic() < deadline, "the delayed create never went through"
        time.sleep(0.05)
    provider.terminate(by_sandbox_id(spec.sandbox_id))
    assert spec.sandbox_id not in {s.name for s in standin.sandboxes().values()}

    handle = provider.provision(make_spec())
    # (the SDK's HTTP client tries a GET that timed out three more times)
    standin.delay_next(2.5, times=None, method="GET", path=f"/api/sandbox/{handle.external_id}")
    with pytest.raises(ProviderTimeoutError):
        provider.status(handle)
    standin.clear_faults()
    provider.terminate(handle)


def test_a_timed_out_create_leaves_no_connection_open(make_spec: SpecFactory) -> None:
    # The SDK times a create out by raising in the calling thread, which can cut short the
    # closing of the HTTP response it waits for; that socket must go with the error, not wait
    # for a garbage collection (a worker would hold one per timed-out create until then).
    with DaytonaStandin() as own, _without_the_collector():
        provider = build(own, create_timeout_s=1, request_timeout_s=1)
        own.delay_next(2.5, method="POST", path="/api/sandbox")
        with pytest.raises(ProviderTimeoutError):
            provider.provision(make_spec())
        provider.close()  # the connections its pools keep for reuse
        assert _sockets_to(urlsplit(own.api_url).port) == 0


@contextlib.contextmanager
def _without_the_collector() -> Iterator[None]:
    """What is freed inside is freed by its last reference going, not by a collection."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _sockets_to(port: int | None) -> int:
    """This process's TCP sockets to 127.0.0.1:``port``, whatever their state."""
    mine = set()  # the inodes of its sockets
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):  # an fd closed since the listing
            target = os.readlink(f"/proc/self/fd/{fd}")
            if target.startswith("socket:["):
                mine.add(target.removeprefix("socket:[").rstrip("]"))
    count = 0
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            _, _, remote, _, _, _, _, _, _, inode, *_ = line.split()
            count += int(remote.rsplit(":", 1)[1], 16) == port and inode in mine
    return count


def test_a_conflicting_name_while_the_last_one_is_destroyed_is_transient(
    make_spec: SpecFactory,
) -> None:
    with DaytonaStandin(destroy_delay_s=30) as slow:
        provider = build(slow)
        spec = make_spec()
        provider.terminate(provider.provision(spec))  # destroying for 30 s: the name is taken
        with pytest.raises(ProviderUnavailableError, match="409"):
            provider.provision(spec)


def test_an_unknown_snapshot_is_a_permanent_create_error_naming_it(
    make_spec: SpecFactory,
) -> None:
    with DaytonaStandin(snapshots=["corral-runner"]) as strict:
        provider = build(strict, snapshot="no-such-snapshot")
        with pytest.raises(SandboxCreateError, match="no-such-snapshot") as raised:
            provider.provision(make_spec())
        assert not raised.value.retryable
        assert strict.sandboxes() == {}


def test_a_sandbox_whose_start_fails_is_a_permanent_error_and_cleanup_deletes_it(
    standin: DaytonaStandin, make_spec: SpecFactory
) -> None:
    provider = build(standin)
    spec = make_spec()
    standin.fail_next_start("no runner has room for it")
    with pytest.raises(SandboxCreateError, match="no runner has room for it") as raised:
        provider.provision(spec)
    assert not raised.value.retryable
    [left] = [s for s in standin.sandboxes().values() if s.name == spec.sandbox_id]
    assert left.state == "error"
    status = provider.status(by_sandbox_id(spec.sandbox_id))
    assert status.state is SandboxState.FAILED
    provider.terminate(by_sandbox_id(spec.sandbox_id))  # corral's cleanup after the failure
    assert left.id in standin.destroyed()


def test_a_runner_that_cannot_start_leaves_no_sandbox(
    standin: DaytonaStandin, make_spec: SpecFactory
) -> None:
    provider = build(standin)
    standin.fail_next(500, times=None, method="POST", path="/toolbox/")
    with pytest.raises(ProviderUnavailableError, match="starting the runner"):
        provider.provision(make_spec())
    standin.clear_faults()
    assert provider.list_managed() == []


def test_exec_past_its_timeout_is_killed_and_a_transient_timeout(
    standin: DaytonaStandin, make_spec: SpecFactory
) -> None:
    provider = build(standin)
    handle = provider.provision(make_spec())
    started = time.monotonic()
    with pytest.raises(ProviderTimeoutError, match=r"timeout of 0\.5 s"):
        provider.exec_command(handle, "sleep 30", timeout_s=0.5)
    assert time.monotonic() - started < 10
    provider.exec_command(handle, ["mkdir", "-p", "sub"])
    where = provider.exec_command(
        handle, 'pwd; echo "$GREETING"', cwd="sub", env={"GREETING": "hi"}
    )
    assert where.stdout.endswith("/home/daytona/sub\nhi\n"), where
    sessions = standin.sessions(handle.external_id)
    assert list(sessions) == ["corral-runner"]  # the exec's own session was deleted
    provider.terminate(handle)


FLOOD = 16 * 1024 * 1024  # what a command prints, or a file holds, far past the limit
LIMIT = floods.LIMIT


def test_exec_follows_the_logs_and_keeps_no_more_than_the_limit_of_a_flood(
    standin: DaytonaStandin, make_spec: SpecFactory
) -> None:
    provider = build(standin)
    handle = provider.provision(make_spec())
    flood = floods.flood(FLOOD)
    result = provider.exec_command(handle, flood, timeout_s=60, max_output_bytes=LIMIT)
    assert (result.stdout, result.stderr) == ("x" * LIMIT, "e" * LIMIT)
    assert result.truncated and result.exit_code == 3
    # Started detached (its logs followed as they came), not run to its end in one call.
    [started] = [
        r.body
        for r in standin.requests(method="POST")
        if r.path.endswith("/exec") and "head -c" in str(r.body)
    ]
    assert started["runAsync"] is True
    quiet = provider.exec_command(handle, ["echo", "quiet"], max_output_bytes=LIMIT)
    assert (quiet.stdout, quiet.truncated) == ("quiet\n", False)
    provider.terminate(handle)


def test_logs_held_open_past_the_timeout_are_given_up(
    standin: DaytonaStandin, make_spec: SpecFactory
) -> None:
    """The command ends at its timeout, but a process it left in a session of its own holds
    its output open: the follow is given up at the timeout and a grace, not held for as long
    as that process lives."""
    provider = build(standin, request_timeout_s=1)
    handle = provider.provision(make_spec())
    started = time.monotonic()
    with pytest.raises(ProviderTimeoutError, match=r"logs outlived its 0\.5 s"):
        provider.exec_command(handle, "setsid sleep 4 & echo started", timeout_s=0.5)
    assert time.monotonic() - started < 3.5
    assert list(standin.sessions(handle.external_id)) == ["corral-runner"]  # deleted
    provider.terminate(handle)


def test_a_download_over_the_limit_is_refused_by_its_size_or_stopped_past_it(
    standin: DaytonaStandin, make_spec: SpecFactory, tmp_path: Path
) -> None:
    provider = build(standin)
    handle = provider.provision(make_spec())
    made = provider.exec_command(handle, floods.big_and_fitting_files(FLOOD))
    assert made.exit_code == 0, made
    target = tmp_path / "download" / "file"
    standin.clear_requests()
    with pytest.raises(FileTooLargeError):
        provider.download_file(handle, "big.bin", target, max_bytes=LIMIT)
    assert not target.exists()  # refused by the size files/info told
    assert not standin.requests(path=f"/toolbox/{handle.external_id}/files/bulk-download")
    standin.state_file_sizes_as(1)  # a size that lies: the copy itself stops
    try:
        with pytest.raises(FileTooLargeError):
            provider.download_file(handle, "big.bin", target, max_bytes=LIMIT)
    finally:
        standin.state_file_sizes_as(None)
    assert target.stat().st_size == LIMIT + 1
    provider.download_file(handle, "fits.bin", target, max_bytes=LIMIT)
    assert target.read_bytes() == b"\0" * LIMIT
    with pytest.raises(SandboxPathError, match="does not exist"):
        provider.download_file(handle, "no-such-file", target, max_bytes=LIMIT)
    provider.terminate(handle)


def test_without_network_only_the_control_plane_is_reachable(
    standin: DaytonaStandin, make_spec: SpecFactory
) -> None:
    provider = build(standin)
    by_address = provider.provision(
        make_spec(egress={"allow_network": False}, control_url="http://127.0.0.1:8300")
    )
    by_name = provider.provision(
        make_spec(egress={"allow_network": False}, control_url="https://corral.example.test")
    )
    opened = provider.provision(make_spec(egress={"allow_network": True}))

    assert standin.sandbox(by_address.external_id).network_allow_list == "127.0.0.1/32"
    assert standin.sandbox(by_name.external_id).domain_allow_list == "corral.example.test"
    open_body = standin.sandbox(opened.external_id).create_body
    assert "networkAllowList" not in open_body and "domainAllowList" not in open_body
    with pytest.raises(InvalidProviderConfigError, match="CORRAL_CONTROL_URL"):
        provider.provision(
            make_spec(egress={"allow_network": False}, control_url="unix:///run/corral/api.sock")
        )
    for handle in (by_address, by_name, opened):
        provider.terminate(handle)


def test_the_key_is_never_logged(
    standin: DaytonaStandin, make_spec: SpecFactory, caplog: pytest.LogCaptureFixture
) -> None:
    provider = build(standin)
    spec = make_spec()
    with caplog.at_level("DEBUG"):
        handle = provider.provision(spec)
        provider.status(handle)
        provider.exec_command(handle, ["true"])
        provider.terminate(handle)
    assert standin.api_key not in caplog.text
    assert spec.registration_token.get_secret_value() not in caplog.text


def test_the_toolboxs_process_execute_mixes_the_streams_so_exec_uses_sessions(
    standin: DaytonaStandin, make_spec: SpecFactory
) -> None:
    provider = build(standin)
    handle = provider.provision(make_spec())
    sandbox = _sdk(standin).get(handle.external_id)
    mixed = sandbox.process.exec('echo out; echo "$WHO" >&2; exit 4', env={"WHO": "err"})
    assert (mixed.exit_code, mixed.result) == (4, "out\nerr\n")
    apart = provider.exec_command(handle, 'echo out; echo "$WHO" >&2; exit 4', env={"WHO": "err"})
    assert (apart.exit_code, apart.stdout, apart.stderr) == (4, "out\n", "err\n")
    provider.terminate(handle)
