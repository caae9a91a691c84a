"""How much of its host's disk a local sandbox can take: a filesystem image of its own.

Under a root worker each isolated sandbox with a bound (``disk_mb``) writes only to an ext4
image of that size, sparse (it takes on the host what the sandbox wrote, never more than its
size), made and mounted when the sandbox is made and removed with it::

    <root>/<sandbox_id>/disk.img    the image (root's, 0600)
    <root>/<sandbox_id>/disk/       where it is mounted (loop, nosuid, nodev)
    <root>/<sandbox_id>/disk/work   bind-mounted at <root>/<sandbox_id>/work: the work
                                    directory and its home, at the same path on the host
                                    (file transfers) as in the sandbox
    <root>/<sandbox_id>/disk/tmp    the sandbox's /tmp (bubblewrap binds it)

So whatever the sandbox does there (one big file, many, reserved blocks, /tmp, its home) it
gets ENOSPC at the bound, and the host's disk holds at most the image. bubblewrap sees only
``work`` and ``tmp`` of it. Nothing of the image is in memory but the page cache, which the
kernel charges to the sandbox's memory group.

An image is a copy of a template formatted once per size (``<root>/.disk-templates``, root's,
0700): its few written blocks (about 120 KiB of a 10 GiB image) are copied, its holes left
holes, which costs a fraction of a millisecond where ``mkfs.ext4`` took 10-20 ms of every
provision. Every image of a size is then the same filesystem, UUID and directory hash seed
included; a sandbox sees only its own, and its files only through it. The image is mounted
and its work directory bound by the kernel's own calls (``mounts``), no tool started. The
format has no backup superblocks and one flex group: the fewer extents an image has, the
fewer discards its removal waits for on a host that mounts its disk with ``discard``.

Making it needs root, e2fsprogs' ``mkfs.ext4`` and loop devices (``/dev/loop-control``); a
root worker without them refuses to provision (the health check says so) rather than run
unbounded, unless the deployment sets ``disk_mb`` to null. A worker that is not root cannot
make one: its sandboxes' work directories are not bounded (the health check says so), their
/tmp is a tmpfs of ``disk_mb`` (memory, charged to the sandbox's memory group) where
bubblewrap takes ``--size``, and their output is bounded as everywhere (``output``).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import functools
import hashlib
import os
import shutil
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from corral.providers.errors import SandboxCreateError
from corral.providers.local import mounts

# Where the tools are looked for: system directories only.
TOOL_PATH = "/usr/sbin:/sbin:/usr/bin:/bin"
LOOP_CONTROL = "/dev/loop-control"
IMAGE_NAME, MOUNT_NAME = "disk.img", "disk"
TEMPLATES = ".disk-templates"
# mkfs.ext4 without a journal (nothing of a sandbox's files outlives a crash), reserved
# blocks, room to grow or backup superblocks, all groups' tables in one flex group, its inode
# tables left for the kernel to fill as used: a 10 GiB image holds about 120 KiB in 4 extents.
EXT4_FEATURES = "^has_journal,^resize_inode,sparse_super2"
MKFS_OPTIONS = (
    *("-q", "-F", "-m", "0", "-G", "1024", "-O", EXT4_FEATURES),
    *("-E", "num_backup_sb=0,lazy_itable_init=1,nodiscard"),
)
MOUNT_FLAGS, MOUNT_DATA = mounts.MS_NOSUID | mounts.MS_NODEV, "noinit_itable,nobarrier"
# Names a template by its format: another format (a new corral) makes a template of its own.
FORMAT_ID = hashlib.sha256(" ".join(MKFS_OPTIONS).encode()).hexdigest()[:12]
TOOL_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class DiskTools:
    """How this host bounds a sandbox's disk: the tools, or why it cannot."""

    mkfs: str | None = None
    why_not: str = ""

    @property
    def usable(self) -> bool:
        return not self.why_not


@functools.cache
def find_disk_tools() -> DiskTools:
    """What this host has for a filesystem image per sandbox (found once)."""
    if os.geteuid() != 0:
        return DiskTools(why_not="the worker is not root (mounting an image needs root)")
    mkfs = shutil.which("mkfs.ext4", path=TOOL_PATH)
    if mkfs is None:
        return DiskTools(why_not="mkfs.ext4 is not installed (apt-get install e2fsprogs)")
    if not os.path.exists(LOOP_CONTROL):
        return DiskTools(why_not=f"this host has no loop devices ({LOOP_CONTROL})")
    return DiskTools(mkfs=mkfs)


def disk_template(tools: DiskTools, root: Path, size_bytes: int) -> Path:
    """The formatted image of ``size_bytes`` that sandboxes' images are copied from, made
    the first time one is asked for (under a lock: one maker per host at a time) and
    renamed into place whole, so that none is ever seen half made.

    Raises:
        SandboxCreateError: ``mkfs.ext4`` failed (its words in the message).
    """
    directory = root / TEMPLATES
    template = directory / f"ext4-{size_bytes}-{FORMAT_ID}.img"
    if template.exists():
        return template
    try:
        directory.mkdir(mode=0o700, exist_ok=True)
        with _locked(directory / ".lock"):
            if not template.exists():
                _make_template(tools, template, size_bytes)
    except OSError as exc:
        raise SandboxCreateError(f"making the sandboxes' disk template: {exc}") from exc
    return template


