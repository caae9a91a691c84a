"""The bubblewrap command line that isolates a local sandbox.

The sandbox gets its own pid, mount, ipc and uts namespaces, and its own network namespace
(loopback only) unless the spec allows network. System directories are read-only, /tmp is
private, and only the sandbox's work directory is writable. From /etc only what programs
need to run is visible (no shadow files, no host secrets). bubblewrap drops all
capabilities, even when the worker runs as root.
"""

from __future__ import annotations

import functools
import os
import shutil
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

SYSTEM_DIRS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/opt")
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


def find_bwrap(configured: str) -> str | None:
    """The bubblewrap executable, or None when it is not installed."""
    return shutil.which(configured)


@dataclass(frozen=True)
class IsolationPlan:
    """What one sandbox sees: its work dir, the read-only extras, and its network."""

    bwrap: str
    workdir: Path
    hostname: str
    allow_network: bool
    read_only_binds: Sequence[str] = ()
    runner_package: Path | None = None
    control_socket: Path | None = None
    egress_proxy_dir: Path | None = None  # the egress proxy's socket directory, if any
    extra_binds: tuple[tuple[str, str], ...] = ()  # (host path, sandbox path), read-only

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
        if not self.allow_network:
            args.append("--unshare-net")
        for path in (*SYSTEM_DIRS, *ETC_ENTRIES):
            args += _mirror(path)
        # bubblewrap mounts in order, so the fresh /tmp goes first: binds below may live
        # under /tmp on the host (a checkout, a virtualenv, the sandbox root).
        args += ["--proc", "/proc", "--dev", "/dev", "--tmpfs", "/tmp"]  # noqa: S108 - private
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
        return [*args, "--", *command]


def _mirror(path: str) -> list[str]:
    """Arguments that make ``path`` look inside the sandbox as it does outside, read-only."""
    if os.path.islink(path):
        return ["--symlink", os.readlink(path), path]
    return ["--ro-bind-try", path, path]


@functools.cache
def python_prefixes() -> tuple[str, ...]:
    """Directories this Python lives in, so that the runner can start inside the sandbox.
    Resolved once: they do not move while the process runs."""
    prefixes = {os.path.realpath(p) for p in (sys.prefix, sys.base_prefix, sys.exec_prefix)}
    return tuple(sorted(p for p in prefixes if not p.startswith(SYSTEM_DIRS)))
