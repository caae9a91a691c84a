"""The modal provider through the official ``modal`` SDK against the Modal stand-in (the
SDK's own gRPC services on loopback): what a sandbox is made with, where the token goes,
which credential is used, the GPU asked for, statuses, and how gRPC status codes are
classified (the contract suite covers the lifecycle, exec and the inventory)."""

from __future__ import annotations

import socket
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from grpclib import Status
from modal._utils.grpc_utils import GRPC_WINDOW_SIZE

from corral.providers.base import SandboxHandle, SandboxState
from corral.providers.credentials import CredentialResolver, InMemoryCredentialStore
from corral.providers.errors import (
    CredentialMissingError,
    CredentialRejectedError,
    InvalidProviderConfigError,
    ProviderTimeoutError,
    ProviderUnavailableError,
    RateLimitedError,
    TransientProviderError,
)
from corral.providers.modal import ModalProvider
from tests import floods
from tests.conftest import SpecFactory
from tests.standins.modal import ModalStandin, StandinSandbox

SECRET_KEY = "a-secret-key-for-the-tests-only-Q7x2M9p4"
SLEEPING = ["sh", "-c", "exec sleep 300"]


@pytest.fixture
def standin(modal_standin: ModalStandin) -> Iterator[ModalStandin]:
    yield modal_standin
    modal_standin.clear_faults()


def build(
    standin: ModalStandin,
    *,
    environ: dict[str, str] | None = None,
    store: InMemoryCredentialStore | None = None,
    **config: Any,
) -> ModalProvider:
    provider = ModalProvider(
        {
            "server_url": standin.server_url,
            "request_timeout_s": 5,
            "create_timeout_s": 5,
            "deployment": f"it-{uuid.uuid4().hex[:8]}",
            "command": SLEEPING,
            **config,
        }
    )
    keys = {"CORRAL_MODAL_API_KEY": standin.api_key} if environ is None else environ
    provider.use_credentials(CredentialResolver(store, secret_key=SECRET_KEY, environ=keys))
    return provider


def made(standin: ModalStandin, handle: SandboxHandle) -> StandinSandbox:
    return standin.sandbox(handle.external_id)


def test_a_sandbox_is_made_with_image_resources_tags_and_the_token_in_a_secret(
    standin: ModalStandin, make_spec: SpecFactory
) -> None:
    provider = build(standin, image="registry.example/corral-runner:1", app_name="corral-it")
    spec = make_spec(resources={"cpu": 2, "memory_mb": 2048, "timeout_s": 1200}, env={"CI": "1"})
    handle = provider.provision(spec)

    sandbox, token = made(standin, handle), spec.registration_token.get_secret_value()
    assert sandbox.app_id == standin.app_id("corral-it")
    assert (sandbox.milli_cpu, sandbox.memory_mb, sandbox.timeout_s) == (2000, 2048, 1200)
    assert sandbox.gpu is None and sandbox.version == 2
    assert sandbox.argv == SLEEPING and sandbox.name == spec.sandbox_id
    assert sandbox.env["CORRAL_REGISTRATION_TOKEN"] == token
    assert sandbox.env["CORRAL_CONTROL_URL"] == spec.control_url
    assert sandbox.env["CI"] == "1"
    assert sandbox.tags["corral.sandbox-id"] == spec.sandbox_id
    assert sandbox.tags["corral.org-id"] == "acme"
    assert "registry.example/corral-runner:1" in str(standin.state.images[sandbox.image_id])
    # The token went in the create call's secret sources alone: no argv, tag, or other call.
    assert token not in str(sandbox.argv) + str(sandbox.tags)
    assert {r.method for r in standin.requests_carrying(token)} == {"SandboxCreateV2"}
    [create] = standin.requests_carrying(token)
    assert create.message.count(token) == 1
    assert "secret_sources" in create.message.split(token)[0].rsplit("definition", 1)[-1]


