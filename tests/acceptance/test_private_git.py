"""A private git repository checked out with a named secret, through real processes (api,
scheduler, local worker, maintenance, beat; bubblewrap sandboxes) against git http-backend
behind HTTPS and Basic auth on the tests' outside address: the checkout gets the
repository, the work gets neither the secret (it reads every file, environment and command
line it can) nor the repository again once the runner has withdrawn the credential, whether
the repository's host is one of allowed_hosts or reached for the checkout alone."""

from __future__ import annotations

import base64
import json
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from corral.runner.egress import GIT_CREDENTIAL_PLACEHOLDER
from tests.acceptance.conftest import shell
from tests.acceptance.private_redis import PrivateRedis
from tests.acceptance.stack import OUTSIDE_ADDRESS, Stack, running_stack
from tests.git_repos import bare_repository
from tests.tls_servers import SECRET_SCAN, LoopbackCa, private_git_server


@pytest.fixture(scope="module")
def ca(tmp_path_factory: pytest.TempPathFactory) -> LoopbackCa:
    return LoopbackCa(tmp_path_factory.mktemp("ca"))


@pytest.fixture(scope="module")
def stack(
    postgres_database_url: str, module_redis: PrivateRedis, ca: LoopbackCa
) -> Iterator[Stack]:
    """A stack whose provider worker trusts the tests' CA for destinations."""
    with running_stack(
        postgres_database_url, module_redis.url, CORRAL_EGRESS_UPSTREAM_CA_FILE=str(ca.ca_file)
    ) as running:
        yield running


def _work(url: str, secret: str) -> str:
    """What the work does: shows the checkout, fetches the repository again as the checkout
    did (the credential's placeholder named), then looks everywhere for the secret."""
    basic = base64.b64encode(f"x-access-token:{secret}".encode()).decode()
    needles = " ".join(f"scan={value.encode().hex()}" for value in (secret, basic))
    header = f"http.extraHeader=Authorization: {GIT_CREDENTIAL_PLACEHOLDER}"
    return (
        "cat a.txt\n"
        f"if git -c '{header}' fetch -q '{url}' main; then echo refetch=fetched; "
        "else echo refetch=failed; fi\n"
        f"python3 - {needles} <<'SCAN'\n{SECRET_SCAN}\nSCAN\n"
    )


def _log(stack: Stack, item_id: str) -> str:
    status, logs = stack.request("GET", f"/v1/work-items/{item_id}/logs")
    assert status == 200, logs
    return "\n".join(line["line"] for line in logs["lines"])


def test_a_private_repository_is_checked_out_and_its_credential_is_gone_after(
    stack: Stack, ca: LoopbackCa, tmp_path: Path
) -> None:
    org = stack.make_org(f"git-{uuid.uuid4().hex[:8]}")
    secret = f"ghs_{uuid.uuid4().hex}"
    stored = stack.request("PUT", f"/v1/admin/orgs/{org}/secrets/gh-token", {"value": secret})
    assert stored[0] == 200, stored
    bare, commit = bare_repository(tmp_path)
    with private_git_server(ca, bare.parent, secret, OUTSIDE_ADDRESS) as (port, seen):
        url = f"https://{OUTSIDE_ADDRESS}:{port}/{bare.name}"
        git = {"url": url, "ref": "main", "secret": "gh-token"}
        egresses = {
            # Every host allowed: after the checkout the work reaches the server, without
            # the credential (it trusts the server's CA itself, to get that far).
            "open": {"allow_network": True, "ca_cert_pem": ca.pem.decode()},
            # The repository's host not allowed: reached for the checkout's requests alone.
            "closed": {"allow_network": True, "allowed_hosts": [f"{OUTSIDE_ADDRESS}:1"]},
        }
        ids = {}
        for name, egress in egresses.items():
            message = shell(org, _work(url, secret), egress=egress, inputs={"git": git})
            status, body = stack.request("POST", "/v1/dispatch", message)
            assert status == 202, body
            ids[name] = body["id"]
        unknown = shell(
            org, "true", egress=egresses["open"], inputs={"git": {**git, "secret": "nope"}}
        )
        refused = stack.request("POST", "/v1/dispatch", unknown)[1]
        views = stack.wait_final(list(ids.values()), timeout_s=180)
    assert [v["state"] for v in views] == ["succeeded", "succeeded"], views
    assert refused["state"] == "dispatch_error", refused
    assert refused["error"]["code"] == "unknown_secret"
    assert "inputs.git.secret" in refused["error"]["message"]
    logs = {name: _log(stack, item_id) for name, item_id in ids.items()}
    for text in logs.values():
        assert "a one" in text and "input: the checkout's credential is withdrawn" in text, text
        assert "refetch=failed" in text, text
        assert not [line for line in text.splitlines() if line.startswith("found=")], text
        assert int(text.rsplit("\nscanned=", 1)[1].split(maxsplit=1)[0]) > 50, text
    basic = "Basic " + base64.b64encode(f"x-access-token:{secret}".encode()).decode()
    with_secret = [(method, target) for method, target, auth in seen if auth == basic]
    assert sorted(set(with_secret)) == [
        ("GET", "/repo.git/info/refs?service=git-upload-pack"),
        ("POST", "/repo.git/git-upload-pack"),
    ]
    # After the checkout: the open item's fetch reached the server with the placeholder
    # alone (and was refused); the closed item's never left the sandbox's proxy.
    after = [auth for _, _, auth in seen if auth != basic]
    assert after and set(after) == {GIT_CREDENTIAL_PLACEHOLDER}, seen
    uses = stack.request("GET", f"/v1/work-items/{ids['open']}/secret-uses")[1]["uses"]
    assert [(u["name"], u["scope"], u["used_in"]) for u in uses] == [("gh-token", "org", "git")]
    answers = json.dumps([views, logs, uses, stored])
    assert secret not in answers and basic not in answers
    for name in stack.processes:
        text = stack.log_path(name).read_text(errors="replace")
        assert secret not in text and basic.split()[1] not in text, name
    assert commit  # the repository the checkout got: a.txt's "a one" above is its content
