"""The e2b provider through the official SDK against the E2B stand-in on loopback: what a
sandbox is made with, where the token goes, which credential is used, and how API errors
are classified (the contract suite covers the lifecycle, exec and pause/resume)."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from pydantic import SecretStr
from typer.testing import CliRunner

from corral.cli.app import app
from corral.providers.base import SandboxState
from corral.providers.credentials import CredentialResolver, InMemoryCredentialStore
from corral.providers.e2b import E2BProvider
from corral.providers.errors import (
    CredentialMissingError,
    CredentialRejectedError,
    InvalidProviderConfigError,
    ProviderTimeoutError,
    ProviderUnavailableError,
    RateLimitedError,
    SandboxCreateError,
)
from corral.shared.store.db import Database
from tests import floods
from tests.conftest import SpecFactory
from tests.standins.e2b import E2BStandin
from tests.standins.e2b_envd import default_command_handler
from tests.standins.e2b_state import CommandOutcome

SECRET_KEY = "a-secret-key-for-the-tests-only-Q7x2M9p4"


@pytest.fixture
def standin(e2b_standin: E2BStandin) -> Iterator[E2BStandin]:
    e2b_standin.on_command(None)
    yield e2b_standin
    e2b_standin.clear_faults()


def build(
    standin: E2BStandin,
    *,
    environ: dict[str, str] | None = None,
    store: InMemoryCredentialStore | None = None,
    **config: Any,
) -> E2BProvider:
    provider = E2BProvider(
        {
            "api_url": standin.api_url,
            "sandbox_url": standin.sandbox_url,
            "request_timeout_s": 2,
            "deployment": f"it-{uuid.uuid4().hex[:8]}",
            **config,
        }
    )
    keys = {"CORRAL_E2B_API_KEY": standin.api_key} if environ is None else environ
    provider.use_credentials(CredentialResolver(store, secret_key=SECRET_KEY, environ=keys))
    return provider


def test_a_sandbox_is_made_from_the_template_with_token_and_labels_and_the_runner_started(
    standin: E2BStandin, make_spec: SpecFactory
) -> None:
    provider = build(standin, template="corral-runner", runner_command="python3 -m runner")
    spec = make_spec(resources={"timeout_s": 1200}, env={"CI": "true"})

    handle = provider.provision(spec)

    made = standin.sandbox(handle.external_id)
    token = spec.registration_token.get_secret_value()
    assert made.template_id == "corral-runner"
    assert made.timeout == 1200
    assert made.envs["CORRAL_REGISTRATION_TOKEN"] == token
    assert made.envs["CORRAL_CONTROL_URL"] == spec.control_url
    assert made.envs["CI"] == "true"
    assert made.metadata["corral.sandbox-id"] == spec.sandbox_id
    assert made.metadata["corral.org-id"] == "acme"
    assert made.metadata["corral.managed"] == "true"
    assert [call.cmd for call in made.commands] == ["python3 -m runner"]
    # The token went in the create body's envs and nowhere else: not in metadata, not in a
    # command line, not in a URL.
    for request in standin.requests():
        where = f"{request.path} {request.query} {request.headers}"
        assert token not in where
        if not (request.method == "POST" and request.path == "/v2/sandboxes"):
            assert token not in str(request.body)
    assert token not in str(made.metadata) + made.commands[0].cmd


def test_a_second_provision_of_the_same_sandbox_finds_the_first(
    standin: E2BStandin, make_spec: SpecFactory
) -> None:
    provider = build(standin)
    spec = make_spec()
    first, second = provider.provision(spec), provider.provision(spec)
    assert first.external_id == second.external_id
    assert [m.sandbox_id for m in provider.list_managed()] == [spec.sandbox_id]


def test_status_follows_the_sandbox_info_and_a_vanished_sandbox_is_terminated(
    standin: E2BStandin, make_spec: SpecFactory
) -> None:
    provider = build(standin)
    handle = provider.provision(make_spec())
    assert provider.status(handle).state is SandboxState.RUNNING
    standin.finish(handle.external_id)  # its E2B timeout ran out
    status = provider.status(handle)
    assert (status.state, status.reason) == (SandboxState.TERMINATED, "sandbox no longer exists")
    provider.terminate(handle)  # killing what is gone is done, not an error


def test_the_orgs_stored_credential_wins_over_the_environment(
    standin: E2BStandin, make_spec: SpecFactory
) -> None:
    store = InMemoryCredentialStore()
    provider = build(standin, environ={"CORRAL_E2B_API_KEY": "e2b_wrong"}, store=store)
    assert provider.credentials is not None
    provider.credentials.put("acme", "e2b", standin.api_key)
    handle = provider.provision(make_spec())
    assert handle.external_id in standin.sandboxes()
    with pytest.raises(CredentialRejectedError, match="fix CORRAL_E2B_API_KEY"):
        provider.list_managed()  # no org: the deployment-wide key, which is wrong here


def test_a_missing_credential_names_both_ways_to_set_one(
    standin: E2BStandin, make_spec: SpecFactory
) -> None:
    provider = build(standin, environ={})
    with pytest.raises(CredentialMissingError) as raised:
        provider.provision(make_spec())
    assert "corral credentials set --org acme --provider e2b" in raised.value.message
    assert "CORRAL_E2B_API_KEY" in raised.value.message
    health = provider.health_check()
    assert not health.healthy and health.message.startswith("no credential:")
    for_org = provider.health_check(org_id="acme")
    assert not for_org.healthy and "corral credentials set --org acme" in for_org.message


def test_the_health_check_makes_an_authenticated_call_with_the_orgs_credential(
    standin: E2BStandin,
) -> None:
    store = InMemoryCredentialStore()
    provider = build(standin, environ={"CORRAL_E2B_API_KEY": "a-wrong-key"}, store=store)
    assert provider.credentials is not None
    provider.credentials.put("acme", "e2b", standin.api_key)

    assert provider.health_check(org_id="acme").healthy  # the org's stored key
    wrong = provider.health_check()  # the deployment's, which the API refuses
    assert not wrong.healthy and "CORRAL_E2B_API_KEY" in wrong.message
    assert "a-wrong-key" not in wrong.message
    listed = [r for r in standin.requests() if r.method == "GET" and "sandboxes" in r.path]
    assert len(listed) >= 2  # each check asked the API, read-only


@pytest.mark.parametrize("status", [401, 403])
def test_authorization_failures_are_permanent_and_name_the_credential(
    standin: E2BStandin, make_spec: SpecFactory, status: int
) -> None:
    provider = build(standin)
    standin.fail_next(status, times=None, path="/v2/sandboxes", method="POST")
    with pytest.raises(CredentialRejectedError) as raised:
        provider.provision(make_spec(org_id="globex"))
    assert not raised.value.retryable
    assert f"({status})" in raised.value.message
    assert "corral credentials set --org globex --provider e2b" in raised.value.message
    assert standin.api_key not in raised.value.message


@pytest.mark.parametrize(
    ("status", "expected"),
    [
        (429, RateLimitedError),
        (500, ProviderUnavailableError),
        (503, ProviderUnavailableError),
    ],
)
def test_rate_limits_and_server_errors_are_transient(
    standin: E2BStandin, make_spec: SpecFactory, status: int, expected: type[Exception]
) -> None:
    provider = build(standin)
    # More failures than the SDK's own three retries, with Should-Retry: false for 503.
    headers = {"Should-Retry": "false"} if status == 503 else None
    standin.fail_next(status, times=5, method="POST", path="/v2/sandboxes", headers=headers)
    with pytest.raises(expected) as raised:
        provider.provision(make_spec())
    assert getattr(raised.value, "retryable", False)
    standin.clear_faults()
    assert provider.provision(make_spec()).external_id  # and it works once E2B recovers


def test_a_hung_api_is_a_transient_timeout(standin: E2BStandin, make_spec: SpecFactory) -> None:
    provider = build(standin, request_timeout_s=0.5)
    standin.delay_next(3, method="POST", path="/v2/sandboxes")
    with pytest.raises(ProviderTimeoutError) as raised:
        provider.provision(make_spec())
    assert raised.value.retryable


def test_an_unknown_template_is_a_permanent_create_error_naming_it(
    make_spec: SpecFactory,
) -> None:
    with E2BStandin(templates={"corral-runner": "tpl-1"}) as strict:
        provider = build(strict, template="no-such-template")
        with pytest.raises(SandboxCreateError, match="no-such-template"):
            provider.provision(make_spec())
        assert strict.sandboxes() == {}


def test_a_runner_that_cannot_start_leaves_no_sandbox(
    standin: E2BStandin, make_spec: SpecFactory
) -> None:
    provider = build(standin)
    standin.fail_next(500, times=5, path="/process.Process/Start")
    with pytest.raises(ProviderUnavailableError):
        provider.provision(make_spec())
    assert provider.list_managed() == []


def test_secrets_in_the_config_are_not_needed_and_the_key_is_never_logged(
    standin: E2BStandin, make_spec: SpecFactory, caplog: pytest.LogCaptureFixture
) -> None:
    provider = build(standin)
    with caplog.at_level("DEBUG"):
        handle = provider.provision(make_spec())
        provider.status(handle)
        provider.terminate(handle)
    assert standin.api_key not in caplog.text
    assert SecretStr(standin.api_key).get_secret_value() not in str(provider.config)


def test_without_network_only_the_control_plane_is_reachable(
    standin: E2BStandin, make_spec: SpecFactory
) -> None:
    provider = build(standin)
    control_url = "https://corral.example.test:8300"
    closed = provider.provision(make_spec(egress={"allow_network": False}, control_url=control_url))
    opened = provider.provision(make_spec(egress={"allow_network": True}))

    network = standin.sandbox(closed.external_id).create_body["network"]
    assert network == {"allowOut": ["corral.example.test"], "denyOut": ["0.0.0.0/0"]}
    assert "network" not in standin.sandbox(opened.external_id).create_body
    with pytest.raises(InvalidProviderConfigError, match="CORRAL_CONTROL_URL"):
        provider.provision(
            make_spec(egress={"allow_network": False}, control_url="unix:///run/corral/api.sock")
        )


def test_providers_check_uses_the_deployments_config_and_the_orgs_stored_credential(
    standin: E2BStandin, sqlite_db: Database, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = {"api_url": standin.api_url, "sandbox_url": standin.sandbox_url}
    monkeypatch.setenv("CORRAL_PROVIDER_CONFIG", json.dumps({"e2b": config}))
    monkeypatch.setenv("CORRAL_DATABASE_URL", str(sqlite_db.engine.url))
    monkeypatch.setenv("CORRAL_SECRET_KEY", SECRET_KEY)
    monkeypatch.delenv("CORRAL_E2B_API_KEY", raising=False)
    cli = CliRunner()

    without = cli.invoke(app, ["providers", "check", "e2b"])
    assert without.exit_code == 1
    assert "e2b: UNHEALTHY: no credential: CORRAL_E2B_API_KEY is not set" in without.output

    stored = cli.invoke(
        app, ["credentials", "set", "--org", "acme", "--provider", "e2b"], input=standin.api_key
    )
    assert stored.exit_code == 0, stored.output
    for_org = cli.invoke(app, ["providers", "check", "e2b", "--org", "acme"])
    assert for_org.exit_code == 0, for_org.output
    assert "e2b: healthy: the E2B API answers to org acme's credential" in for_org.output
    assert standin.api_key not in for_org.output


def test_allowed_hosts_are_sent_as_the_sandboxs_allow_list(
    standin: E2BStandin, make_spec: SpecFactory
) -> None:
    provider = build(standin)
    control_url = "https://corral.example.test:8300"
    egress = {"allow_network": True, "allowed_hosts": ["pypi.org", "10.1.0.0/16"]}
    handle = provider.provision(make_spec(egress=egress, control_url=control_url))

    network = standin.sandbox(handle.external_id).create_body["network"]
    assert network == {
        "allowOut": ["corral.example.test", "pypi.org", "10.1.0.0/16"],
        "denyOut": ["0.0.0.0/0"],
    }
    with pytest.raises(InvalidProviderConfigError, match="not by port"):
        provider.provision(
            make_spec(
                egress={"allow_network": True, "allowed_hosts": ["pypi.org:443"]},
                control_url=control_url,
            )
        )


FLOOD = 16 * 1024 * 1024  # what a command prints, far past the limit
LIMIT = floods.LIMIT


def test_exec_keeps_no_more_than_the_limit_of_a_flood_of_output(
    standin: E2BStandin, make_spec: SpecFactory
) -> None:
    provider = build(standin)
    handle = provider.provision(make_spec())
    flood = CommandOutcome(stdout="x" * FLOOD, stderr="e" * FLOOD, exit_code=3)
    standin.on_command(lambda call: flood if call.cmd == "yes" else default_command_handler(call))

    result = provider.exec_command(handle, ["yes"], timeout_s=60, max_output_bytes=LIMIT)

    assert (result.stdout, result.stderr) == ("x" * LIMIT, "e" * LIMIT)
    assert result.truncated and result.exit_code == 3
    quiet = provider.exec_command(handle, ["echo", "quiet"], max_output_bytes=LIMIT)
    assert (quiet.stdout, quiet.truncated) == ("quiet\n", False)
