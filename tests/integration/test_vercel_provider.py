"""The vercel provider through the official SDK against the Vercel Sandbox stand-in on
loopback: what a sandbox is made with, where the token goes, which credential is used, how
API errors are classified, the inventory, and ending sandboxes that are already gone (the
contract suite covers the lifecycle, exec and files)."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from vercel.sandbox.sync import SandboxCredentials, SandboxServiceOptions, SyncSandboxClient

from corral.providers.base import SandboxState
from corral.providers.credentials import CredentialResolver, InMemoryCredentialStore
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
from corral.providers.vercel import VercelProvider
from tests import floods
from tests.conftest import SpecFactory
from tests.standins.vercel import VercelStandin

SECRET_KEY = "a-secret-key-for-the-tests-only-Q7x2M9p4"
SLEEPER = ["sh", "-c", "exec sleep 300"]


@pytest.fixture
def standin(vercel_standin: VercelStandin) -> Iterator[VercelStandin]:
    yield vercel_standin
    vercel_standin.clear_faults()
    vercel_standin.destroy_all()  # and the processes the test's sandboxes still run


def build(
    standin: VercelStandin,
    *,
    environ: dict[str, str] | None = None,
    store: InMemoryCredentialStore | None = None,
    **config: Any,
) -> VercelProvider:
    settings = {
        "api_url": standin.base_url,
        "team_id": standin.team_id,
        "project_id": standin.project_id,
        "request_timeout_s": 2,
        "deployment": f"it-{uuid.uuid4().hex[:8]}",
        **config,
    }
    provider = VercelProvider(settings)
    keys = {"CORRAL_VERCEL_API_KEY": standin.token} if environ is None else environ
    provider.use_credentials(CredentialResolver(store, secret_key=SECRET_KEY, environ=keys))
    return provider


def sleeping(make_spec: SpecFactory, **fields: Any) -> Any:
    return make_spec(provider_options={"command": SLEEPER}, **fields)


def sdk_client(standin: VercelStandin) -> SyncSandboxClient:
    """The SDK as another program would use it, for sandboxes corral did not make."""
    credentials = SandboxCredentials(standin.token, standin.team_id, standin.project_id)
    options = SandboxServiceOptions(
        base_url=standin.base_url, credentials_factory=lambda: credentials
    )
    return SyncSandboxClient.create(options=options)


def test_a_sandbox_is_made_with_env_tags_vcpus_and_capped_timeout_and_the_runner_detached(
    standin: VercelStandin, make_spec: SpecFactory
) -> None:
    provider = build(standin, image="corral-runner:1", runner_command="sleep 300")
    spec = make_spec(resources={"timeout_s": 30_000, "cpu": 1.5}, env={"CI": "true"})

    handle = provider.provision(spec)

    made = standin.sandbox(handle.external_id)
    assert made.name == handle.external_id == spec.sandbox_id
    body = made.create_body
    assert body["projectId"] == standin.project_id
    assert body["timeout"] == 18_000 * 1000  # capped at the matrix's longest session
    assert body["resources"] == {"vcpus": 2}
    assert body["persistent"] is False
    assert body["image"] == "corral-runner:1"
    assert made.env["CORRAL_REGISTRATION_TOKEN"] == spec.registration_token.get_secret_value()
    assert made.env["CORRAL_CONTROL_URL"] == spec.control_url
    assert made.env["CORRAL_SANDBOX_ID"] == spec.sandbox_id
    assert made.env["CI"] == "true"
    assert made.tags == {
        "corral.managed": "true",
        "corral.deployment": provider.config.deployment,
        "corral.org-id": "acme",
        "corral.work-item-id": spec.work_item_id,
    }
    [runner] = made.commands
    assert (runner.name, runner.args, runner.env["CORRAL_SANDBOX_ID"]) == (
        "sleep",
        ["300"],
        spec.sandbox_id,
    )
    assert provider.status(handle).state is SandboxState.RUNNING


def test_the_token_goes_in_the_create_bodys_env_and_nowhere_else(
    standin: VercelStandin, make_spec: SpecFactory
) -> None:
    provider = build(standin)
    spec = sleeping(make_spec, pool_id="pool-1")
    standin.clear_requests()
    handle = provider.provision(spec)
    provider.status(handle)
    provider.exec_command(handle, ["true"])
    provider.list_managed()
    provider.terminate(handle)

    token = spec.registration_token.get_secret_value()
    [carrier] = standin.requests_containing(token)
    assert (carrier.method, carrier.path) == ("POST", "/v3/sandboxes")
    assert carrier.body["env"]["CORRAL_REGISTRATION_TOKEN"] == token
    assert token not in str({k: v for k, v in carrier.body.items() if k != "env"})
    assert token not in handle.model_dump_json()
    assert standin.sandbox(spec.sandbox_id).tags["corral.pool-id"] == "pool-1"
    # The access token is a bearer header on every call, never a query or a body.
    assert not standin.requests_containing(standin.token)
    assert all(r.headers["authorization"] == "<redacted>" for r in standin.requests())


def test_image_and_source_come_from_the_options_over_the_config(
    standin: VercelStandin, make_spec: SpecFactory
) -> None:
    provider = build(standin, image="base:1", source={"type": "tarball", "url": "https://t/x.tgz"})
    default = provider.provision(sleeping(make_spec))
    chosen = provider.provision(
        make_spec(
            provider_options={
                "command": SLEEPER,
                "image": "other:2",
                "source": {"type": "git", "url": "https://g/r.git", "revision": "main", "depth": 1},
            }
        )
    )
    first = standin.sandbox(default.external_id).create_body
    second = standin.sandbox(chosen.external_id).create_body
    assert (first["image"], first["source"]) == (
        "base:1",
        {"type": "tarball", "url": "https://t/x.tgz"},
    )
    assert second["image"] == "other:2"
    assert second["source"] == {
        "type": "git",
        "url": "https://g/r.git",
        "revision": "main",
        "depth": 1,
    }


def test_a_second_provision_finds_the_first_and_starts_a_runner_only_where_none_runs(
    standin: VercelStandin, make_spec: SpecFactory
) -> None:
    provider = build(standin)
    spec = sleeping(make_spec)
    first, second = provider.provision(spec), provider.provision(spec)
    assert first.external_id == second.external_id
    assert len(standin.sandbox(spec.sandbox_id).commands) == 1
    assert [m.sandbox_id for m in provider.list_managed()] == [spec.sandbox_id]

    # A delivery that died between making the sandbox and starting the runner.
    bare = sleeping(make_spec)
    tags = {"corral.managed": "true", "corral.deployment": provider.config.deployment}
    client = sdk_client(standin)
    try:
        client.create_sandbox(name=bare.sandbox_id, tags=tags)
    finally:
        client.close()
    provider.provision(bare)
    [runner] = standin.sandbox(bare.sandbox_id).commands
    assert [runner.name, *runner.args] == SLEEPER


def test_a_sandbox_named_alike_of_another_deployment_is_refused(
    standin: VercelStandin, make_spec: SpecFactory
) -> None:
    spec = sleeping(make_spec)
    build(standin).provision(spec)
    with pytest.raises(SandboxCreateError, match="not this deployment's"):
        build(standin).provision(spec)


def test_status_follows_the_sandbox_and_its_runner(
    standin: VercelStandin, make_spec: SpecFactory
) -> None:
    provider = build(standin)
    exiting = provider.provision(make_spec(provider_options={"command": ["sh", "-c", "exit 3"]}))
    deadline = time.monotonic() + 10
    while (status := provider.status(exiting)).state is SandboxState.RUNNING:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert (status.state, status.exit_code, status.reason) == (
        SandboxState.FAILED,
        3,
        "exited with code 3",
    )

    timed_out = provider.provision(sleeping(make_spec))
    standin.finish(timed_out.external_id)  # its execution time limit ran out
    status = provider.status(timed_out)
    assert (status.state, status.reason) == (SandboxState.TERMINATED, "stopped")
    listed = {m.handle.external_id: m.state for m in provider.list_managed()}
    assert listed[timed_out.external_id] is SandboxState.TERMINATED
    assert listed[exiting.external_id] is None  # running: the listing does not tell more

    provider.terminate(timed_out)
    status = provider.status(timed_out)
    assert (status.state, status.reason) == (SandboxState.TERMINATED, "sandbox no longer exists")


def test_ending_a_gone_sandbox_is_done(standin: VercelStandin, make_spec: SpecFactory) -> None:
    provider = build(standin)
    never = make_spec()
    provider.terminate(provider._handle(never, never.sandbox_id))  # never made: done

    handle = provider.provision(sleeping(make_spec))
    # Gone between the look-up and the calls that end it: the stop and destroy answer 404.
    standin.fail_next(404, path="/v2/sandboxes/sessions/", method="POST", code="not_found")
    standin.fail_next(404, path=f"/v2/sandboxes/{handle.external_id}", method="DELETE")
    provider.terminate(handle)
    provider.terminate(handle)
    assert provider.status(handle).state is SandboxState.TERMINATED


def test_exec_in_a_stopped_sandbox_does_not_resume_it(
    standin: VercelStandin, make_spec: SpecFactory
) -> None:
    provider = build(standin)
    handle = provider.provision(sleeping(make_spec))
    standin.finish(handle.external_id)
    standin.clear_requests()
    with pytest.raises(SandboxNotRunningError):
        provider.exec_command(handle, ["echo", "hi"])
    assert all(r.query.get("resume") != ["true"] for r in standin.requests())
    assert not standin.requests(path="/v2/sandboxes/sessions/")
    assert standin.sandbox(handle.external_id).session.ended == "stopped"


def test_a_command_past_its_timeout_is_killed_and_a_transient_timeout(
    standin: VercelStandin, make_spec: SpecFactory
) -> None:
    provider = build(standin)
    handle = provider.provision(sleeping(make_spec))
    with pytest.raises(ProviderTimeoutError, match="outlived"):
        provider.exec_command(handle, ["sleep", "30"], timeout_s=0.5)


FLOOD = 16 * 1024 * 1024  # what a command prints, or a file holds, far past the limit
LIMIT = floods.LIMIT


def test_exec_keeps_no_more_than_the_limit_of_a_flood_of_output(
    standin: VercelStandin, make_spec: SpecFactory
) -> None:
    provider = build(standin)
    handle = provider.provision(sleeping(make_spec))
    flood = floods.flood(FLOOD)
    result = provider.exec_command(handle, flood, timeout_s=60, max_output_bytes=LIMIT)
    assert (result.stdout, result.stderr) == ("x" * LIMIT, "e" * LIMIT)
    assert result.truncated and result.exit_code == 3
    quiet = provider.exec_command(handle, ["echo", "quiet"], max_output_bytes=LIMIT)
    assert (quiet.stdout, quiet.truncated) == ("quiet\n", False)


def test_a_download_over_the_limit_stops_one_byte_past_it(
    standin: VercelStandin, make_spec: SpecFactory, tmp_path: Path
) -> None:
    provider = build(standin)
    handle = provider.provision(sleeping(make_spec))
    made = provider.exec_command(handle, floods.big_and_fitting_files(FLOOD))
    assert made.exit_code == 0, made
    target = tmp_path / "download" / "file"
    with pytest.raises(FileTooLargeError) as refused:
        provider.download_file(handle, "big.bin", target, max_bytes=LIMIT)
    assert refused.value.max_bytes == LIMIT
    # The API tells no size before the bytes: they were read until one past the limit.
    assert target.stat().st_size == LIMIT + 1
    provider.download_file(handle, "fits.bin", target, max_bytes=LIMIT)
    assert target.read_bytes() == b"\0" * LIMIT
    with pytest.raises(SandboxPathError, match="does not exist"):
        provider.download_file(handle, "no-such-file", target, max_bytes=LIMIT)


def test_the_orgs_stored_credential_wins_over_the_environment(
    standin: VercelStandin, make_spec: SpecFactory
) -> None:
    store = InMemoryCredentialStore()
    provider = build(standin, environ={"CORRAL_VERCEL_API_KEY": "vcp_wrong"}, store=store)
    assert provider.credentials is not None
    provider.credentials.put("acme", "vercel", standin.token)
    handle = provider.provision(sleeping(make_spec))
    assert handle.external_id in standin.sandboxes()
    with pytest.raises(CredentialRejectedError, match="fix CORRAL_VERCEL_API_KEY"):
        provider.list_managed()  # no org: the deployment-wide token, which is wrong here


def test_a_missing_credential_or_configuration_says_what_to_set(
    standin: VercelStandin, make_spec: SpecFactory
) -> None:
    with pytest.raises(CredentialMissingError) as raised:
        build(standin, environ={}).provision(make_spec())
    assert "corral credentials set --org acme --provider vercel" in raised.value.message
    assert "CORRAL_VERCEL_API_KEY" in raised.value.message

    unconfigured = build(standin, team_id=None, project_id=None)
    health = unconfigured.health_check()
    assert not health.healthy and "team_id and project_id" in health.message
    with pytest.raises(InvalidProviderConfigError, match="team_id and project_id"):
        unconfigured.provision(make_spec())


@pytest.mark.parametrize(
    ("token", "team", "status"),
    [("vcp_not-the-token", None, 403), (None, "team_other", 403)],
    ids=["invalid-token", "another-team"],
)
def test_the_apis_own_refusals_are_permanent_and_name_the_credential(
    standin: VercelStandin, make_spec: SpecFactory, token: str | None, team: str | None, status: int
) -> None:
    provider = build(
        standin,
        environ={"CORRAL_VERCEL_API_KEY": token or standin.token},
        team_id=team or standin.team_id,
    )
    with pytest.raises(CredentialRejectedError) as raised:
        provider.provision(make_spec(org_id="globex"))
    assert not raised.value.retryable
    assert f"({status})" in raised.value.message
    assert "corral credentials set --org globex --provider vercel" in raised.value.message
    assert "team_id and project_id" in raised.value.message
    assert standin.token not in raised.value.message
    assert not provider.health_check().healthy


@pytest.mark.parametrize("status", [401, 403])
def test_authorization_failures_are_permanent_and_name_the_credential(
    standin: VercelStandin, make_spec: SpecFactory, status: int
) -> None:
    provider = build(standin)
    standin.fail_next(status, times=None, path="/v3/sandboxes", method="POST")
    with pytest.raises(CredentialRejectedError) as raised:
        provider.provision(make_spec(org_id="globex"))
    assert not raised.value.retryable
    assert f"({status})" in raised.value.message
    assert "CORRAL_VERCEL_API_KEY" in raised.value.message
    assert standin.token not in raised.value.message


@pytest.mark.parametrize("status", [429, 500, 502, 503])
def test_rate_limits_and_server_errors_are_transient(
    standin: VercelStandin, make_spec: SpecFactory, status: int
) -> None:
    provider = build(standin)
    standin.fail_next(status, method="POST", path="/v3/sandboxes")
    expected = RateLimitedError if status == 429 else ProviderUnavailableError
    with pytest.raises(expected) as raised:
        provider.provision(sleeping(make_spec))
    assert raised.value.retryable
    assert provider.list_managed() == []
    assert provider.provision(sleeping(make_spec)).external_id  # and it works once it recovers


def test_a_hung_api_is_a_transient_timeout(standin: VercelStandin, make_spec: SpecFactory) -> None:
    provider = build(standin, request_timeout_s=0.5)
    standin.delay_next(3, method="POST", path="/v3/sandboxes")
    with pytest.raises(ProviderTimeoutError) as raised:
        provider.provision(sleeping(make_spec))
    assert raised.value.retryable


def test_a_memory_request_is_met_with_enough_vcpus(
    standin: VercelStandin, make_spec: SpecFactory
) -> None:
    provider = build(standin, runner_command="sleep 300")
    # Vercel sizes by vCPUs (2048 MB each): 6000 MB takes 3 vCPUs, which is no size: refused
    # by the API rather than given less memory; 4000 MB takes 2.
    handle = provider.provision(make_spec(resources={"memory_mb": 4000, "cpu": 1}))
    assert standin.sandbox(handle.external_id).create_body["resources"] == {"vcpus": 2}
    provider.terminate(handle)
    with pytest.raises(SandboxCreateError, match=r"\(400\).*vcpus"):
        provider.provision(make_spec(resources={"memory_mb": 6000}))


def test_a_create_vercel_refuses_is_permanent_and_names_the_reason(
    standin: VercelStandin, make_spec: SpecFactory
) -> None:
    provider = build(standin)
    with pytest.raises(SandboxCreateError, match=r"\(400\).*vcpus"):
        provider.provision(sleeping(make_spec, resources={"cpu": 3}))  # 3 vCPUs: no such size
    assert provider.list_managed() == []


def test_a_runner_that_cannot_start_leaves_no_sandbox(
    standin: VercelStandin, make_spec: SpecFactory
) -> None:
    provider = build(standin)
    spec = sleeping(make_spec)
    standin.fail_next(500, method="POST", path="/v2/sandboxes/sessions/")
    with pytest.raises(ProviderUnavailableError):
        provider.provision(spec)
    assert provider.list_managed() == []
    assert spec.sandbox_id in standin.destroyed()


def test_a_sandbox_still_booting_is_waited_for(make_spec: SpecFactory) -> None:
    with VercelStandin(boot_s=0.6) as slow:
        provider = build(slow)
        handle = provider.provision(sleeping(make_spec))
        assert provider.status(handle).state is SandboxState.RUNNING
        polls = slow.requests(method="GET", path=f"/v2/sandboxes/{handle.external_id}")
        assert len(polls) >= 2  # the SDK looked again until it ran


def test_the_inventory_lists_this_deployments_sandboxes_over_pages(
    standin: VercelStandin, make_spec: SpecFactory
) -> None:
    provider = build(standin)
    deployment = provider.config.deployment
    client = sdk_client(standin)
    marked = {"corral.managed": "true", "corral.deployment": deployment}
    for number in range(51):  # more than the largest page (50)
        client.create_sandbox(name=f"{deployment}-{number}", tags=marked)
    strays = [
        client.create_sandbox(
            name=f"{deployment}-unmanaged", tags={"corral.deployment": deployment}
        ),
        client.create_sandbox(name=f"{deployment}-elsewhere", tags={"corral.managed": "true"}),
    ]
    standin.clear_requests()

    listed = provider.list_managed()
    assert sorted(m.sandbox_id for m in listed) == sorted(f"{deployment}-{n}" for n in range(51))
    assert {m.labels["corral.sandbox-id"] for m in listed} == {m.sandbox_id for m in listed}
    assert all(m.handle.org_id == "unknown" for m in listed)  # no org tag: made by hand
    pages = standin.requests(method="GET", path="/v2/sandboxes")
    assert sum(1 for r in pages if r.query.get("tags")) == 2
    provider.terminate(listed[0].handle)
    assert len(provider.list_managed()) == 50
    for stray in strays:
        stray.destroy()
    client.close()


def test_without_network_only_the_control_plane_is_reachable(
    standin: VercelStandin, make_spec: SpecFactory
) -> None:
    provider = build(standin)
    control_url = "https://corral.example.test:8300"
    closed = provider.provision(
        sleeping(make_spec, egress={"allow_network": False}, control_url=control_url)
    )
    opened = provider.provision(sleeping(make_spec, egress={"allow_network": True}))

    policy = standin.sandbox(closed.external_id).create_body["networkPolicy"]
    assert policy == {"allow": {"corral.example.test": []}}
    assert "networkPolicy" not in standin.sandbox(opened.external_id).create_body
    with pytest.raises(InvalidProviderConfigError, match="CORRAL_CONTROL_URL"):
        provider.provision(
            make_spec(egress={"allow_network": False}, control_url="unix:///run/corral/api.sock")
        )


def test_the_token_is_never_logged(
    standin: VercelStandin, make_spec: SpecFactory, caplog: pytest.LogCaptureFixture
) -> None:
    provider = build(standin)
    spec = sleeping(make_spec)
    with caplog.at_level("DEBUG"):
        handle = provider.provision(spec)
        provider.status(handle)
        provider.terminate(handle)
    assert standin.token not in caplog.text
    assert spec.registration_token.get_secret_value() not in caplog.text


def test_allowed_hosts_are_sent_in_the_network_policy(
    standin: VercelStandin, make_spec: SpecFactory
) -> None:
    provider = build(standin)
    control_url = "https://corral.example.test:8300"
    egress = {"allow_network": True, "allowed_hosts": ["pypi.org", "10.1.0.0/16"]}
    handle = provider.provision(sleeping(make_spec, egress=egress, control_url=control_url))

    policy = standin.sandbox(handle.external_id).create_body["networkPolicy"]
    assert policy["allow"] == {"corral.example.test": [], "pypi.org": []}
    assert policy["subnets"] == {"allow": ["10.1.0.0/16"]}
    with pytest.raises(InvalidProviderConfigError, match="not by port"):
        provider.provision(
            sleeping(
                make_spec,
                egress={"allow_network": True, "allowed_hosts": ["pypi.org:443"]},
                control_url=control_url,
            )
        )