@pytest.mark.parametrize(
    "case",
    [
        # (GPUs the work asks for, provider config, sandbox options, what Modal is asked for)
        (1, {}, {}, "ANY"),
        (2, {"gpu_type": "A100"}, {}, "A100:2"),
        (1, {"gpu_type": "A100"}, {"gpu_type": "T4"}, "T4"),
    ],
)
def test_the_gpus_the_work_asks_for_are_passed_to_modal(
    standin: ModalStandin,
    make_spec: SpecFactory,
    case: tuple[int, dict[str, str], dict[str, str], str],
) -> None:
    gpus, config, options, expected = case
    provider = build(standin, **config)
    spec = make_spec(resources={"gpu": gpus}, provider_options=options)
    sandbox = made(standin, provider.provision(spec))
    assert sandbox.gpu == expected
    # A GPU sandbox is a V1 one at Modal, whose Secret is made first: the token is in it alone.
    token = spec.registration_token.get_secret_value()
    assert {r.method for r in standin.requests_carrying(token)} == {"SecretGetOrCreate"}
    assert sandbox.env["CORRAL_REGISTRATION_TOKEN"] == token


def test_a_second_provision_finds_the_first_and_a_handle_by_corral_id_finds_it_by_name(
    standin: ModalStandin, make_spec: SpecFactory
) -> None:
    provider = build(standin)
    spec = make_spec()
    first, second = provider.provision(spec), provider.provision(spec)
    assert first.external_id == second.external_id
    # What a provision that never returned leaves corral: the sandbox id as external id.
    by_name = first.model_copy(update={"external_id": spec.sandbox_id})
    assert provider.status(by_name).state is SandboxState.RUNNING
    provider.terminate(by_name)
    assert provider.status(first).reason == "terminated"


@pytest.mark.parametrize(
    "case",
    [
        # (entrypoint, state, reason, exit code)
        (["sh", "-c", "exit 0"], SandboxState.TERMINATED, "exited", 0),
        (["sh", "-c", "exit 3"], SandboxState.FAILED, "exited with code 3", 3),
        (
            ["sh", "-c", "kill -9 $$"],
            SandboxState.FAILED,
            "killed by signal 9 (exit code 137)",
            137,
        ),
    ],
)
def test_status_reports_how_the_entrypoint_ended(
    standin: ModalStandin,
    make_spec: SpecFactory,
    case: tuple[list[str], SandboxState, str, int],
) -> None:
    command, state, reason, code = case
    provider = build(standin)
    handle = provider.provision(make_spec(provider_options={"command": command}))
    status = wait_final(provider, handle)
    assert (status.state, status.reason, status.exit_code) == (state, reason, code)


def test_a_sandbox_past_its_timeout_failed_and_one_modal_forgot_is_terminated(
    standin: ModalStandin, make_spec: SpecFactory
) -> None:
    provider = build(standin)
    handle = provider.provision(make_spec(resources={"timeout_s": 1}))
    status = wait_final(provider, handle)
    assert (status.state, status.exit_code) == (SandboxState.FAILED, 124)
    assert "timed out" in (status.reason or "")
    unknown = handle.model_copy(update={"external_id": "sb-0000000000000000000000"})
    assert provider.status(unknown).reason == "sandbox no longer exists"
    provider.terminate(unknown)  # terminating what is gone is done, not an error


def wait_final(provider: ModalProvider, handle: SandboxHandle) -> Any:
    deadline = time.monotonic() + 10
    status = provider.status(handle)
    while not status.state.is_final and time.monotonic() < deadline:
        time.sleep(0.05)
        status = provider.status(handle)
    return status


def test_the_orgs_stored_credential_wins_over_the_environment(
    standin: ModalStandin, make_spec: SpecFactory
) -> None:
    store = InMemoryCredentialStore()
    wrong = {"CORRAL_MODAL_API_KEY": "ak-wrong:as-wrong"}
    provider = build(standin, environ=wrong, store=store)
    assert provider.credentials is not None
    provider.credentials.put("acme", "modal", standin.api_key)
    handle = provider.provision(make_spec())
    assert handle.external_id in standin.sandboxes()
    with pytest.raises(CredentialRejectedError, match="fix CORRAL_MODAL_API_KEY"):
        provider.list_managed()  # no org: the deployment-wide token, which is wrong here
    assert not provider.health_check().healthy


