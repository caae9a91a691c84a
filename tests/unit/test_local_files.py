"""The local provider's file transfer opens nothing by name from the host: links, ``..``,
absolute paths, magic links, FIFOs and directories in a real directory tree, with openat2
and with the walk it falls back to; and a process swapping a directory for a link meanwhile."""

from __future__ import annotations

import errno
import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from corral.providers.errors import SandboxFileNotFoundError, SandboxPathError
from corral.providers.local import files as local_files
from corral.providers.local.files import KERNEL, WorkDirectory, open_beneath
from tests.conftest import require

SECRET = b"outside the work directory"
INSIDE = b"inside the work directory"


@dataclass
class Tree:
    """A work directory, a directory beside it holding a secret, and where downloads go."""

    work: Path
    outside: Path
    downloads: Path

    @property
    def files(self) -> WorkDirectory:
        return WorkDirectory(self.work)

    def source(self, data: bytes = INSIDE) -> Path:
        path = self.downloads.parent / "upload-source"
        path.write_bytes(data)
        return path

    def download(self, path: str, max_bytes: int = 1 << 20) -> bytes:
        target = self.downloads / "file"
        self.files.download(path, target, max_bytes)
        return target.read_bytes()

    def outside_untouched(self) -> bool:
        return [p.name for p in self.outside.iterdir()] == ["secret"] and (
            self.outside / "secret"
        ).read_bytes() == SECRET