def _make_template(tools: DiskTools, template: Path, size_bytes: int) -> None:
    assert tools.mkfs is not None
    for stale in template.parent.glob("*.tmp"):  # a maker killed mid-way: under the lock
        stale.unlink(missing_ok=True)
    making = template.with_name(f"{template.name}.{os.getpid()}.tmp")
    with open(os.open(making, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "wb") as image:
        image.truncate(size_bytes)
    _run([tools.mkfs, *MKFS_OPTIONS, str(making)], "making the sandboxes' disk template")
    with open(making, "rb") as image:
        os.fsync(image.fileno())  # whole on the disk before its name says it is
    os.replace(making, template)


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    with open(os.open(path, os.O_WRONLY | os.O_CREAT, 0o600), "wb") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


@dataclass(frozen=True)
class SandboxDisk:
    """The paths of one sandbox's image (see the module's docstring)."""

    box: Path

    @property
    def image(self) -> Path:
        return self.box / IMAGE_NAME

    @property
    def mountpoint(self) -> Path:
        return self.box / MOUNT_NAME

    @property
    def work(self) -> Path:
        return self.mountpoint / "work"

    @property
    def tmp(self) -> Path:
        return self.mountpoint / "tmp"

    def make(self, template: Path, work: Path, owner: tuple[int, int] | None) -> None:
        """Make the image as a copy of ``template``, mount it and its work directory at
        ``work`` (an empty directory), owned by ``owner`` (uid, gid) when given.

        Raises:
            SandboxCreateError: a step failed (the kernel's words in the message); what
                was mounted stays for :meth:`release`, which the provider's terminate calls.
        """
        try:
            self._make(template, work, owner)
        except OSError as exc:
            raise SandboxCreateError(f"making the sandbox's disk: {exc}") from exc

    def _make(self, template: Path, work: Path, owner: tuple[int, int] | None) -> None:
        copy_sparse(template, self.image)
        self.mountpoint.mkdir(mode=0o700)
        mounts.mount_image(
            self.image, self.mountpoint, control=LOOP_CONTROL, flags=MOUNT_FLAGS, data=MOUNT_DATA
        )
        os.chmod(self.mountpoint, 0o700)  # the image's root: the sandbox sees two of its folders
        self.work.mkdir()
        self.tmp.mkdir()
        os.chmod(self.tmp, 0o1777)  # noqa: S103 - a /tmp, open to all as a /tmp is
        if owner is not None:
            os.chown(self.work, *owner)
        mounts.bind(self.work, work)

    def release(self, work: Path) -> None:
        """Unmount the work directory and the image (lazily: at once from the host, for
        good once no process uses them), if they are mounted; the image file is then an
        ordinary file, removed with the sandbox's directory."""
        for target in (work, self.mountpoint):
            if os.path.ismount(target):
                mounts.unmount(target)


def copy_sparse(source: Path, target: Path) -> None:
    """A new file ``target`` (0600) with ``source``'s size and bytes, whose holes stay holes:
    only the data ``source`` holds is copied (in the kernel, where it can).

    Raises:
        OSError: ``target`` exists, or reading or writing failed.
    """
    with (
        open(source, "rb") as reading,
        open(os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "wb") as writing,
    ):
        size = os.fstat(reading.fileno()).st_size
        writing.truncate(size)
        for start, end in _data_ranges(reading.fileno(), size):
            _copy_range(reading.fileno(), writing.fileno(), start, end)


def _data_ranges(fd: int, size: int) -> Iterator[tuple[int, int]]:
    """The (start, end) ranges of ``fd`` that hold data, hole by hole."""
    offset = 0
    while offset < size:
        try:
            start = os.lseek(fd, offset, os.SEEK_DATA)
        except OSError as exc:
            if exc.errno == errno.ENXIO:  # no data past offset
                return
            raise
        end = os.lseek(fd, start, os.SEEK_HOLE)
        yield start, end
        offset = end


def _copy_range(source: int, target: int, start: int, end: int) -> None:
    position = start
    while position < end:
        try:
            copied = os.copy_file_range(source, target, end - position, position, position)
        except OSError as exc:
            if exc.errno not in (errno.EXDEV, errno.ENOSYS, errno.EOPNOTSUPP, errno.EINVAL):
                raise
            chunk = os.pread(source, min(end - position, 1 << 20), position)
            copied = os.pwrite(target, chunk, position)
        if copied == 0:
            raise OSError(errno.EIO, "the template ended before its size")
        position += copied


def _run(argv: list[str], doing: str) -> None:
    """Run a tool of the host's with a fixed environment.

    Raises:
        SandboxCreateError: it failed or did not finish in time, with its words.
    """
    try:
        done = subprocess.run(
            argv,
            capture_output=True,
            text=True,
            timeout=TOOL_TIMEOUT_S,
            env={"PATH": TOOL_PATH, "LC_ALL": "C"},
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise SandboxCreateError(f"{doing}: {exc}") from exc
    if done.returncode != 0:
        words = (done.stderr or done.stdout).strip()[-500:]
        raise SandboxCreateError(f"{doing}: {Path(argv[0]).name} failed: {words}")


def unmount_below(root: Path) -> None:
    """Unmount whatever is mounted at or below ``root``, deepest first (what sandboxes left
    mounted in a directory that goes away, e.g. a test's)."""
    prefix = os.path.realpath(root)
    points: list[str] = []
    with contextlib.suppress(OSError), open("/proc/self/mounts", encoding="utf-8") as mounted:
        points = [line.split()[1].replace("\\040", " ") for line in mounted]
    below = [p for p in points if p == prefix or p.startswith(prefix + os.sep)]
    for point in sorted(set(below), key=len, reverse=True):
        mounts.unmount(Path(point))
