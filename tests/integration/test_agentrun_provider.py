"""The agentrun provider through the real agentrun-sdk against the AgentRun stand-in on
loopback (tests/standins/agentrun.py): the code really runs; errors map to corral's; no
credential or token leaks; nothing reaches Aliyun."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
from pydantic import SecretStr

from corral.providers.agentrun import AgentRunProvider
from corral.providers.base import SandboxHandle, SandboxSpec, SandboxState
from corral.providers.credentials import CredentialResolver, InMemoryCredentialStore
from corral.providers.errors import (
    CredentialMissingError,
    CredentialRejectedError,
    ExecutionOutcomeUnknownError,
    ProviderTimeoutError,
    ProviderUnavailableError,
    RateLimitedError,
    SandboxCreateError,
    TransientProviderError,
)
from tests.standins.agentrun import ACCESS_KEY_ID, ACCESS_KEY_SECRET, ACCOUNT_ID, AgentRunStandin

GOOD_KEY = f"{ACCESS_KEY_ID}:{ACCESS_KEY_SECRET}"
TOKEN = "crt_never-anywhere-but-the-spec"
ADD = (
    "import sys\n"
    "def main(a, b):\n"
    "    print('sum of', a, b)\n"
    "    print('note', file=sys.stderr)\n"
    "    return {'sum': a + b}\n"
)


@pytest.fixture(autouse=True)
def no_vendor_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """Nothing of a developer's Aliyun setup may steer the SDK (or reach Aliyun)."""
    for name in list(os.environ):
        if name.startswith(("AGENTRUN_", "ALIBABA_CLOUD_", "FC_", "CORRAL_AGENTRUN")):
            monkeypatch.delenv(name)


@pytest.fixture
def standin() -> Iterator[AgentRunStandin]:
    with AgentRunStandin() as server:
        yield server


def make_provider(
    standin: AgentRunStandin, key: str | None = GOOD_KEY, **config: object
) -> AgentRunProvider:
    provider = AgentRunProvider(
        {"data_endpoint": standin.endpoint, "account_id": ACCOUNT_ID, **config}
    )
    environ = {"CORRAL_AGENTRUN_API_KEY": key} if key else {}
    provider.use_credentials(CredentialResolver(environ=environ))
    return provider


def spec(sandbox_id: str = "sb-item-1", **fields: object) -> SandboxSpec:
    values: dict[str, object] = {
        "work_item_id": "wi-item",
        "sandbox_id": sandbox_id,
        "org_id": "acme",
        "project_id": "web",
        "registration_token": SecretStr(TOKEN),
        "control_url": "http://127.0.0.1:1",
        "env": {"GREETING": "hello"},
    }
    return SandboxSpec.model_validate(values | fields)


def test_run_code_returns_result_stdout_stderr_and_exit_code(standin: AgentRunStandin) -> None:
    handles: list[SandboxHandle] = []
    run = make_provider(standin).run_code(
        spec(), ADD, {"a": 2, "b": 5}, timeout_s=10, on_execute=handles.append
    )
    assert (run.exit_code, run.result, run.error, run.timed_out) == (0, {"sum": 7}, None, False)
    assert run.stdout == "sum of 2 5\n" and run.stderr == "note\n"
    assert [h.external_id for h in handles] == ["sb-item-1"]  # named by corral's sandbox id
    assert standin.live() == [] and standin.deleted == ["sb-item-1"]  # ended afterwards
    paths = [(r.method, r.path) for r in standin.requests]
    assert paths == [
        ("POST", "/sandboxes"),
        ("GET", "/sandboxes/sb-item-1/health"),
        ("POST", "/sandboxes/sb-item-1/contexts"),
        ("POST", "/sandboxes/sb-item-1/contexts/execute"),
        ("DELETE", "/sandboxes/sb-item-1"),
    ]