def test_a_missing_or_malformed_credential_says_how_to_set_one(
    standin: ModalStandin, make_spec: SpecFactory
) -> None:
    with pytest.raises(CredentialMissingError) as missing:
        build(standin, environ={}).provision(make_spec())
    assert "corral credentials set --org acme --provider modal" in missing.value.message
    assert "CORRAL_MODAL_API_KEY" in missing.value.message
    malformed = build(standin, environ={"CORRAL_MODAL_API_KEY": "just-one-part"})
    with pytest.raises(CredentialRejectedError, match="token_id:token_secret") as raised:
        malformed.provision(make_spec())
    assert "just-one-part" not in raised.value.message
    assert standin.requests_carrying("just-one-part") == []


def test_an_unauthenticated_token_is_permanent_and_names_the_credential(
    standin: ModalStandin, make_spec: SpecFactory
) -> None:
    provider = build(standin, environ={"CORRAL_MODAL_API_KEY": f"{standin.token_id}:as-wrong"})
    with pytest.raises(CredentialRejectedError) as raised:
        provider.provision(make_spec(org_id="globex"))
    assert not raised.value.retryable
    assert "UNAUTHENTICATED" in raised.value.message
    assert "corral credentials set --org globex --provider modal" in raised.value.message
    assert "as-wrong" not in raised.value.message


def test_permission_denied_is_permanent_and_names_the_credential(
    standin: ModalStandin, make_spec: SpecFactory
) -> None:
    provider = build(standin)
    standin.fail("SandboxCreateV2", Status.PERMISSION_DENIED, message="no sandboxes for you")
    with pytest.raises(CredentialRejectedError) as raised:
        provider.provision(make_spec(org_id="globex"))
    assert not raised.value.retryable
    assert "PERMISSION_DENIED" in raised.value.message
    assert "--org globex --provider modal" in raised.value.message
    assert standin.token_secret not in raised.value.message


@pytest.mark.parametrize(
    ("status", "expected"),
    [
        (Status.RESOURCE_EXHAUSTED, RateLimitedError),  # 429: a rate limit or quota
        (Status.UNAVAILABLE, ProviderUnavailableError),
        (Status.DEADLINE_EXCEEDED, ProviderUnavailableError),
        (Status.INTERNAL, ProviderUnavailableError),
    ],
)
def test_exhaustion_unavailability_and_deadlines_are_transient_and_leave_nothing(
    standin: ModalStandin, make_spec: SpecFactory, status: Status, expected: type[Exception]
) -> None:
    provider = build(standin)
    # Until cleared: more than the SDK's own retries of UNAVAILABLE, DEADLINE_EXCEEDED, INTERNAL.
    standin.fail("SandboxCreateV2", status, times=None)
    with pytest.raises(expected) as raised:
        provider.provision(make_spec())
    assert isinstance(raised.value, TransientProviderError) and raised.value.retryable
    assert provider.list_managed() == []
    standin.clear_faults()
    assert provider.provision(make_spec()).external_id  # and it works once Modal recovers


def test_a_hung_api_is_a_transient_timeout_that_leaves_nothing(
    standin: ModalStandin, make_spec: SpecFactory
) -> None:
    provider = build(standin, create_timeout_s=0.5)
    standin.delay("SandboxCreateV2", 2)
    with pytest.raises(ProviderTimeoutError) as raised:
        provider.provision(make_spec())
    assert raised.value.retryable
    time.sleep(2)  # the held create is served after all: the SDK then terminates what it made
    assert provider.list_managed() == []


def test_a_command_past_its_timeout_is_a_provider_timeout(
    standin: ModalStandin, make_spec: SpecFactory
) -> None:
    provider = build(standin)
    handle = provider.provision(make_spec())
    with pytest.raises(ProviderTimeoutError, match="outlived its 1s timeout"):
        provider.exec_command(handle, "sleep 30", timeout_s=1)
    assert provider.exec_command(handle, "echo $PWD", cwd="work").exit_code == 0


# What a command prints, on stdout and on stderr: together twice the HTTP/2 window Modal's
# SDK opens its connections with, which is what its transport may hold unread.
FLOOD = GRPC_WINDOW_SIZE
LIMIT = floods.LIMIT


