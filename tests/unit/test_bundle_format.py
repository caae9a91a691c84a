"""Result bundles: the runner's snapshot, diff and archive, and the control plane's reading
of an archive, whoever made it (hand-made ones included)."""

from __future__ import annotations

import hashlib
import io
import tarfile
from pathlib import Path
from typing import Any

import pytest

from corral.runner.bundle import BundleTooLargeError as RunnerTooLarge
from corral.runner.bundle import build_bundle
from corral.runner.protocol import BundleLimits as RunnerLimits
from corral.runner.snapshot import take_snapshot
from corral.shared.store.bundles import (
    BundleInvalidError,
    BundleLimits,
    BundleTooLargeError,
    read_bundle,
)
from tests.bundle_archives import archive, file_entry, manifest

LIMITS = BundleLimits(max_bytes=1_000_000, max_manifest_bytes=100_000, max_patches=10)


def workspace(root: Path) -> None:
    (root / "src").mkdir()
    (root / "src" / "a.txt").write_text("one\ntwo\nthree\n")
    (root / "b.txt").write_text("keep\n")
    (root / "gone.bin").write_bytes(b"\x00\x01")
    (root / "same.txt").write_text("unchanged\n")


def read(path: str, limits: BundleLimits = LIMITS) -> tuple[Any, dict[str, bytes]]:
    members: dict[str, bytes] = {}

    class Keep(io.BytesIO):
        def __init__(self, name: str) -> None:
            super().__init__()
            self.name_ = name

        def close(self) -> None:
            members[self.name_] = self.getvalue()
            super().close()

    with open(path, "rb") as source:
        contents = read_bundle(source, limits, lambda entry, name: Keep(name))
    return contents, members


def test_the_bundle_holds_exactly_what_changed_with_diffs_and_files(tmp_path: Path) -> None:
    workspace(tmp_path)
    base = take_snapshot(str(tmp_path), keep_texts=True)
    (tmp_path / "src" / "a.txt").write_text("one\n2\nthree\n")
    (tmp_path / "b.txt").write_text("keep\nmore\n")
    (tmp_path / "new.txt").write_text("fresh\n")
    (tmp_path / "gone.bin").unlink()
    (tmp_path / "run.sh").write_text("#!/bin/sh\n")
    (tmp_path / "run.sh").chmod(0o755)
    bundle = build_bundle(base, base_info={"kind": "workspace"}, limits=RunnerLimits())
    contents, members = read(bundle.path)
    entries = {e.path: e for e in contents.manifest.entries}
    assert {p: e.operation for p, e in entries.items()} == {
        "src/a.txt": "modify",
        "b.txt": "modify",
        "new.txt": "add",
        "gone.bin": "delete",
        "run.sh": "add",
    }
    assert members["files/src/a.txt"] == b"one\n2\nthree\n"
    assert entries["new.txt"].sha256 == hashlib.sha256(b"fresh\n").hexdigest()
    assert entries["run.sh"].mode == 0o755 and entries["gone.bin"].file is None
    patch = members[entries["src/a.txt"].patch or ""].decode()
    assert "--- a/src/a.txt" in patch and "-two\n+2\n" in patch
    assert "+++ b/new.txt" in members[entries["new.txt"].patch or ""].decode()
    assert entries["gone.bin"].patch is None  # binary: no diff
    assert contents.manifest.base == {"kind": "workspace"}
    assert not Path(bundle.path).is_relative_to(tmp_path)  # never inside the workspace


def test_a_symlink_out_of_the_workspace_is_refused_and_named(tmp_path: Path) -> None:
    base = take_snapshot(str(tmp_path), keep_texts=True)
    (tmp_path / "leak").symlink_to("/etc/passwd")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "up").symlink_to("../..")
    (tmp_path / "inner").symlink_to("sub")
    bundle = build_bundle(base, base_info={}, limits=RunnerLimits())
    contents, members = read(bundle.path)
    refused = {r.path: r.reason for r in contents.manifest.refused}
    assert refused == {
        "leak": "a symlink pointing outside the workspace",
        "sub/up": "a symlink pointing outside the workspace",
    }
    [inner] = contents.manifest.entries
    assert (inner.path, inner.type, inner.target) == ("inner", "symlink", "sub")
    assert b"root:" not in b"".join(members.values())


