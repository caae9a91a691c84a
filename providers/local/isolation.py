"""The bubblewrap command line that isolates a local sandbox.

The sandbox gets its own pid, mount, ipc and uts namespaces, and always its own network
namespace (loopback only): tenant work never shares the host's, where the control plane
listens. A sandbox with network reaches out through corral's egress proxy alone, which runs
in a plan of its own (``share_network``: the host's network, nothing of the sandbox's files).
System directories are read-only, /tmp is private, and only the sandbox's work directory is
writable. From /etc only what programs need to run is visible (no shadow files, no host
secrets); of Python only the interpreter itself (not corral's virtualenv), and nothing of
/opt. bubblewrap drops all capabilities, even when the worker runs as root.

Under a root worker the sandbox also runs as an unprivileged user (``run_as``: a uid of its
own from the provider's range, 10001 up by default): bubblewrap, as root, builds the sandbox
(it can bind any host path) keeping only the capabilities to change user, and ``setpriv``
inside it becomes that user with no capability left, no bounding set, no supplementary group
and ``no_new_privs`` before it executes the entrypoint. (``--unshare-user --uid`` would only
rename root: run by root, bubblewrap maps the sandbox's user to uid 0 on the host.)
"""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

SYSTEM_DIRS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
ETC_ENTRIES = (
    "/etc/alternatives",
    "/etc/ca-certificates",
    "/etc/ssl",
    "/etc/ld.so.cache",
    "/etc/ld.so.conf",
    "/etc/ld.so.conf.d",
    "/etc/localtime",
    "/etc/passwd",
    "/etc/group",
    "/etc/nsswitch.conf",
    "/etc/hosts",
    "/etc/resolv.conf",
    "/etc/mime.types",
)
# Where the egress proxy's socket directory appears inside the sandbox.
SANDBOX_PROXY_DIR = "/run/corral/egress"
# Where the runner package appears inside the sandbox (on PYTHONPATH).
SANDBOX_LIB_DIR = "/run/corral/lib"


# Where setpriv is looked for: a system directory, so that it is there inside the sandbox too.
SETPRIV_PATH = "/usr/bin:/bin:/usr/sbin:/sbin"


def find_setpriv() -> str | None:
    """util-linux's setpriv, from a directory the sandbox sees; None if not installed."""
    return shutil.which("setpriv", path=SETPRIV_PATH)


def as_user(setpriv: str, uid: int, gid: int) -> list[str]:
    """The argv prefix that runs what follows as ``uid:gid``, with no capability, no
    supplementary group, and no way to gain privileges (set-user-id files included)."""
    return [
        setpriv,
        f"--reuid={uid}",
        f"--regid={gid}",
        "--clear-groups",
        "--inh-caps=-all",
        "--bounding-set=-all",
        "--no-new-privs",
        "--",
    ]


def find_bwrap(configured: str) -> str | None:
    """The bubblewrap executable, or None when it is not installed."""
    return shutil.which(configured)


@functools.cache
def bwrap_takes_size(bwrap: str) -> bool:
    """Whether this bubblewrap sizes a tmpfs (``--size``, not in the oldest releases)."""
    try:
        usage = subprocess.run(
            [bwrap, "--help"], capture_output=True, text=True, timeout=10, check=False
        )
    except (OSError, subprocess.TimeoutExpired):
        return False
    return "--size" in usage.stdout + usage.stderr


