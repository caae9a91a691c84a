"""Mounting and unmounting a sandbox's disk by the kernel's own calls, no tool started.

What util-linux's ``mount -o loop`` does, in this process: ask ``/dev/loop-control`` for a
free loop device, attach the image to it with ``LO_FLAGS_AUTOCLEAR`` (``LOOP_CONFIGURE``, or
``LOOP_SET_FD`` and ``LOOP_SET_STATUS64`` before Linux 5.8), mount it, and close the device:
the kernel then detaches it by itself once the filesystem is unmounted, and at once should
this process die before the mount (its descriptor closes). A device that another process
took between the asking and the attaching answers ``EBUSY``: ask again. Starting ``mount``
twice per sandbox (the image, then the work directory's bind) took 15-20 ms of a provision.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import functools
import logging
import os
import struct
from pathlib import Path

logger = logging.getLogger(__name__)

# linux/loop.h
_LOOP_SET_FD, _LOOP_CLR_FD, _LOOP_SET_STATUS64, _LOOP_CONFIGURE = 0x4C00, 0x4C01, 0x4C04, 0x4C0A
_LOOP_CTL_GET_FREE = 0x4C82
_LO_FLAGS_AUTOCLEAR = 4
# struct loop_info64: device, inode, rdevice, offset, sizelimit (u64); number, encrypt
# type, encrypt key size, flags (u32); file name, crypt name (64 bytes), key (32), init (2 u64).
_LOOP_INFO64 = "=5Q4I64s64s32s2Q"
_LO_NAME_SIZE = 64
# linux/mount.h
MS_NOSUID, MS_NODEV, MS_BIND = 2, 4, 4096
_MNT_DETACH, _UMOUNT_NOFOLLOW = 2, 8
# How often a free device is asked for when others keep taking it first.
_ATTEMPTS = 50


@functools.cache
def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


def _loop_info(image: Path) -> bytes:
    name = os.fsencode(image)[: _LO_NAME_SIZE - 1]  # what losetup shows
    flags = _LO_FLAGS_AUTOCLEAR
    return struct.pack(_LOOP_INFO64, 0, 0, 0, 0, 0, 0, 0, 0, flags, name, b"", b"", 0, 0)


def _attach(device: int, backing: int, image: Path) -> None:
    """Attach ``backing`` to the loop device ``device``, cleared on its last close.

    Raises:
        OSError: EBUSY when another process attached something to it first.
    """
    config = struct.pack("=II", backing, 0) + _loop_info(image) + bytes(64)
    try:
        fcntl.ioctl(device, _LOOP_CONFIGURE, config)
        return
    except OSError as exc:
        if exc.errno not in (errno.EINVAL, errno.ENOTTY):  # a kernel before 5.8
            raise
    fcntl.ioctl(device, _LOOP_SET_FD, backing)
    try:
        fcntl.ioctl(device, _LOOP_SET_STATUS64, _loop_info(image))
    except OSError:
        with contextlib.suppress(OSError):
            fcntl.ioctl(device, _LOOP_CLR_FD)  # not left attached without its AUTOCLEAR
        raise


def _free_loop(control: str, backing: int, image: Path) -> tuple[int, int]:
    """An open loop device with ``image`` attached (cleared once unused), and its number.

    Raises:
        OSError: no loop device could be had.
    """
    controller = os.open(control, os.O_RDWR | os.O_CLOEXEC)
    try:
        for _ in range(_ATTEMPTS):
            number = fcntl.ioctl(controller, _LOOP_CTL_GET_FREE)
            device = os.open(f"/dev/loop{number}", os.O_RDWR | os.O_CLOEXEC)
            try:
                _attach(device, backing, image)
            except OSError as exc:
                os.close(device)
                if exc.errno != errno.EBUSY:
                    raise
                continue
            return device, number
    finally:
        os.close(controller)
    raise OSError(errno.EBUSY, f"no free loop device after {_ATTEMPTS} attempts")


def mount(source: str | Path, target: Path, fstype: str | None, flags: int, data: str) -> None:
    """mount(2).

    Raises:
        OSError: the kernel refused, with its errno and the target.
    """
    fs = None if fstype is None else fstype.encode()
    if _libc().mount(os.fsencode(source), os.fsencode(target), fs, flags, data.encode()) != 0:
        code = ctypes.get_errno()
        raise OSError(code, os.strerror(code), str(target))


def mount_image(image: Path, target: Path, *, control: str, flags: int, data: str) -> None:
    """Mount the ext4 image ``image`` at ``target`` through a loop device of its own.

    Raises:
        OSError: no loop device could be had, or the mount was refused; nothing is left
            attached then.
    """
    backing = os.open(image, os.O_RDWR | os.O_CLOEXEC)
    try:
        device, number = _free_loop(control, backing, image)
    finally:
        os.close(backing)  # the loop device holds the file now
    try:
        mount(f"/dev/loop{number}", target, "ext4", flags, data)
    finally:
        os.close(device)  # mounted, the filesystem holds it; else this clears it


def bind(source: Path, target: Path) -> None:
    """Bind-mount ``source`` at ``target`` (the new mount keeps the source's flags).

    Raises:
        OSError: the kernel refused.
    """
    mount(source, target, None, MS_BIND, "")


def unmount(target: Path) -> None:
    """Detach the mount at ``target`` (never a link's target); one already gone is fine."""
    if _libc().umount2(os.fsencode(target), _MNT_DETACH | _UMOUNT_NOFOLLOW) == 0:
        return
    code = ctypes.get_errno()
    if code not in (errno.EINVAL, errno.ENOENT):  # not (or no longer) a mount point
        logger.warning("could not unmount %s: %s", target, os.strerror(code))
