"""The runner's workspace step: a git input checked out between install and post_acquire,
the snapshot it makes the base of the bundle, and the refusals (no git, a failed fetch)."""

from __future__ import annotations

import io
import json
import os
import tarfile
from pathlib import Path
from typing import Any

import pytest

from corral.runner.errors import ControlError
from corral.runner.phases import run_work_phase
from corral.runner.protocol import BundleLimits, Claim, Completion, GitInput, ShellWork, parse_claim
from corral.runner.snapshot import take_snapshot
from corral.runner.steps import Cancellation
from corral.runner.workspace import Workspace
from tests.git_repos import bare_repository


class Uploads:
    """Stands in for the control client: keeps each uploaded bundle's manifest."""

    def __init__(self) -> None:
        self.manifests: list[dict[str, Any]] = []

    def upload_bundle(self, archive: str) -> None:
        with tarfile.open(archive, "r:gz") as tar:
            member = tar.extractfile("manifest.json")
            assert member is not None
            self.manifests.append(json.load(io.TextIOWrapper(member)))


def run(claim: Claim, workspace: Workspace, path: str | None = None) -> Any:
    lines: list[str] = []
    env = {"PATH": path if path is not None else os.environ["PATH"], "HOME": workspace.root}
    done = run_work_phase(
        claim,
        base_env=env,
        sink=lambda stream, line: lines.append(line),
        cancellation=Cancellation(),
        prepare_workspace=workspace.prepare,
    )
    return done, lines


def test_the_checkout_is_the_base_of_the_bundle(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    bare, commit = bare_repository(tmp_path)
    url = f"file://{bare}"
    workspace_dir = tmp_path / "ws"
    workspace_dir.mkdir()
    monkeypatch.chdir(workspace_dir)
    claim = Claim(
        work_item_id="wi-1",
        work=ShellWork("echo changed > a.txt && echo d > d.txt"),
        post_acquire=("test -f b.txt",),  # the checkout is there before post_acquire
        bundle=BundleLimits(),
        git_input=GitInput(url=url, ref="main"),
    )
    workspace = Workspace(claim, root=str(workspace_dir))
    done, lines = run(claim, workspace)
    assert done.succeeded, (done, lines)
    uploads = Uploads()
    assert workspace.finish(done, uploads, lambda s, line: None) == done  # type: ignore[arg-type]
    [manifest] = uploads.manifests
    assert manifest["base"] == {"kind": "git", "url": url, "ref": "main", "commit": commit}
    assert [(e["path"], e["operation"]) for e in manifest["entries"]] == [
        ("a.txt", "modify"),
        ("d.txt", "add"),
    ]


def test_no_git_or_a_failed_fetch_fails_the_input_phase(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    claim = Claim(
        work_item_id="wi-1",
        work=ShellWork("touch ran"),
        git_input=GitInput(url=f"file://{tmp_path}/missing.git", ref="main"),
    )
    done, _ = run(claim, Workspace(claim, root=str(tmp_path)), path="/nonexistent")
    assert (done.phase, done.exit_code) == ("input", 1)
    assert "git is not installed in the sandbox" in done.error
    done, _ = run(claim, Workspace(claim, root=str(tmp_path)))
    assert done.phase == "input" and "`git fetch` failed with exit code 128" in done.error
    assert not (tmp_path / "ran").exists()  # the work never ran


def test_the_claim_says_the_bundle_limits_and_the_input() -> None:
    body = {
        "work_item_id": "wi-1",
        "work": {"kind": "shell", "command": "true"},
        "bundle": {"max_bytes": 10, "max_manifest_bytes": 5, "max_patches": 1},
        "inputs": {"git": {"url": "file:///r.git", "ref": "main"}},
    }
    claim = parse_claim(body)
    assert claim.bundle == BundleLimits(10, 5, 1)
    assert claim.git_input == GitInput("file:///r.git", "main")
    plain = parse_claim({**body, "bundle": None, "inputs": None})
    assert plain.bundle is None and plain.git_input is None


def test_a_cancelled_work_sends_no_bundle(tmp_path: Path) -> None:
    claim = Claim(work_item_id="wi-1", work=ShellWork("true"), bundle=BundleLimits())
    workspace = Workspace(claim, root=str(tmp_path))
    workspace.base = take_snapshot(str(tmp_path), keep_texts=True)
    (tmp_path / "new.txt").write_text("x")
    uploads, notes = Uploads(), []
    cancelled = Completion(-15, "work", error="cancelled", cancelled=True)
    kept = workspace.finish(cancelled, uploads, lambda stream, line: notes.append(line))  # type: ignore[arg-type]
    assert kept == cancelled and uploads.manifests == []
    assert notes == ["bundle: not collected, the work was cancelled"]


class Refusing:
    """A control client whose upload answers ``status``."""

    def __init__(self, status: int) -> None:
        self.status = status

    def upload_bundle(self, archive: str) -> None:
        raise ControlError(f"PUT /v1/runner/bundle answered {self.status}", status=self.status)


@pytest.mark.parametrize(
    ("status", "code", "words"),
    [(413, "bundle_too_large", "the api refused the bundle"), (404, None, "could not upload")],
)
def test_an_upload_the_api_refuses_fails_a_work_that_succeeded(
    tmp_path: Path, status: int, code: str | None, words: str
) -> None:
    claim = Claim(work_item_id="wi-1", work=ShellWork("true"), bundle=BundleLimits())
    workspace = Workspace(claim, root=str(tmp_path))
    workspace.base = take_snapshot(str(tmp_path), keep_texts=True)
    (tmp_path / "new.txt").write_text("x")
    done = workspace.finish(Completion(0, "work"), Refusing(status), lambda s, line: None)  # type: ignore[arg-type]
    assert not done.succeeded and done.error_code == code and words in (done.error or "")
    failed = Completion(2, "work", error="work failed with exit code 2")
    assert workspace.finish(failed, Refusing(status), lambda s, line: None) == failed  # type: ignore[arg-type]
