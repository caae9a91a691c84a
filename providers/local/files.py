"""A local sandbox's work directory as the host reaches files in it: never by name.

The sandbox's processes change its work directory while the host opens a path in it: a
directory on the way can become a symbolic link (to a host directory, or to ``/proc/self``)
between any check and the open. So nothing here resolves a path from the host's root. Every
path is opened beneath a descriptor of the work directory, with ``openat2(2)`` refusing
symbolic links, magic links, other mounts and escapes for the whole path at once
(``RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS | RESOLVE_NO_XDEV``). On a
kernel without it (before 5.6: ``ENOSYS``) the path is walked one name at a time, each
opened with ``O_NOFOLLOW`` relative to the directory before it, on the work directory's
filesystem only.

Every failure is a provider error naming the path the caller gave, never a host path:
:class:`~corral.providers.errors.SandboxFileNotFoundError` when there is nothing there,
:class:`~corral.providers.errors.SandboxPathError` for anything else.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import errno
import functools
import logging
import os
import platform
import secrets
import shutil
import stat
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import BinaryIO

from corral.providers.errors import (
    ProviderError,
    SandboxFileNotFoundError,
    SandboxNotRunningError,
    SandboxPathError,
)
from corral.providers.size_limits import copy_at_most, reads, refuse_larger

log = logging.getLogger(__name__)

# openat2(2): the same number on every architecture's table since Linux 5.6; ctypes, since
# the standard library has no binding for it.
SYS_OPENAT2 = 437
RESOLVE_NO_XDEV = 0x01
RESOLVE_NO_MAGICLINKS = 0x02
RESOLVE_NO_SYMLINKS = 0x04
RESOLVE_BENEATH = 0x08
RESOLVE = RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS | RESOLVE_NO_XDEV
DIRECTORY_FLAGS = os.O_RDONLY | os.O_DIRECTORY  # readable: fchown takes no O_PATH descriptor
READ_FLAGS = os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY  # a FIFO opens at once, and is refused
NEW_FILE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL
OPENAT2_RETRIES = 3  # EAGAIN: a rename elsewhere in the tree raced the lookup


@dataclasses.dataclass
class Kernel:
    """What this kernel offers: ``openat2`` turns False once it answered ENOSYS (or on an
    architecture whose number is not known here), and every open then walks the path."""

    openat2: bool


KERNEL = Kernel(openat2=platform.machine() in ("x86_64", "aarch64"))

_REASONS = {
    errno.ELOOP: "a symbolic link on the way, which could lead outside the sandbox's work "
    "directory: links are not followed",
    errno.EXDEV: "leads outside the sandbox's work directory",
    errno.ENOTDIR: "a name on the way is not a directory",
    errno.EISDIR: "is a directory, not a file",
    errno.ENOTEMPTY: "is a directory, not a file",
    errno.EEXIST: "is in the way of a directory",
    errno.EACCES: "permission denied",
    errno.EPERM: "permission denied",
    errno.ENOSPC: "no space left for the sandbox's files",
    errno.EDQUOT: "no space left for the sandbox's files",
    errno.ENAMETOOLONG: "a name on the way is too long",
    errno.EAGAIN: "the sandbox changed the path while it was opened; try again",
    errno.ENXIO: "is not a regular file",
}


class _OpenHow(ctypes.Structure):
    """``struct open_how`` of openat2(2)."""

    _fields_ = [
        ("flags", ctypes.c_uint64),
        ("mode", ctypes.c_uint64),
        ("resolve", ctypes.c_uint64),
    ]


@functools.cache
def _libc() -> ctypes.CDLL:
    """The C library, for its ``syscall``."""
    return ctypes.CDLL(None, use_errno=True)


class WorkDirectory:
    """One sandbox's work directory, reached through a descriptor of it.

    ``owner`` is the uid and gid the sandbox runs as, when that is not this process's user:
    what is put in the work directory becomes theirs.
    """

    def __init__(self, path: Path, owner: tuple[int, int] | None = None) -> None:
        self.path = path
        self.owner = owner

    def upload(self, source: Path, target: str) -> None:
        """Copy the host file ``source`` to ``target``, making the directories on the way.

        The file is written under a new name beside ``target``, then renamed over it: an
        existing ``target`` (a link, or another name of some file) is replaced, never
        written through. An existing file's permission bits are kept.

        Raises:
            SandboxPathError: ``target`` leads outside the work directory, a link is on the
                way, a name on the way is no directory, or ``target`` is one.
            SandboxFileNotFoundError: a directory on the way vanished meanwhile.
            SandboxNotRunningError: the work directory is gone.
        """
        parts = relative_parts(target, self.path)
        if not parts:
            raise SandboxPathError(f"path {target!r} names the work directory, not a file")
        with source.open("rb") as reader, _refusing(target), self._opened() as root:
            parent = self._directories(root, parts[:-1])
            try:
                self._replace(parent, parts[-1], reader)
            finally:
                os.close(parent)

    def download(self, source: str, target: Path, max_bytes: int) -> None:
        """Copy the regular file ``source`` to the host path ``target``, if it is at most
        ``max_bytes`` (refused by its size, and cut at ``max_bytes + 1`` bytes).

        Raises:
            SandboxPathError: ``source`` leads outside the work directory, a link is on the
                way, or it is no regular file (a directory, a FIFO, a device).
            SandboxFileNotFoundError: there is no such file.
            FileTooLargeError: it is larger than ``max_bytes``.
            SandboxNotRunningError: the work directory is gone.
        """
        parts = relative_parts(source, self.path)
        with _refusing(source), self._opened() as root:
            descriptor = open_beneath(root, parts or ["."], READ_FLAGS)
        try:
            status = os.fstat(descriptor)
            if stat.S_ISDIR(status.st_mode):
                raise SandboxPathError(f"path {source!r} is a directory, not a file")
            if not stat.S_ISREG(status.st_mode):
                raise SandboxPathError(f"path {source!r} is not a regular file")
            refuse_larger(source, status.st_size, max_bytes)
            copy_at_most(reads(functools.partial(os.read, descriptor)), target, max_bytes, source)
        finally:
            os.close(descriptor)

    @contextlib.contextmanager
    def _opened(self) -> Iterator[int]:
        """A descriptor of the work directory itself (its path is the host's: no sandbox
        process can rename or replace it)."""
        try:
            descriptor = os.open(self.path, DIRECTORY_FLAGS | os.O_NOFOLLOW | os.O_CLOEXEC)
        except FileNotFoundError as exc:
            raise SandboxNotRunningError("the sandbox's work directory no longer exists") from exc
        try:
            yield descriptor
        finally:
            os.close(descriptor)

    def _directories(self, root: int, names: Sequence[str]) -> int:
        """A descriptor of the directory ``names`` lead to from ``root``, each made (and
        given to the sandbox's user) where missing."""
        current = os.dup(root)
        try:
            for name in names:
                following = self._directory(current, name)
                os.close(current)
                current = following
        except BaseException:
            os.close(current)
            raise
        return current

    def _directory(self, parent: int, name: str) -> int:
        """The directory ``name`` in ``parent``, made (and given away) if missing."""
        try:
            return open_beneath(parent, [name], DIRECTORY_FLAGS)
        except FileNotFoundError:
            pass
        try:
            os.mkdir(name, 0o755, dir_fd=parent)  # a single name: mkdir follows no link
        except FileExistsError:  # the sandbox made it meanwhile: it is its own
            return open_beneath(parent, [name], DIRECTORY_FLAGS)
        made = open_beneath(parent, [name], DIRECTORY_FLAGS)
        self._give(made)
        return made

    def _replace(self, parent: int, name: str, reader: BinaryIO) -> None:
        """Write ``reader`` to a new file in ``parent``, then rename it to ``name``."""
        temporary = f".corral-upload-{secrets.token_hex(8)}"
        descriptor = open_beneath(parent, [temporary], NEW_FILE_FLAGS, 0o644)
        try:
            with os.fdopen(descriptor, "wb") as writer:
                self._give(descriptor)
                _keep_mode(parent, name, descriptor)
                shutil.copyfileobj(reader, writer)
            os.rename(temporary, name, src_dir_fd=parent, dst_dir_fd=parent)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(temporary, dir_fd=parent)
            raise

    def _give(self, descriptor: int) -> None:
        """Make what ``descriptor`` opened the sandbox user's (nothing to do when the
        sandbox runs as this process's user)."""
        if self.owner is not None:
            os.fchown(descriptor, *self.owner)


def relative_parts(path: str, work: Path) -> list[str]:
    """The names ``path`` goes through from the work directory, looked at as text only.

    A relative path is taken from the work directory; an absolute one only if it starts
    with the work directory's path (a sandbox sees it at the same path). Empty and ``.``
    names are dropped; ``..`` is refused outright, wherever it is.

    Raises:
        SandboxPathError: ``path`` is empty, holds a NUL, ``..``, or is absolute elsewhere.
    """
    if not path or "\0" in path:
        raise SandboxPathError("the path is empty or holds a NUL character")
    if path.startswith("/"):
        prefix = str(work).rstrip("/") + "/"
        if not (path + "/").startswith(prefix):
            raise SandboxPathError(
                f"path {path!r} is outside the sandbox work directory; use a path relative to it"
            )
        path = path[len(prefix) :]
    parts = [part for part in path.split("/") if part not in ("", ".")]
    if ".." in parts:
        raise SandboxPathError(
            f"path {path!r} holds '..', which could lead outside the sandbox work directory"
        )
    return parts


def open_beneath(directory: int, names: Sequence[str], flags: int, mode: int = 0) -> int:
    """Open ``names`` (joined by ``/``) beneath the open ``directory``, following no link
    and leaving neither the directory nor its filesystem; a new descriptor (close-on-exec).

    Raises:
        OSError: as open(2) does; ``ELOOP`` for a link on the way, ``EXDEV`` for a way out.
    """
    if any("\0" in name for name in names):  # C would read the path only up to it
        raise OSError(errno.EINVAL, os.strerror(errno.EINVAL))
    if KERNEL.openat2:
        try:
            return _openat2(directory, "/".join(names), flags, mode)
        except OSError as exc:
            if exc.errno == errno.ENOTDIR and len(names) == 1:
                _refuse_link(directory, names[0])
            if exc.errno != errno.ENOSYS:
                raise
            KERNEL.openat2 = False
            log.warning("openat2 is not available: sandbox paths are opened one name at a time")
    return _walk(directory, names, flags, mode)


def _openat2(directory: int, path: str, flags: int, mode: int) -> int:
    """openat2(2) with corral's resolve flags; ``OSError`` with its errno when it fails."""
    how = _OpenHow(
        flags=flags | os.O_CLOEXEC | os.O_NOFOLLOW,
        mode=mode if flags & os.O_CREAT else 0,  # openat2 refuses a mode it will not use
        resolve=RESOLVE,
    )
    for _ in range(OPENAT2_RETRIES):
        descriptor = _libc().syscall(
            ctypes.c_long(SYS_OPENAT2),
            ctypes.c_long(directory),
            ctypes.c_char_p(os.fsencode(path)),
            ctypes.byref(how),
            ctypes.c_size_t(ctypes.sizeof(how)),
        )
        if descriptor >= 0:
            return int(descriptor)
        code = ctypes.get_errno()
        if code not in (errno.EAGAIN, errno.EINTR):
            break
    raise OSError(code, os.strerror(code))


def _walk(directory: int, names: Sequence[str], flags: int, mode: int) -> int:
    """openat2's resolution by hand: each name opened relative to the directory before it,
    with ``O_NOFOLLOW`` (a link is refused, ``ELOOP``), on ``directory``'s filesystem."""
    device = os.fstat(directory).st_dev
    current = directory
    try:
        for name in names[:-1]:
            following = _open_name(current, name, DIRECTORY_FLAGS, 0, device)
            if current != directory:
                os.close(current)
            current = following
        return _open_name(current, names[-1], flags, mode, device)
    finally:
        if current != directory:
            os.close(current)


def _open_name(directory: int, name: str, flags: int, mode: int, device: int) -> int:
    """One name opened in ``directory``, no link followed, on the filesystem ``device``."""
    if name == ".." or "/" in name:
        raise OSError(errno.EXDEV, os.strerror(errno.EXDEV))
    try:
        descriptor = os.open(name, flags | os.O_NOFOLLOW | os.O_CLOEXEC, mode, dir_fd=directory)
    except NotADirectoryError:
        _refuse_link(directory, name)
        raise
    if os.fstat(descriptor).st_dev != device:  # as RESOLVE_NO_XDEV: no other mount
        os.close(descriptor)
        raise OSError(errno.EXDEV, os.strerror(errno.EXDEV))
    return descriptor


def _refuse_link(directory: int, name: str) -> None:
    """ELOOP if ``name`` is a link: opened with O_DIRECTORY, a link says ENOTDIR, but the
    caller should hear that it is a link (as the way through a link says ELOOP)."""
    try:
        mode = os.stat(name, dir_fd=directory, follow_symlinks=False).st_mode
    except OSError:
        return
    if stat.S_ISLNK(mode):
        raise OSError(errno.ELOOP, os.strerror(errno.ELOOP))


def _keep_mode(parent: int, name: str, descriptor: int) -> None:
    """Give the new file the permission bits of the regular file it replaces, if any."""
    try:
        existing = os.stat(name, dir_fd=parent, follow_symlinks=False)
    except FileNotFoundError:
        return
    if stat.S_ISREG(existing.st_mode):
        os.fchmod(descriptor, stat.S_IMODE(existing.st_mode) & 0o777)


@contextlib.contextmanager
def _refusing(path: str) -> Iterator[None]:
    """An ``OSError`` on the way to ``path`` as the provider error naming ``path`` (the
    caller's, never a host path)."""
    try:
        yield
    except ProviderError:
        raise
    except FileNotFoundError as exc:
        raise SandboxFileNotFoundError(f"path {path!r}: no such file in the sandbox") from exc
    except OSError as exc:
        reason = _REASONS.get(exc.errno or 0) or os.strerror(exc.errno or errno.EIO).lower()
        raise SandboxPathError(f"path {path!r}: {reason}") from exc
