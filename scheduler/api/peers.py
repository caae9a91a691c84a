"""Who called over the api's Unix socket: a key per sandbox, for the runner rate limits.

A caller on the Unix socket has no address. The kernel tells the peer's pid and uid
(``SO_PEERCRED``, taken when it connected); a pid alone is not a sandbox, since a sandbox
can fork, call ``setsid`` or make nested namespaces at will. The key is the pid namespace
the sandbox runs in, the outermost one below the api's own: bubblewrap (``--unshare-pid``)
and Docker both start a sandbox in a fresh one, every process the sandbox makes stays in it
or in namespaces nested below it, and it dies with that namespace's first process. A
command a provider runs in the sandbox from outside (``nsenter``, ``docker exec``) joins
the same namespace.

The namespace is found by walking the peer's parents in ``/proc/<pid>/status`` (readable by
all) until the parent is in the api's namespace (one entry in ``NSpid``); the process below
is the namespace's first, or one a provider put into it. Its key is the namespace's inode
when this process may read ``/proc/<pid>/ns/pid`` (root may), else that process's pid and
start time. A peer in no namespace of its own (a host process) is keyed by its uid.
"""

from __future__ import annotations

import functools
import os
import socket
import struct
from dataclasses import dataclass
from pathlib import Path

# How many parents the walk reads at most (about 15 µs each, once per connection): a chain
# of processes deeper than this is not told apart (it shares the Unix socket's one key), so
# that no caller makes the walk cost more. A runner sits a few processes below its sandbox's
# first.
MAX_ANCESTRY = 32
PROC = Path("/proc")
# The scope extension the server puts the key in: {"key": str}.
PEER_EXTENSION = "corral.peer"
_UCRED = struct.Struct("3i")  # pid, uid, gid


@dataclass(frozen=True)
class _Process:
    """What the walk reads of one process: its parent and its pid in each namespace."""

    parent: int
    namespace_depth: int  # entries in NSpid: 1 in the namespace /proc belongs to
    first_in_namespace: bool  # pid 1 of the outermost namespace below /proc's


def peer_key(sock: socket.socket) -> str | None:
    """The rate-limit key of the process at the other end of a Unix socket.

    None when it cannot be told: no credentials, a peer in a pid namespace this process
    cannot see (pid 0), a process gone before it was read, a walk past ``MAX_ANCESTRY``,
    or an api whose ``/proc`` is not its own namespace's.
    """
    try:
        pid, uid, _ = _UCRED.unpack(
            sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size)
        )
    except OSError:
        return None
    if pid <= 0:
        return None
    return process_key(pid, uid)


def process_key(pid: int, uid: int, *, proc: Path = PROC) -> str | None:
    """The key of process ``pid`` (run by ``uid``): its outermost pid namespace below the
    api's, or its uid when it is in the api's; None when it cannot be told."""
    if not _own_namespace_is_procs(proc):
        return None
    first = _outermost_namespaced(pid, proc)
    if first is None:
        return None
    if first == 0:
        return f"uid:{uid}"
    try:
        inode = os.stat(proc / str(first) / "ns" / "pid").st_ino
    except OSError:  # not ours to look at (another uid, not dumpable): the process instead
        start = _start_time(first, proc)
        return None if start is None else f"process:{first}:{start}"
    return f"pidns:{inode}:{_generation(inode, first, proc)}"


# The kernel hands a namespace's inode number to a new one once it has ended. With the start
# time of the namespace's first process beside it, a new sandbox never inherits an ended
# one's bucket. A process a provider put into the namespace from outside (nsenter) is not
# that first process: it takes the start time last seen for the inode, which the sandbox's
# own runner gave when it registered (before any command could be run in it).
_STARTS: dict[int, int] = {}
MAX_NAMESPACES = 100_000  # inodes remembered at most; past that, it starts over


def _generation(inode: int, first: int, proc: Path) -> int:
    """The start time of the namespace's first process (0 when not known)."""
    found = _read(first, proc)
    if found is None or not found.first_in_namespace:
        return _STARTS.get(inode, 0)
    start = _start_time(first, proc) or 0
    if len(_STARTS) >= MAX_NAMESPACES:
        _STARTS.clear()
    _STARTS[inode] = start
    return start


def _outermost_namespaced(pid: int, proc: Path) -> int | None:
    """The highest ancestor of ``pid`` (itself included) outside the api's pid namespace
    whose parent is in it; 0 when ``pid`` is in the api's namespace; None when unknown."""
    current = _read(pid, proc)
    if current is None:
        return None
    if current.namespace_depth == 1:
        return 0
    for _ in range(MAX_ANCESTRY):
        parent = _read(current.parent, proc) if current.parent > 0 else None
        if parent is None:
            return None
        if parent.namespace_depth == 1:
            return pid
        pid, current = current.parent, parent
    return None


def _read(pid: int | str, proc: Path) -> _Process | None:
    """``PPid`` and ``NSpid`` of ``/proc/<pid>/status``; None once the process is gone."""
    try:
        with open(proc / str(pid) / "status", "rb") as status:
            text = status.read()
    except OSError:
        return None
    # The kernel escapes a newline in the Name the process chose: these lines are its own.
    parent_at, nspid_at = text.find(b"\nPPid:"), text.find(b"\nNSpid:")
    if parent_at < 0 or nspid_at < 0:
        return None
    parent = text[parent_at + 6 : text.index(b"\n", parent_at + 1)]
    nspid = text[nspid_at + 7 : text.index(b"\n", nspid_at + 1)].split()
    first = len(nspid) > 1 and nspid[1] == b"1"
    return _Process(parent=int(parent), namespace_depth=len(nspid), first_in_namespace=first)


def _start_time(pid: int, proc: Path) -> int | None:
    """The process's start time in clock ticks after boot (field 22 of ``stat``)."""
    try:
        text = (proc / str(pid) / "stat").read_text(encoding="utf-8", errors="replace")
    except OSError:
        return None
    fields = text.rpartition(")")[2].split()  # the name before it may hold anything
    return int(fields[19]) if len(fields) > 19 else None


@functools.cache
def _own_namespace_is_procs(proc: Path) -> bool:
    """Whether ``proc`` shows this process's pid namespace: else the pid the kernel hands
    over (in this namespace) names another process there, and nothing is told apart.
    Read once: where /proc belongs does not change while the api runs."""
    own = _read("self", proc)
    return own is not None and own.namespace_depth == 1
