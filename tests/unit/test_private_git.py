"""A private git input: the message names a secret (https:// alone), routing sends it only
where corral's egress proxy runs, the worker makes it a checkout binding scoped to that
repository's fetch, and the runner names its placeholder and withdraws it once fetched,
failing the input (the work never runs) when it cannot."""

from __future__ import annotations

import base64
import socket
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from corral.providers.base import Egress, SecretBinding
from corral.providers.egress.plan import proxy_config
from corral.runner.egress import GIT_CREDENTIAL_PLACEHOLDER
from corral.runner.protocol import Claim, GitInput, ShellWork, parse_claim
from corral.runner.workspace import Workspace, fetch_argv
from corral.scheduler.errors import NoEligiblePoolError
from corral.scheduler.routing import Routed, route
from corral.shared.messages import DispatchRequest
from corral.shared.messages import GitInput as GitInputRequest
from corral.shared.store.models import AuthMode
from corral.worker.checkout_credential import GIT_CREDENTIAL, basic_credential, checkout_binding
from tests.git_repos import bare_repository
from tests.unit.test_egress_message import pool
from tests.unit.test_runner_workspace import run


def _message(git: dict[str, Any]) -> dict[str, Any]:
    return {
        "org": "acme",
        "project": "web",
        "profile": "default",
        "work": {"kind": "shell", "command": "true"},
        "egress": {"allow_network": True},
        "inputs": {"git": {"ref": "main", **git}},
    }


@pytest.mark.parametrize(
    ("url", "words"),
    [
        ("http://git.example.test/o/r.git", "needs an https:// URL"),
        ("ssh://git@git.example.test/o/r.git", "needs an https:// URL"),
        ("https://git.example.test/o/r git", "a URL path of letters"),
        ("https://git.example.test/o/r\u00e9.git", "a URL path of letters"),
        ("https://user:pw@git.example.test/o/r.git", "must not carry credentials"),
    ],
)
def test_a_secret_is_given_to_https_urls_of_plain_paths_alone(url: str, words: str) -> None:
    with pytest.raises(ValidationError) as raised:
        DispatchRequest.model_validate(_message({"url": url, "secret": "gh-token"}))
    assert words in str(raised.value)


def test_the_secret_is_one_of_the_messages_references() -> None:
    request = DispatchRequest.model_validate(
        _message({"url": "https://git.example.test/o/r.git", "secret": "gh-token"})
    )
    assert request.secret_refs == {"inputs.git.secret": "gh-token"}


NO_PROXY = ["kubernetes", "e2b", "modal", "daytona", "vercel", "agentrun"]


@pytest.mark.parametrize("provider", NO_PROXY)
def test_a_private_git_input_goes_only_where_the_egress_proxy_runs(provider: str) -> None:
    request = DispatchRequest.model_validate(
        _message({"url": "https://git.example.test/o/r.git", "secret": "gh-token"})
    )
    with pytest.raises(NoEligiblePoolError) as raised:
        route(request, AuthMode.BYOK, [pool(provider)], {})
    assert "inputs.git.secret (the credential is put in by corral's egress proxy" in str(
        raised.value
    )
    for served in ("local", "docker"):
        assert isinstance(route(request, AuthMode.BYOK, [pool(served)], {}), Routed)


@pytest.mark.parametrize("provider", NO_PROXY)
def test_an_https_binding_goes_only_where_the_egress_proxy_runs(provider: str) -> None:
    host = "api.example.test:443"
    message = _message({"url": "https://git.example.test/o/r.git"})
    message["egress"] = {
        "allow_network": True,
        "allowed_hosts": [host],
        "secret_bindings": {"API_TOKEN": {"host": host, "value": "v", "header": "Authorization"}},
    }
    request = DispatchRequest.model_validate(message)
    with pytest.raises(NoEligiblePoolError) as raised:
        route(request, AuthMode.BYOK, [pool(provider)], {})
    assert "egress.secret_bindings (they need corral's egress proxy" in str(raised.value)