@pytest.fixture(params=["openat2", "walk"])
def opening(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Each test twice: with openat2 (where this kernel has it), and with the walk."""
    if request.param == "openat2":
        require(KERNEL.openat2, "openat2 (Linux 5.6 or later, x86_64 or aarch64)")
    monkeypatch.setattr(KERNEL, "openat2", request.param == "openat2")
    return str(request.param)


@pytest.fixture
def tree(tmp_path: Path, opening: str) -> Tree:
    work, outside, downloads = (tmp_path / name for name in ("work", "outside", "downloads"))
    for directory in (work, outside, downloads):
        directory.mkdir()
    (outside / "secret").write_bytes(SECRET)
    (work / "dir").mkdir()
    (work / "dir" / "file.txt").write_bytes(INSIDE)
    return Tree(work, outside, downloads)


def test_files_round_trip_making_the_directories_on_the_way(tree: Tree) -> None:
    tree.files.upload(tree.source(b"made"), "new/deeper/file.bin")
    assert tree.download("new/deeper/file.bin") == b"made"
    assert tree.download("dir/file.txt") == INSIDE
    assert tree.download(f"{tree.work}/dir/file.txt") == INSIDE  # its own absolute path
    assert tree.download("./dir//file.txt") == INSIDE


@pytest.mark.parametrize("path", ["link/secret", "link/new.txt", "link/sub/new.txt"])
def test_a_symlinked_parent_is_refused_both_ways(tree: Tree, path: str) -> None:
    (tree.work / "link").symlink_to(tree.outside)
    with pytest.raises(SandboxPathError, match="symbolic link"):
        tree.files.upload(tree.source(), path)
    with pytest.raises(SandboxPathError, match="symbolic link"):
        tree.download(path)
    assert tree.outside_untouched()
    assert not (tree.downloads / "file").exists()


def test_a_link_as_the_last_name_is_refused_and_an_upload_replaces_the_link(tree: Tree) -> None:
    (tree.work / "secret").symlink_to(tree.outside / "secret")
    with pytest.raises(SandboxPathError, match="symbolic link"):
        tree.download("secret")
    tree.files.upload(tree.source(b"replaced"), "secret")
    assert not (tree.work / "secret").is_symlink()
    assert (tree.work / "secret").read_bytes() == b"replaced"
    assert tree.outside_untouched()


def test_an_upload_over_a_hard_link_never_writes_through_it(tree: Tree) -> None:
    os.link(tree.outside / "secret", tree.work / "hard")
    tree.files.upload(tree.source(b"replaced"), "hard")
    assert (tree.work / "hard").read_bytes() == b"replaced"
    assert (tree.outside / "secret").read_bytes() == SECRET


def test_an_upload_keeps_the_permission_bits_of_the_file_it_replaces(tree: Tree) -> None:
    script = tree.work / "run.sh"
    script.write_bytes(b"old")
    script.chmod(0o750)
    tree.files.upload(tree.source(b"new"), "run.sh")
    assert (script.read_bytes(), script.stat().st_mode & 0o777) == (b"new", 0o750)


@pytest.mark.parametrize(
    "path", ["../outside/secret", "dir/../../outside/secret", "dir/..", "/etc/passwd", "a\0b"]
)
def test_dot_dot_and_absolute_paths_elsewhere_are_refused(tree: Tree, path: str) -> None:
    with pytest.raises(SandboxPathError):
        tree.files.upload(tree.source(), path)
    with pytest.raises(SandboxPathError):
        tree.download(path)
    assert tree.outside_untouched()
    assert sorted(p.name for p in tree.work.iterdir()) == ["dir"]


def test_magic_links_are_never_followed(tree: Tree) -> None:
    (tree.work / "self").symlink_to("/proc/self")
    with pytest.raises(SandboxPathError, match="symbolic link"):
        tree.download("self/environ")
    # Beneath a descriptor of /proc/self itself, its magic links (root, cwd, fd/N) and
    # the mount below (procfs is one) are refused too.
    proc = os.open("/proc/self", os.O_RDONLY | os.O_DIRECTORY)
    try:
        for names in (["root", "etc", "passwd"], ["cwd"], ["fd", str(proc)]):
            with pytest.raises(OSError) as refused:
                os.close(open_beneath(proc, names, os.O_RDONLY))
            assert refused.value.errno in (errno.ELOOP, errno.EXDEV), names
    finally:
        os.close(proc)


def test_a_fifo_is_refused_at_once(tree: Tree) -> None:
    os.mkfifo(tree.work / "pipe")
    started = time.monotonic()
    with pytest.raises(SandboxPathError, match="not a regular file"):
        tree.download("pipe")
    assert time.monotonic() - started < 5  # not waited on for a writer


def test_directories_are_no_files(tree: Tree) -> None:
    for path in ("dir", ".", str(tree.work)):
        with pytest.raises(SandboxPathError, match="is a directory"):
            tree.download(path)
    with pytest.raises(SandboxPathError, match="is a directory"):
        tree.files.upload(tree.source(), "dir")
    with pytest.raises(SandboxPathError, match="not a directory"):
        tree.files.upload(tree.source(), "dir/file.txt/below")
    with pytest.raises(SandboxPathError, match="names the work directory"):
        tree.files.upload(tree.source(), ".")
    assert sorted(p.name for p in (tree.work / "dir").iterdir()) == ["file.txt"]


def test_a_missing_file_is_its_own_error(tree: Tree) -> None:
    with pytest.raises(SandboxFileNotFoundError, match=re.escape("'no/such.txt'")) as missing:
        tree.download("no/such.txt")
    assert isinstance(missing.value, FileNotFoundError)
    assert str(tree.work) not in str(missing.value)  # the caller's path, never the host's


def test_what_an_upload_makes_is_the_sandbox_users(tree: Tree) -> None:
    require(os.geteuid() == 0, "root, to give files to another user")
    files = WorkDirectory(tree.work, (12345, 23456))
    files.upload(tree.source(), "dir/made/file.txt")
    owners = {
        path: ((tree.work / path).stat().st_uid, (tree.work / path).stat().st_gid)
        for path in ("dir", "dir/made", "dir/made/file.txt")
    }
    assert owners == {
        "dir": (0, 0),  # there before: left as it was
        "dir/made": (12345, 23456),
        "dir/made/file.txt": (12345, 23456),
    }


def test_a_kernel_without_openat2_falls_back_to_the_walk(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(KERNEL, "openat2", True)
    monkeypatch.setattr(local_files, "SYS_OPENAT2", 4000)  # no such system call: ENOSYS
    (tmp_path / "file").write_bytes(INSIDE)
    (tmp_path / "link").symlink_to(tmp_path)
    root = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        opened = open_beneath(root, ["file"], os.O_RDONLY)
        assert os.read(opened, 100) == INSIDE
        os.close(opened)
        assert KERNEL.openat2 is False  # noticed once, for good
        with pytest.raises(OSError) as refused:
            open_beneath(root, ["link", "file"], os.O_RDONLY)
        assert refused.value.errno == errno.ELOOP
    finally:
        os.close(root)


# Exchanges the directory `swap` with the link `link` (to the directory outside) over and
# over, atomically, for argv[1] seconds.
SWAPPER = """
import ctypes, os, sys, time
libc = ctypes.CDLL(None, use_errno=True)
end = time.monotonic() + float(sys.argv[1])
open("swapping", "w").close()
while time.monotonic() < end:
    if libc.renameat2(-100, b"swap", -100, b"link", 2) != 0:
        sys.exit(os.strerror(ctypes.get_errno()))
"""


@pytest.fixture
def swapping(tree: Tree) -> Iterator[subprocess.Popen[bytes]]:
    (tree.work / "swap").mkdir()
    (tree.work / "swap" / "secret").write_bytes(INSIDE)
    (tree.work / "link").symlink_to(tree.outside)
    swapper = subprocess.Popen([sys.executable, "-c", SWAPPER, "3"], cwd=tree.work)
    try:
        while not (tree.work / "swapping").exists():
            assert swapper.poll() is None, "the swapper ended before it swapped"
            time.sleep(0.01)
        yield swapper
    finally:
        swapper.kill()
        swapper.wait()


def test_a_directory_swapped_for_a_link_meanwhile_never_leads_outside(
    tree: Tree, swapping: subprocess.Popen[bytes]
) -> None:
    read, refused = 0, 0
    while swapping.poll() is None:
        try:
            assert tree.download("swap/secret") == INSIDE
            tree.files.upload(tree.source(), f"swap/new-{read}/file")
            read += 1
        except (SandboxPathError, SandboxFileNotFoundError):
            refused += 1
    assert swapping.returncode == 0
    assert read > 0 and refused > 0, (read, refused)
    assert tree.outside_untouched()