def test_exec_keeps_no_more_than_the_limit_of_a_flood_of_output(
    standin: ModalStandin, make_spec: SpecFactory
) -> None:
    provider = build(standin)
    handle = provider.provision(make_spec())
    flood = floods.flood(FLOOD)
    result, peak = floods.peak_while(
        lambda: provider.exec_command(handle, flood, timeout_s=60, max_output_bytes=LIMIT)
    )
    assert (result.stdout, result.stderr) == ("x" * LIMIT, "e" * LIMIT)
    assert result.truncated and result.exit_code == 3
    # What was held at once: the transport's window at most, however much more came.
    assert peak < GRPC_WINDOW_SIZE + 8 * 1024 * 1024, peak
    quiet = provider.exec_command(handle, ["echo", "quiet"], max_output_bytes=LIMIT)
    assert (quiet.stdout, quiet.truncated) == ("quiet\n", False)
    binary = provider.exec_command(handle, "printf 'a\\377b'")  # no UTF-8: replaced
    assert (binary.stdout, binary.exit_code) == ("a\ufffdb", 0)


def test_without_network_only_the_control_plane_is_reachable(
    standin: ModalStandin, make_spec: SpecFactory
) -> None:
    provider = build(standin)
    by_name = make_spec(egress={"allow_network": False}, control_url="https://corral.test:8300")
    by_address = make_spec(egress={"allow_network": False}, control_url="http://10.0.0.7:8300")
    opened = make_spec(egress={"allow_network": True})
    for spec in (by_name, by_address, opened):
        provider.provision(spec)
    creates = {
        spec.sandbox_id: next(
            r.message for r in standin.requests("SandboxCreateV2") if spec.sandbox_id in r.message
        )
        for spec in (by_name, by_address, opened)
    }
    assert 'allowed_domains: "corral.test"' in creates[by_name.sandbox_id]
    assert 'allowed_cidrs: "10.0.0.7/32"' in creates[by_address.sandbox_id]
    assert "ALLOWLIST" not in creates[opened.sandbox_id]
    with pytest.raises(InvalidProviderConfigError, match="CORRAL_CONTROL_URL"):
        provider.provision(
            make_spec(egress={"allow_network": False}, control_url="unix:///run/corral/api.sock")
        )


def test_the_token_is_never_logged(
    standin: ModalStandin, make_spec: SpecFactory, caplog: pytest.LogCaptureFixture
) -> None:
    provider = build(standin)
    with caplog.at_level("DEBUG"):
        spec = make_spec()
        handle = provider.provision(spec)
        provider.status(handle)
        provider.terminate(handle)
    assert standin.token_secret not in caplog.text
    assert spec.registration_token.get_secret_value() not in caplog.text


def test_an_unreachable_server_is_a_transient_timeout_within_the_limit(
    standin: ModalStandin, make_spec: SpecFactory
) -> None:
    with socket.socket() as probe:  # a port nothing listens on
        probe.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{probe.getsockname()[1]}"
    provider = build(standin, server_url=url, create_timeout_s=1, request_timeout_s=1)
    started = time.monotonic()
    with pytest.raises(ProviderTimeoutError) as raised:
        provider.provision(make_spec())  # the SDK would retry connecting for a minute
    assert raised.value.retryable
    assert time.monotonic() - started < 5
    assert not provider.health_check().healthy


def _connected_to(port: int) -> int:
    """TCP connections from a client to 127.0.0.1:``port`` that are still established."""
    count = 0
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            _, _, remote, state, *_ = line.split()
            count += state == "01" and int(remote.rsplit(":", 1)[1], 16) == port
    return count


def test_an_exec_leaves_no_connection_open(standin: ModalStandin, make_spec: SpecFactory) -> None:
    # Each exec opens a connection of its own to the sandbox's command router; one left open
    # per call would run an api serving sessions out of file descriptors.
    provider = build(standin)
    handle = provider.provision(make_spec())
    for _ in range(3):
        assert provider.exec_command(handle, ["true"]).exit_code == 0
    deadline = time.monotonic() + 10
    while _connected_to(standin.port) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _connected_to(standin.port) == 0