def test_the_checkout_binding_is_that_repositorys_fetch_alone() -> None:
    git = GitInputRequest(url="https://Git.Example.test/o/r.git/", ref="main", secret="t")
    binding = checkout_binding(git, "tok3n")
    assert binding.host == "Git.Example.test:443"
    assert binding.header == "Authorization"
    assert binding.checkout_requests == (
        ("GET", "/o/r.git/info/refs?service=git-upload-pack"),
        ("POST", "/o/r.git/git-upload-pack"),
    )
    expected = base64.b64encode(b"x-access-token:tok3n").decode()
    assert binding.value.get_secret_value() == f"Basic {expected}"
    assert (
        basic_credential("me:app-password")
        == "Basic " + base64.b64encode(b"me:app-password").decode()
    )
    on_port = checkout_binding(GitInputRequest(url="https://10.0.0.1:8443/r", ref="m"), "t")
    assert (
        on_port.host == "10.0.0.1:8443" and on_port.checkout_requests[1][1] == "/r/git-upload-pack"
    )
    # The proxy's configuration: the binding's requests, its host lower case; no variable
    # in the sandbox, whose placeholder is the one the runner names.
    egress = Egress(allow_network=True, secret_bindings={GIT_CREDENTIAL: binding})
    [configured] = proxy_config(egress, log_path=None, exit_after_s=None)["bindings"]
    assert configured["host"] == "git.example.test" and configured["port"] == 443
    assert configured["checkout_requests"] == [list(pair) for pair in binding.checkout_requests]
    assert configured["placeholder"] == GIT_CREDENTIAL_PLACEHOLDER
    assert SecretBinding.placeholder_for(GIT_CREDENTIAL) == GIT_CREDENTIAL_PLACEHOLDER
    assert egress.sandbox_env() == {} and egress.proxied


@pytest.fixture
def proxy_socket(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[list[bytes]]:
    """A stand-in for the egress proxy's socket: the requests it gets, answered 200."""
    path = tmp_path / "proxy.sock"
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(str(path))
    listener.listen(4)
    heard: list[bytes] = []

    def serve() -> None:
        while True:
            try:
                connection, _ = listener.accept()
            except OSError:
                return
            with connection:
                heard.append(connection.recv(4096))
                connection.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n")

    threading.Thread(target=serve, daemon=True).start()
    monkeypatch.setenv("CORRAL_EGRESS_PROXY_SOCKET", str(path))
    yield heard
    listener.close()


def _claim(url: str) -> Claim:
    return Claim(
        work_item_id="wi-1",
        work=ShellWork("touch ran"),
        git_input=GitInput(url=url, ref="main", credential=True),
    )


def test_the_runner_withdraws_the_credential_once_fetched_before_anything_else_runs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, proxy_socket: list[bytes]
) -> None:
    bare, _ = bare_repository(tmp_path)
    work = tmp_path / "ws"
    work.mkdir()
    monkeypatch.chdir(work)
    claim = _claim(f"file://{bare}")
    done, lines = run(claim, Workspace(claim, root=str(work)))
    assert done.succeeded, (done, lines)
    assert [request.split(b"\r\n")[0] for request in proxy_socket] == [
        b"POST /corral/checkout-done HTTP/1.1"
    ]
    assert "input: the checkout's credential is withdrawn" in lines
    # A failed fetch withdraws it too.
    missing = _claim(f"file://{tmp_path}/missing.git")
    failed, _ = run(missing, Workspace(missing, root=str(work)))
    assert failed.phase == "input" and "`git fetch` failed" in failed.error
    assert len(proxy_socket) == 2


def test_a_credential_that_cannot_be_withdrawn_fails_the_input(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    bare, _ = bare_repository(tmp_path)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("CORRAL_EGRESS_PROXY_SOCKET", str(tmp_path / "nobody-listens.sock"))
    claim = _claim(f"file://{bare}")
    done, _ = run(claim, Workspace(claim, root=str(tmp_path)))
    assert done.phase == "input" and "could not be withdrawn" in done.error
    assert not (tmp_path / "ran").exists()  # the work never ran


def test_git_names_the_placeholder_and_the_claim_says_a_credential_is_there() -> None:
    argv = fetch_argv(GitInput("https://h/r.git", "main", credential=True))
    assert argv[:3] == [
        "git",
        "-c",
        f"http.extraHeader=Authorization: {GIT_CREDENTIAL_PLACEHOLDER}",
    ]
    assert "-c" not in fetch_argv(GitInput("https://h/r.git", "main"))
    body = {
        "work_item_id": "wi-1",
        "work": {"kind": "shell", "command": "true"},
        "inputs": {"git": {"url": "https://h/r.git", "ref": "main", "secret": "gh-token"}},
    }
    assert parse_claim(body).git_input == GitInput("https://h/r.git", "main", credential=True)
