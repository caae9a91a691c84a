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

Making it needs root, e2fsprogs' ``mkfs.ext4``, util-linux's ``mount`` and loop devices
(``/dev/loop-control``); a root worker without them refuses to provision (the health check
says so) rather than run unbounded, unless the deployment sets ``disk_mb`` to null. A worker
that is not root cannot make one: its sandboxes' work directories are not bounded (the
health check says so), their /tmp is a tmpfs of ``disk_mb`` (memory, charged to the
sandbox's memory group) where bubblewrap takes ``--size``, and their output is bounded as
everywhere (``output``).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import functools
import logging
import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from corral.providers.errors import SandboxCreateError

logger = logging.getLogger(__name__)

# Where the tools are looked for: system directories only.
TOOL_PATH = "/usr/sbin:/sbin:/usr/bin:/bin"
LOOP_CONTROL = "/dev/loop-control"
IMAGE_NAME, MOUNT_NAME = "disk.img", "disk"
# mkfs.ext4 without a journal (nothing of a sandbox's files outlives a crash), reserved
# blocks or room to grow, its inode tables left for the kernel to fill as used: a 10 GiB
# image is made in a few milliseconds and takes under 1 MiB until the sandbox writes.
EXT4_FEATURES = "^has_journal,^resize_inode"
MKFS_OPTIONS = ("-q", "-F", "-m", "0", "-O", EXT4_FEATURES, "-E", "lazy_itable_init=1,nodiscard")
MOUNT_OPTIONS = "loop,nosuid,nodev,noinit_itable"
TOOL_TIMEOUT_S = 60.0
_MNT_DETACH, _UMOUNT_NOFOLLOW = 2, 8


@dataclass(frozen=True)
class DiskTools:
    """How this host bounds a sandbox's disk: the tools, or why it cannot."""

    mkfs: str | None = None
    mount: str | None = None
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
    mount = shutil.which("mount", path=TOOL_PATH)
    if mkfs is None:
        return DiskTools(why_not="mkfs.ext4 is not installed (apt-get install e2fsprogs)")
    if mount is None:
        return DiskTools(why_not="mount is not installed (apt-get install mount)")
    if not os.path.exists(LOOP_CONTROL):
        return DiskTools(why_not=f"this host has no loop devices ({LOOP_CONTROL})")
    return DiskTools(mkfs=mkfs, mount=mount)


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

    def make(
        self, tools: DiskTools, size_bytes: int, work: Path, owner: tuple[int, int] | None
    ) -> None:
        """Make the image, mount it and its work directory at ``work`` (an empty directory),
        owned by ``owner`` (uid, gid) when given.

        Raises:
            SandboxCreateError: a tool or a step failed (its words in the message); what
                was mounted stays for :meth:`release`, which the provider's terminate calls.
        """
        try:
            self._make(tools, size_bytes, work, owner)
        except OSError as exc:
            raise SandboxCreateError(f"making the sandbox's disk: {exc}") from exc

    def _make(
        self, tools: DiskTools, size_bytes: int, work: Path, owner: tuple[int, int] | None
    ) -> None:
        assert tools.mkfs is not None and tools.mount is not None
        with open(os.open(self.image, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "wb") as f:
            f.truncate(size_bytes)
        _run([tools.mkfs, *MKFS_OPTIONS, str(self.image)], "making the sandbox's disk image")
        self.mountpoint.mkdir(mode=0o700)
        _run(
            [tools.mount, "-t", "ext4", "-o", MOUNT_OPTIONS, str(self.image), str(self.mountpoint)],
            "mounting the sandbox's disk image",
        )
        os.chmod(self.mountpoint, 0o700)  # the image's root: the sandbox sees two of its folders
        self.work.mkdir()
        self.tmp.mkdir()
        os.chmod(self.tmp, 0o1777)  # noqa: S103 - a /tmp, open to all as a /tmp is
        if owner is not None:
            os.chown(self.work, *owner)
        _run([tools.mount, "--bind", str(self.work), str(work)], "mounting the work directory")

    def release(self, work: Path) -> None:
        """Unmount the work directory and the image (lazily: at once from the host, for
        good once no process uses them), if they are mounted; the image file is then an
        ordinary file, removed with the sandbox's directory."""
        for target in (work, self.mountpoint):
            if os.path.ismount(target):
                _unmount(target)


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


@functools.cache
def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


def _unmount(target: Path) -> None:
    """Detach the mount at ``target`` (never a link's target); one already gone is fine."""
    if _libc().umount2(os.fsencode(target), _MNT_DETACH | _UMOUNT_NOFOLLOW) == 0:
        return
    code = ctypes.get_errno()
    if code not in (errno.EINVAL, errno.ENOENT):  # not (or no longer) a mount point
        logger.warning("could not unmount %s: %s", target, os.strerror(code))


def unmount_below(root: Path) -> None:
    """Unmount whatever is mounted at or below ``root``, deepest first (what sandboxes left
    mounted in a directory that goes away, e.g. a test's)."""
    prefix = os.path.realpath(root)
    points: list[str] = []
    with contextlib.suppress(OSError), open("/proc/self/mounts", encoding="utf-8") as mounts:
        points = [line.split()[1].replace("\\040", " ") for line in mounts]
    below = [p for p in points if p == prefix or p.startswith(prefix + os.sep)]
    for point in sorted(set(below), key=len, reverse=True):
        _unmount(Path(point))