def test_changes_over_a_limit_are_refused_naming_it(tmp_path: Path) -> None:
    base = take_snapshot(str(tmp_path), keep_texts=True)
    (tmp_path / "big.bin").write_bytes(b"\x00" * 5000)
    with pytest.raises(RunnerTooLarge, match="more than the limit of 4000 bytes"):
        build_bundle(base, base_info={}, limits=RunnerLimits(max_bytes=4000))
    for number in range(3):
        (tmp_path / f"t{number}.txt").write_text("x\n")
    with pytest.raises(RunnerTooLarge, match="more than 2 text files"):
        build_bundle(base, base_info={}, limits=RunnerLimits(max_patches=2))


def test_the_git_directory_is_not_part_of_the_workspace(tmp_path: Path) -> None:
    (tmp_path / ".git").mkdir()
    base = take_snapshot(str(tmp_path), keep_texts=True)
    (tmp_path / ".git" / "index").write_bytes(b"changed")
    (tmp_path / "lib").mkdir()
    (tmp_path / "lib" / ".git").mkdir()
    (tmp_path / "lib" / ".git" / "HEAD").write_text("x")
    assert build_bundle(base, base_info={}, limits=RunnerLimits()).changes == 0


# -- hand-made archives ------------------------------------------------------------------


def test_a_good_hand_made_bundle_is_read() -> None:
    contents = read_bundle(
        archive([manifest(file_entry("a/b.txt", b"hi")), ("files/a/b.txt", b"hi")]), LIMITS
    )
    assert contents.content_bytes > 2 and contents.counts()["add"] == 1


@pytest.mark.parametrize(
    ("members", "words"),
    [
        ([manifest(file_entry("../x", b"hi")), ("files/../x", b"hi")], "manifest is invalid"),
        ([manifest(file_entry("/etc/x", b"hi"))], "manifest is invalid"),
        ([manifest(file_entry("x/.git/hooks/post-checkout", b"#!"))], "manifest is invalid"),
        ([manifest(), ("files/../../etc/cron.d/x", b"hi")], "path leaves the bundle"),
        ([manifest(), ("/abs", b"hi")], "path leaves the bundle"),
        ([manifest(file_entry("x", b"hi")), ("files/x", b"ho")], "size or sha256"),
        ([manifest(), ("files/extra", b"hi")], "not named by the manifest"),
        ([manifest(file_entry("x", b"hi"))], "members the manifest names are missing"),
        ([("files/x", b"hi")], "first member must be manifest.json"),
        ([], "no manifest.json"),
    ],
)
def test_a_hand_made_bundle_that_breaks_the_format_is_refused(
    members: list[tuple[str, bytes]], words: str
) -> None:
    with pytest.raises(BundleInvalidError, match=words):
        read_bundle(archive(list(members)), LIMITS)


def test_link_and_device_members_are_refused() -> None:
    link = tarfile.TarInfo("files/x")
    link.type, link.linkname = tarfile.SYMTYPE, "/etc/passwd"
    with pytest.raises(BundleInvalidError, match="not a regular file"):
        read_bundle(archive([manifest(), link]), LIMITS)
    entry = file_entry("x", b"", type="symlink", target="../../etc", file=None)
    with pytest.raises(BundleInvalidError, match="points outside the workspace"):
        read_bundle(archive([manifest(entry)]), LIMITS)


def test_a_small_archive_that_inflates_past_the_limit_is_refused_as_it_is_read() -> None:
    data = b"\x00" * 2_000_000  # 2 MB of zeros: a few kB compressed
    source = archive([manifest(file_entry("z", data)), ("files/z", data)])
    assert len(source.getvalue()) < 20_000
    with pytest.raises(BundleTooLargeError, match="limit of 1000000 bytes"):
        read_bundle(source, LIMITS)


def test_not_a_gzipped_tar_is_refused() -> None:
    with pytest.raises(BundleInvalidError, match="not a readable gzipped tar"):
        read_bundle(io.BytesIO(b"PK\x03\x04 not a tar"), LIMITS)
