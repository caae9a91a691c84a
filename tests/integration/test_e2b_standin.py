"""The E2B stand-in, driven only through the official ``e2b`` SDK: proof that it answers what
the SDK sends the way the SDK expects, before corral's e2b provider is tested against it."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import httpx
import pytest
from e2b import (
    AuthenticationException,
    CommandExitException,
    RateLimitException,
    Sandbox,
    SandboxException,
    SandboxNotFoundException,
    SandboxNotRunningException,
    SandboxQuery,
    SandboxState,
    ServiceBusyException,
    TimeoutException,
)

from tests.standins.e2b import CommandCall, CommandOutcome, E2BStandin


@pytest.fixture
def standin() -> Iterator[E2BStandin]:
    with E2BStandin() as running:
        yield running


@pytest.fixture
def kw(standin: E2BStandin) -> dict[str, Any]:
    return standin.sdk_kwargs()


def create(kw: dict[str, Any], **options: Any) -> Sandbox:
    return Sandbox.create(template=options.pop("template", "base"), **options, **kw)


def listed(kw: dict[str, Any], query: SandboxQuery | None = None) -> set[str]:
    return {info.sandbox_id for info in Sandbox.list(query=query, **kw).next_items()}


def test_create_stores_template_envs_metadata_and_timeout(
    standin: E2BStandin, kw: dict[str, Any]
) -> None:
    sandbox = create(
        kw,
        template="corral-agent",
        envs={"CORRAL_TOKEN": "tok-1"},
        metadata={"corral.item": "it-1"},
        timeout=120,
    )
    stored = standin.sandbox(sandbox.sandbox_id)
    assert (stored.template_id, stored.state, stored.timeout) == ("corral-agent", "running", 120)
    assert stored.envs == {"CORRAL_TOKEN": "tok-1"}
    assert stored.metadata == {"corral.item": "it-1"}
    assert stored.end_at - stored.started_at == timedelta(seconds=120)
    (sent,) = standin.requests(method="POST", path="/v2/sandboxes")
    assert sent.body["envVars"] == {"CORRAL_TOKEN": "tok-1"}
    assert sent.headers["x-api-key"] == "<redacted>"
    assert sent.status == 201


def test_get_info_reads_back_what_create_stored(kw: dict[str, Any]) -> None:
    sandbox = create(kw, template="corral-agent", metadata={"corral.item": "it-2"}, timeout=60)
    info = Sandbox.get_info(sandbox.sandbox_id, **kw)
    assert info == sandbox.get_info()
    assert (info.sandbox_id, info.template_id, info.name) == (
        sandbox.sandbox_id,
        "corral-agent",
        "corral-agent",
    )
    assert info.metadata == {"corral.item": "it-2"}
    assert info.state is SandboxState.RUNNING
    assert info.end_at - info.started_at == timedelta(seconds=60)
    assert abs(info.started_at - datetime.now(UTC)) < timedelta(seconds=5)
    assert (info.cpu_count, info.memory_mb, info.envd_version) == (2, 512, "0.6.4")


def test_list_by_metadata_returns_the_matching_sandboxes_only(kw: dict[str, Any]) -> None:
    blue = create(kw, metadata={"corral.deployment": "blue", "item": "1"})
    green = create(kw, metadata={"corral.deployment": "green"})
    odd = create(kw, metadata={"a key": "x&y=z"})
    assert listed(kw, SandboxQuery(metadata={"corral.deployment": "blue"})) == {blue.sandbox_id}
    assert listed(kw, SandboxQuery(metadata={"corral.deployment": "red"})) == set()
    assert listed(kw, SandboxQuery(metadata={"a key": "x&y=z"})) == {odd.sandbox_id}
    assert listed(kw) == {blue.sandbox_id, green.sandbox_id, odd.sandbox_id}


def test_list_by_state_tells_paused_from_running(kw: dict[str, Any]) -> None:
    running, paused = create(kw), create(kw)
    paused.pause()
    assert listed(kw, SandboxQuery(state=[SandboxState.PAUSED])) == {paused.sandbox_id}
    assert listed(kw, SandboxQuery(state=[SandboxState.RUNNING])) == {running.sandbox_id}


def test_list_pages_with_the_next_token(kw: dict[str, Any]) -> None:
    first, second = create(kw), create(kw)
    pager = Sandbox.list(limit=1, **kw)
    pages, more = [], []
    while pager.has_next:
        pages.append([info.sandbox_id for info in pager.next_items()])
        more.append(pager.has_next)
    assert pages == [[second.sandbox_id], [first.sandbox_id]]  # newest first without `order`
    assert more == [True, False]


def test_known_templates_resolve_to_their_id_and_unknown_ones_are_a_404() -> None:
    with E2BStandin(templates={"corral-agent": "tmpl0corral0agent"}) as standin:
        kw = standin.sdk_kwargs()
        info = create(kw, template="corral-agent").get_info()
        assert (info.template_id, info.name) == ("tmpl0corral0agent", "corral-agent")
        with pytest.raises(SandboxException, match="template 'nope' not found") as raised:
            create(kw, template="nope")
        assert raised.value.status_code == 404


def test_echo_prints_its_arguments_and_exits_zero(kw: dict[str, Any]) -> None:
    result = create(kw).commands.run("echo hello corral")
    assert (result.stdout, result.stderr, result.exit_code) == ("hello corral\n", "", 0)


@pytest.mark.parametrize(
    ("command", "code", "stderr"),
    [
        ("exit 3", 3, ""),
        ('sh -c "exit 7"', 7, ""),
        ("no-such-tool --flag", 127, "bash: line 1: no-such-tool: command not found\n"),
    ],
)
def test_a_non_zero_exit_raises_command_exit_exception_with_the_code(
    kw: dict[str, Any], command: str, code: int, stderr: str
) -> None:
    with pytest.raises(CommandExitException) as raised:
        create(kw).commands.run(command)
    assert (raised.value.exit_code, raised.value.stderr) == (code, stderr)


def test_a_handler_sees_the_command_its_envs_cwd_user_and_the_sandbox_envs(
    standin: E2BStandin, kw: dict[str, Any]
) -> None:
    calls: list[CommandCall] = []

    def handler(call: CommandCall) -> CommandOutcome:
        calls.append(call)
        return CommandOutcome(stdout="ran\n", stderr="warn\n")

    standin.on_command(handler)
    sandbox = create(kw, envs={"CORRAL_TOKEN": "tok-2"})
    result = sandbox.commands.run(
        "corral-run --item 1", envs={"STEP": "build"}, cwd="/workspace", user="root", timeout=30
    )
    assert (result.stdout, result.stderr) == ("ran\n", "warn\n")
    (call,) = calls
    assert (call.sandbox_id, call.cmd, call.cwd, call.user) == (
        sandbox.sandbox_id,
        "corral-run --item 1",
        "/workspace",
        "root",
    )
    assert (call.envs, call.sandbox_envs) == ({"STEP": "build"}, {"CORRAL_TOKEN": "tok-2"})
    assert call.environment == {"CORRAL_TOKEN": "tok-2", "STEP": "build"}
    assert call.timeout_ms == 30_000
    assert standin.sandbox(sandbox.sandbox_id).commands == [call]


def test_envd_gets_the_envd_token_and_never_the_api_key(
    standin: E2BStandin, kw: dict[str, Any]
) -> None:
    sandbox = create(kw)
    sandbox.commands.run("true")
    (start,) = standin.requests(surface="envd")
    assert start.path == "/process.Process/Start"
    assert start.headers["e2b-sandbox-id"] == sandbox.sandbox_id
    assert start.headers["x-access-token"] == standin.sandbox(sandbox.sandbox_id).envd_access_token
    assert start.headers["content-type"] == "application/connect+json"
    assert "x-api-key" not in start.headers
    assert start.body["process"]["args"] == ["-l", "-c", "true"]


def test_a_handler_may_answer_with_a_tuple(standin: E2BStandin, kw: dict[str, Any]) -> None:
    standin.on_command(lambda call: ("", "boom\n", 2))
    with pytest.raises(CommandExitException) as raised:
        create(kw).commands.run("anything")
    assert (raised.value.exit_code, raised.value.stderr) == (2, "boom\n")


def test_a_command_outliving_its_timeout_raises_timeout(
    standin: E2BStandin, kw: dict[str, Any]
) -> None:
    standin.on_command(lambda call: CommandOutcome(duration=5))
    with pytest.raises(TimeoutException):
        create(kw).commands.run("sleep 5", timeout=0.3)


def test_pause_then_connect_resumes(standin: E2BStandin, kw: dict[str, Any]) -> None:
    sandbox = create(kw)
    assert sandbox.pause() is True
    assert sandbox.get_info().state is SandboxState.PAUSED
    assert sandbox.pause() is False  # already paused: the API's 409
    with pytest.raises(SandboxNotRunningException):
        sandbox.commands.run("echo asleep")
    resumed = Sandbox.connect(sandbox.sandbox_id, timeout=90, **kw)
    assert resumed.get_info().state is SandboxState.RUNNING
    assert standin.sandbox(sandbox.sandbox_id).timeout == 90
    assert resumed.commands.run("echo awake").stdout == "awake\n"


def test_set_timeout_moves_the_end(standin: E2BStandin, kw: dict[str, Any]) -> None:
    sandbox = create(kw, timeout=60)
    sandbox.set_timeout(900)
    info = sandbox.get_info()
    assert standin.sandbox(sandbox.sandbox_id).timeout == 900
    assert abs(info.end_at - datetime.now(UTC) - timedelta(seconds=900)) < timedelta(seconds=5)


def test_kill_then_kill_again_reports_not_found(standin: E2BStandin, kw: dict[str, Any]) -> None:
    sandbox = create(kw)
    assert sandbox.kill() is True
    assert Sandbox.kill(sandbox.sandbox_id, **kw) is False
    with pytest.raises(SandboxNotFoundException):
        sandbox.get_info()
    assert sandbox.is_running() is False
    assert standin.ended() == [sandbox.sandbox_id]


def test_a_finished_or_timed_out_sandbox_is_gone(standin: E2BStandin, kw: dict[str, Any]) -> None:
    finished, timed_out = create(kw, timeout=600), create(kw, timeout=60)
    assert standin.finish(finished.sandbox_id) is True
    standin.advance(61)
    for sandbox in (finished, timed_out):
        with pytest.raises(SandboxNotFoundException):
            sandbox.get_info()
    assert listed(kw) == set()


def test_a_wrong_api_key_is_an_authentication_exception(
    standin: E2BStandin, kw: dict[str, Any]
) -> None:
    with pytest.raises(AuthenticationException, match="Invalid API key"):
        create({**kw, "api_key": "e2b_wrong"})
    (refused,) = standin.requests()
    assert (refused.status, refused.headers["x-api-key"]) == (401, "<redacted>")
    assert standin.sandboxes() == {}


def test_a_single_429_is_retried_by_the_sdk(standin: E2BStandin, kw: dict[str, Any]) -> None:
    standin.fail_next(429, path="/v2/sandboxes")
    create(kw)
    assert [r.status for r in standin.requests(path="/v2/sandboxes")] == [429, 201]


def test_a_persistent_429_is_a_rate_limit_exception(
    standin: E2BStandin, kw: dict[str, Any]
) -> None:
    standin.fail_next(429, times=None, method="POST")
    with pytest.raises(RateLimitException):
        create(kw)
    assert [r.status for r in standin.requests()] == [429] * 4  # the SDK retries three times


@pytest.mark.parametrize("status", [403, 500])
def test_an_api_error_is_a_sandbox_exception_carrying_the_status(
    standin: E2BStandin, kw: dict[str, Any], status: int
) -> None:
    sandbox = create(kw)
    standin.fail_next(status, method="GET", path="/sandboxes/", message="injected")
    with pytest.raises(SandboxException, match="injected") as raised:
        sandbox.get_info()
    assert raised.value.status_code == status


def test_a_503_marked_not_retryable_is_service_busy(
    standin: E2BStandin, kw: dict[str, Any]
) -> None:
    standin.fail_next(503, headers={"Should-Retry": "false"})
    with pytest.raises(ServiceBusyException):
        create(kw)
    assert len(standin.requests()) == 1


def test_a_request_held_past_request_timeout_times_out(
    standin: E2BStandin, kw: dict[str, Any]
) -> None:
    sandbox = create(kw)
    standin.delay_next(3, path=f"/sandboxes/{sandbox.sandbox_id}")
    started = time.monotonic()
    with pytest.raises(httpx.TimeoutException):  # the SDK lets REST timeouts through as httpx's
        sandbox.get_info(request_timeout=0.3)
    assert time.monotonic() - started < 2
    assert sandbox.get_info().state is SandboxState.RUNNING


def test_a_502_from_the_sandbox_proxy_is_sandbox_not_running(
    standin: E2BStandin, kw: dict[str, Any]
) -> None:
    sandbox = create(kw)
    standin.fail_next(502, path="/process.Process/Start")
    with pytest.raises(SandboxNotRunningException):
        sandbox.commands.run("echo lost")


def test_stop_leaves_no_thread_or_listening_port() -> None:
    # Other stand-ins (e.g. the session fixture) may be running: only this one's count.
    before = set(threading.enumerate())
    started = time.monotonic()
    standin = E2BStandin().start()
    assert time.monotonic() - started < 1
    ports = [int(url.rsplit(":", 1)[1]) for url in (standin.api_url, standin.sandbox_url)]
    assert [t for t in set(threading.enumerate()) - before if t.name.startswith("e2b-standin")]
    standin.stop()
    assert not [t for t in set(threading.enumerate()) - before if t.name.startswith("e2b-standin")]
    for port in ports:
        with pytest.raises(ConnectionRefusedError), socket.create_connection(("127.0.0.1", port)):
            pass