@dataclass(frozen=True)
class IsolationPlan:
    """What one sandbox sees: its work dir, the read-only extras, and its network."""

    bwrap: str
    workdir: Path
    hostname: str
    # The host's network namespace: for corral's egress proxy alone, never tenant work.
    share_network: bool = False
    read_only_binds: Sequence[str] = ()
    runner_package: Path | None = None
    control_socket: Path | None = None
    egress_proxy_dir: Path | None = None  # the egress proxy's socket directory, if any
    extra_binds: tuple[tuple[str, str], ...] = ()  # (host path, sandbox path), read-only
    run_as: tuple[str, int, int] | None = None  # setpriv, uid and gid under a root worker
    # The sandbox's /tmp: a host directory bound there (on the sandbox's disk image), else a
    # tmpfs of its own, of ``tmp_bytes`` at most when given.
    tmp_source: Path | None = None
    tmp_bytes: int | None = None

    def argv(self, command: Sequence[str]) -> list[str]:
        args = [
            self.bwrap,
            "--die-with-parent",
            "--unshare-pid",
            "--unshare-ipc",
            "--unshare-uts",
            "--hostname",
            self.hostname,
        ]
        if not self.share_network:
            args.append("--unshare-net")
        args += ["--perms", "0755", "--dir", "/etc"]  # not as closed as bubblewrap makes it
        for path in (*SYSTEM_DIRS, *ETC_ENTRIES):
            args += _mirror(path)
        # bubblewrap mounts in order, so the fresh /tmp goes first: binds below may live
        # under /tmp on the host (a checkout, a virtualenv, the sandbox root).
        args += ["--proc", "/proc", "--dev", "/dev", *self._tmp()]
        args += self._parents()
        for path in python_prefixes():
            args += ["--ro-bind-try", path, path]
        for path in self.read_only_binds:  # an operator asked for these: missing is an error
            args += ["--ro-bind", path, path]
        if self.runner_package is not None:
            args += ["--ro-bind", str(self.runner_package), f"{SANDBOX_LIB_DIR}/runner"]
        for source, target in self.extra_binds:
            args += ["--ro-bind", source, target]
        args += ["--bind", str(self.workdir), str(self.workdir), "--chdir", str(self.workdir)]
        if self.control_socket is not None:
            # Its directory, not the socket file: an api that restarts binds a new socket
            # there, which a mount of the old file would never see. Read-only: connecting
            # needs no write access to the mount, and no sandbox may replace the socket.
            folder = str(self.control_socket.parent)
            args += ["--ro-bind", folder, folder]
        if self.egress_proxy_dir is not None:
            args += ["--ro-bind", str(self.egress_proxy_dir), SANDBOX_PROXY_DIR]
        if self.run_as is not None:
            # Only what setpriv needs to become the user; it drops them all on the way.
            for capability in ("CAP_SETUID", "CAP_SETGID", "CAP_SETPCAP"):
                args += ["--cap-add", capability]
            command = [*as_user(*self.run_as), *command]
        return [*args, "--", *command]

    def _tmp(self) -> list[str]:
        """The sandbox's own /tmp, open to all as a /tmp is."""
        if self.tmp_source is not None:
            return ["--bind", str(self.tmp_source), "/tmp"]  # noqa: S108
        size = ["--size", str(self.tmp_bytes)] if self.tmp_bytes else []
        return ["--perms", "1777", *size, "--tmpfs", "/tmp"]  # noqa: S108

    def _destinations(self) -> list[str]:
        """Where the binds below land inside the sandbox."""
        paths = [*python_prefixes(), *self.read_only_binds, str(self.workdir)]
        paths += [target for _, target in self.extra_binds]
        if self.runner_package is not None:
            paths.append(f"{SANDBOX_LIB_DIR}/runner")
        if self.control_socket is not None:
            paths.append(str(self.control_socket.parent))
        if self.egress_proxy_dir is not None:
            paths.append(SANDBOX_PROXY_DIR)
        return paths

    def _parents(self) -> list[str]:
        """The directories above the binds, made open to all (bubblewrap would make them
        as closed as the host's, e.g. ``/root`` or a ``0700`` temporary directory, which an
        unprivileged sandbox user could not pass through), parents first."""
        parents: set[str] = set()
        for destination in self._destinations():
            parents.update(str(p) for p in Path(destination).parents if str(p) != "/")
        args: list[str] = []
        for parent in sorted(parents, key=lambda p: (p.count("/"), p)):
            args += ["--perms", "0755", "--dir", parent]
        return args


def _mirror(path: str) -> list[str]:
    """Arguments that make ``path`` look inside the sandbox as it does outside, read-only."""
    if os.path.islink(path):
        return ["--symlink", os.readlink(path), path]
    return ["--ro-bind-try", path, path]


@functools.cache
def python_prefixes() -> tuple[str, ...]:
    """Directories the interpreter lives in (not a virtualenv's: the runner needs the
    standard library alone), so that the runner can start inside the sandbox. Resolved
    once: they do not move while the process runs."""
    prefixes = {os.path.realpath(p) for p in (sys.base_prefix, sys.base_exec_prefix)}
    return tuple(sorted(p for p in prefixes if not p.startswith(SYSTEM_DIRS)))


@functools.cache
def base_python() -> str:
    """The interpreter itself, outside any virtualenv: what a sandbox can run."""
    return os.path.realpath(getattr(sys, "_base_executable", None) or sys.executable)
