"""Result bundles through real processes and real local sandboxes (bubblewrap): a git input
served over HTTP on the tests' outside address, the work's changes coming back as a bundle,
written out with `corral bundle`, reviewed (naming the digest read, with the review scope),
and the limits and refusals."""

from __future__ import annotations

import functools
import hashlib
import http.server
import io
import json
import re
import shutil
import socket
import subprocess
import tarfile
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.acceptance.conftest import shell
from tests.acceptance.stack import CORRAL, OUTSIDE_ADDRESS, Stack, free_port
from tests.git_repos import bare_repository

GIT = shutil.which("git")


@pytest.fixture
def git_server(tmp_path: Path) -> Iterator[tuple[str, str]]:
    """A repository (a.txt, b.txt, c.txt on main) served over plain HTTP ("dumb" protocol)
    on the tests' outside address, which a sandbox reaches through corral's egress proxy:
    its http:// URL and its commit."""
    if GIT is None:
        pytest.fail("git is not installed")
    bare, commit = bare_repository(tmp_path)
    subprocess.run([GIT, "update-server-info"], cwd=bare, check=True)
    handler = functools.partial(QuietFiles, directory=str(bare.parent))
    server = http.server.ThreadingHTTPServer((OUTSIDE_ADDRESS, 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://{OUTSIDE_ADDRESS}:{server.server_address[1]}/repo.git", commit
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


class QuietFiles(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: object) -> None:
        return


def _await_port(port: int, timeout_s: float = 10) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


@pytest.fixture(scope="module")
def bundles_org(stack: Stack) -> str:
    """An org of this module's own (the session's database is shared with other modules)."""
    return stack.make_org("bundles")


def dispatch(stack: Stack, message: dict[str, Any]) -> dict[str, Any]:
    status, body = stack.request("POST", "/v1/dispatch", message)
    assert status == 202, body
    [view] = stack.wait_final([body["id"]])
    return view


def download(stack: Stack, item_id: str) -> tuple[dict[str, Any], dict[str, bytes]]:
    request = urllib.request.Request(f"{stack.api_url}/v1/work-items/{item_id}/bundle")
    request.add_header("Authorization", f"Bearer {stack.admin_token}")
    with urllib.request.urlopen(request, timeout=10) as answer:
        data = answer.read()
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:gz") as tar:
        members = {m.name: tar.extractfile(m).read() for m in tar if m.isreg()}  # type: ignore[union-attr]
    return json.loads(members.pop("manifest.json")), members


def downloaded_sha256(stack: Stack, item_id: str) -> str:
    """The digest the download of the item's bundle names (that of the bytes it sends)."""
    request = urllib.request.Request(f"{stack.api_url}/v1/work-items/{item_id}/bundle")
    request.add_header("Authorization", f"Bearer {stack.admin_token}")
    with urllib.request.urlopen(request, timeout=10) as answer:
        digest = answer.headers["X-Corral-Bundle-Sha256"]
        assert digest == hashlib.sha256(answer.read()).hexdigest()
    return str(digest)


def corral(stack: Stack, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*CORRAL, *args], check=False, env=stack.env, capture_output=True, text=True, timeout=60
    )


def test_a_git_checkout_is_the_base_and_the_changes_come_back_to_corral_bundle(
    stack: Stack, bundles_org: str, git_server: tuple[str, str], tmp_path: Path
) -> None:
    url, commit = git_server
    work = "sed -i 's/one/ONE/' a.txt && echo three >> b.txt && echo new > new.txt"
    message = shell(bundles_org, work, inputs={"git": {"url": url, "ref": "main"}}, bundle=True)
    message["egress"] = {"allow_network": True}  # the server stands for the outside world
    view = dispatch(stack, message)
    assert view["state"] == "succeeded", view
    assert view["bundle"]["changes"] == 3 and view["bundle"]["review"] == "not_required"
    manifest, members = download(stack, view["id"])
    assert manifest["base"] == {"kind": "git", "url": url, "ref": "main", "commit": commit}
    assert [(e["path"], e["operation"]) for e in manifest["entries"]] == [
        ("a.txt", "modify"),
        ("b.txt", "modify"),
        ("new.txt", "add"),
    ]
    patch = members[manifest["entries"][0]["patch"]].decode()
    assert "-a one\n+a ONE\n" in patch  # relative to the checkout
    out = tmp_path / "out"
    written = corral(stack, "bundle", view["id"], "-o", str(out))
    assert written.returncode == 0, written.stderr
    assert sorted(p.name for p in out.iterdir()) == ["a.txt", "b.txt", "new.txt"]
    assert (out / "a.txt").read_text() == "a ONE\na two\n"
    assert (out / "b.txt").read_text() == "b one\nb two\nthree\n"
    assert "3 changes (1 added, 2 modified, 0 deleted)" in written.stdout


def test_a_checkout_that_fails_fails_the_item_input_failed(stack: Stack, bundles_org: str) -> None:
    url = f"git://127.0.0.1:{free_port()}/missing.git"  # nothing listens there
    message = shell(bundles_org, "true", inputs={"git": {"url": url, "ref": "main"}})
    message["egress"] = {"allow_network": True}
    view = dispatch(stack, message)
    assert view["state"] == "failed" and view["error"]["code"] == "input_failed", view
    assert (
        f"`git fetch` failed with exit code 128 while checking out main of {url}"
        in (view["error"]["message"])
    )


def test_a_symlink_to_etc_passwd_is_left_out_and_named(stack: Stack, bundles_org: str) -> None:
    view = dispatch(
        stack, shell(bundles_org, "ln -s /etc/passwd leak && echo hi > ok.txt", bundle=True)
    )
    assert view["state"] == "succeeded", view
    manifest, members = download(stack, view["id"])
    assert manifest["refused"] == [
        {"path": "leak", "reason": "a symlink pointing outside the workspace"}
    ]
    assert [e["path"] for e in manifest["entries"]] == ["ok.txt"]
    assert set(members) == {"files/ok.txt", "patches/0001.diff"}
    assert all(b"root:" not in data for data in members.values())


def test_a_101_mb_bundle_fails_bundle_too_large_at_the_default_limit(
    stack: Stack, bundles_org: str
) -> None:
    view = dispatch(stack, shell(bundles_org, "head -c 101000000 /dev/zero > big.bin", bundle=True))
    assert view["state"] == "failed", view
    assert view["error"]["code"] == "bundle_too_large"
    assert "more than the limit of 100000000 bytes" in view["error"]["message"]
    assert view["bundle"] is None


def test_a_reviewed_bundle_is_held_until_accepted_with_the_cli(
    stack: Stack, bundles_org: str, tmp_path: Path
) -> None:
    views = [
        dispatch(stack, shell(bundles_org, f"echo {n} > f{n}.txt", review={"required": True}))
        for n in range(2)
    ]
    for view in views:
        assert view["state"] == "succeeded" and view["bundle"]["review"] == "review_requested"
    item_id, other_id = views[0]["id"], views[1]["id"]
    held = corral(stack, "bundle", item_id, "-o", str(tmp_path / "held"))
    assert held.returncode == 1 and "accept it first" in held.stderr
    unnamed = corral(stack, "bundle", "accept", item_id)
    assert unnamed.returncode == 2 and "--sha256 DIGEST" in unnamed.stderr
    shown = corral(stack, "bundle", item_id)
    found = re.search(r"^  sha256 ([0-9a-f]{64})$", shown.stdout, re.MULTILINE)
    assert found is not None, shown.stdout
    accepted = corral(stack, "bundle", "accept", item_id, "--sha256", found.group(1))
    assert accepted.returncode == 0, accepted.stderr
    show = corral(stack, "show", item_id)
    assert "review accepted" in show.stdout
    assert "- -> review_requested  by runner" in show.stdout
    assert "review_requested -> accepted  by cli" in show.stdout
    written = corral(stack, "bundle", item_id, "-o", str(tmp_path / "out"))
    assert written.returncode == 0 and (tmp_path / "out" / "f0.txt").read_text() == "0\n"
    # Over HTTP: the key that dispatches may not review; a review key names what it read.
    reject = f"/v1/work-items/{other_id}/bundle/reject"
    keys = {}
    for scope in ("dispatch", "review"):
        made = {"name": f"{scope} key", "scopes": [scope]}
        status, body = stack.request("POST", f"/v1/admin/orgs/{bundles_org}/keys", made)
        assert status == 201, body
        keys[scope] = body["key"]
    seen = {"sha256": downloaded_sha256(stack, other_id)}
    status, body = stack.request("POST", reject, seen, token=keys["dispatch"])
    assert status == 403 and "review scope" in body["detail"], body
    status, body = stack.request("POST", reject, {"sha256": "0" * 64}, token=keys["review"])
    assert (status, body["error"]) == (409, "bundle_changed"), body
    status, body = stack.request("POST", reject, seen, token=keys["review"])
    assert (status, body["review"]) == (200, "rejected")
    status, events = stack.request("GET", f"/v1/work-items/{other_id}/events")
    assert [(e["to"], e["actor"]) for e in events["events"] if e["entity"] == "bundle"] == [
        ("review_requested", "runner"),
        ("rejected", "api"),
    ]
    assert corral(stack, "bundle", other_id, "-o", str(tmp_path / "no")).returncode == 1