def test_the_work_env_reaches_the_code_and_the_token_goes_nowhere(standin: AgentRunStandin) -> None:
    source = (
        "import os\ndef main():\n"
        "    return [os.environ.get(k) for k in ('GREETING', 'CORRAL_REGISTRATION_TOKEN')]\n"
    )
    run = make_provider(standin).run_code(spec(), source, {}, timeout_s=10)
    assert run.result == ["hello", None]
    assert not any(TOKEN in repr(request) for request in standin.requests)


def test_a_failing_main_is_a_non_zero_exit_with_the_error(standin: AgentRunStandin) -> None:
    source = "def main():\n    raise KeyError('missing')\n"
    run = make_provider(standin).run_code(spec(), source, {}, timeout_s=10)
    assert (run.exit_code, run.result) == (1, None)
    assert run.error == "main() raised KeyError: 'missing'"
    assert "KeyError" in run.stderr


def test_code_past_the_limit_is_a_timed_out_run(standin: AgentRunStandin) -> None:
    source = "import time\ndef main():\n    time.sleep(20)\n"
    run = make_provider(standin).run_code(spec(), source, {}, timeout_s=1)
    assert run.timed_out and run.exit_code == 124
    assert standin.live() == []


def test_the_limit_is_capped_at_the_30_second_hard_timeout(standin: AgentRunStandin) -> None:
    make_provider(standin).run_code(spec(), "def main():\n    return 1\n", {}, timeout_s=600)
    [execute] = [r for r in standin.requests if r.path.endswith("/execute")]
    assert execute.body["timeout"] == 30


@pytest.mark.parametrize("status", [401, 403])
def test_a_refused_credential_is_permanent_and_names_how_to_set_it(
    standin: AgentRunStandin, status: int
) -> None:
    standin.fail_next(status, path_contains="/sandboxes")
    with pytest.raises(CredentialRejectedError) as raised:
        make_provider(standin).run_code(spec(), ADD, {"a": 1, "b": 1}, timeout_s=5)
    message = raised.value.message
    assert f"HTTP {status}" in message
    assert "corral credentials set --org acme --provider agentrun" in message
    assert "CORRAL_AGENTRUN_API_KEY" in message
    assert ACCESS_KEY_SECRET not in message and standin.executions() == 0


def test_a_wrong_secret_is_refused_by_the_signature_check(standin: AgentRunStandin) -> None:
    provider = make_provider(standin, key=f"{ACCESS_KEY_ID}:not-the-secret")
    with pytest.raises(CredentialRejectedError, match="SignatureDoesNotMatch"):
        provider.run_code(spec(), ADD, {"a": 1, "b": 1}, timeout_s=5)
    assert "not-the-secret" not in repr(standin.requests)


def test_no_credential_at_all_says_how_to_set_one(standin: AgentRunStandin) -> None:
    with pytest.raises(CredentialMissingError, match="AGENTRUN_ACCESS_KEY_ID"):
        make_provider(standin, key=None).run_code(spec(), ADD, {}, timeout_s=5)
    assert standin.requests == []


def test_the_stored_credential_wins_and_the_vendor_variables_are_the_last_fallback(
    standin: AgentRunStandin, monkeypatch: pytest.MonkeyPatch
) -> None:
    provider = make_provider(standin, key=None)
    monkeypatch.setenv("AGENTRUN_ACCESS_KEY_ID", ACCESS_KEY_ID)
    monkeypatch.setenv("AGENTRUN_ACCESS_KEY_SECRET", ACCESS_KEY_SECRET)
    assert provider.run_code(spec(), ADD, {"a": 1, "b": 2}, timeout_s=5).result == {"sum": 3}
    resolver = CredentialResolver(
        InMemoryCredentialStore(), secret_key="tests-only-key-A1b2C3d4E5f6G7h8J9k0", environ={}
    )
    resolver.put(
        "acme", "agentrun", f'{{"access_key_id": "{ACCESS_KEY_ID}", "access_key_secret": "wrong"}}'
    )
    provider.use_credentials(resolver)
    with pytest.raises(CredentialRejectedError):
        provider.run_code(spec("sb-item-2"), ADD, {"a": 1, "b": 2}, timeout_s=5)


@pytest.mark.parametrize(
    ("status", "error"),
    [
        (429, RateLimitedError),
        (500, ProviderUnavailableError),
        (503, ProviderUnavailableError),
    ],
)
def test_throttling_and_server_errors_before_the_execute_call_are_transient(
    standin: AgentRunStandin, status: int, error: type[TransientProviderError]
) -> None:
    standin.fail_next(status, path_contains="/sandboxes", method="POST")
    with pytest.raises(error):
        make_provider(standin).run_code(spec(), ADD, {"a": 1, "b": 1}, timeout_s=5)
    assert standin.executions() == 0 and standin.live() == []


def test_a_slow_answer_before_the_execute_call_is_a_transient_timeout(
    standin: AgentRunStandin,
) -> None:
    standin.delay_next(3, path_contains="/health")
    provider = make_provider(standin, execute_grace_s=1)
    with pytest.raises(ProviderTimeoutError):
        provider.run_code(spec(), ADD, {"a": 1, "b": 1}, timeout_s=1)
    assert standin.executions() == 0


def test_an_unreachable_api_is_transient() -> None:
    with AgentRunStandin() as gone:
        endpoint = gone.endpoint
    provider = AgentRunProvider({"data_endpoint": endpoint, "account_id": ACCOUNT_ID})
    provider.use_credentials(CredentialResolver(environ={"CORRAL_AGENTRUN_API_KEY": GOOD_KEY}))
    with pytest.raises(ProviderUnavailableError):
        provider.run_code(spec(), ADD, {}, timeout_s=5)


def test_an_error_after_the_execute_call_was_sent_is_final(standin: AgentRunStandin) -> None:
    standin.fail_next(503, path_contains="/contexts/execute")
    with pytest.raises(ExecutionOutcomeUnknownError, match="may have run"):
        make_provider(standin).run_code(spec(), ADD, {"a": 1, "b": 1}, timeout_s=5)
    assert standin.live() == []  # still ended


def test_a_missing_template_is_a_permanent_error_naming_it(standin: AgentRunStandin) -> None:
    provider = make_provider(standin, template_name="no-such-template")
    with pytest.raises(SandboxCreateError, match="no-such-template"):
        provider.run_code(spec(), ADD, {}, timeout_s=5)


def test_an_on_execute_that_refuses_stops_the_run_and_ends_the_sandbox(
    standin: AgentRunStandin,
) -> None:
    def refuse(handle: SandboxHandle) -> None:
        raise RuntimeError("superseded")

    with pytest.raises(RuntimeError, match="superseded"):
        make_provider(standin).run_code(spec(), ADD, {}, timeout_s=5, on_execute=refuse)
    assert standin.executions() == 0 and standin.live() == []


def test_status_terminate_and_health(standin: AgentRunStandin) -> None:
    provider = make_provider(standin)
    handle = SandboxHandle(provider_id="agentrun", external_id="sb-x", metadata={"org_id": "acme"})
    assert provider.status(handle).state is SandboxState.TERMINATED  # unknown: ended
    provider.terminate(handle)  # unknown: done
    assert provider.health_check("acme").healthy
    assert not make_provider(standin, key=None).health_check("acme").healthy
    bad = make_provider(standin, key=f"{ACCESS_KEY_ID}:wrong").health_check("acme")
    assert not bad.healthy and "rejected the AccessKey" in bad.message


def test_provision_is_refused_a_code_interpreter_makes_no_runner_sandbox(
    standin: AgentRunStandin,
) -> None:
    with pytest.raises(SandboxCreateError, match="code interpreter"):
        make_provider(standin).provision(spec())
    assert standin.requests == []
