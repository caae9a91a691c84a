"""How the local provider limits a sandbox's memory, CPU and processes, found once per provider.

A cgroup of the sandbox's own where this process's cgroup lets it make one (the supervisor
makes it, moves the entrypoint, the egress proxy and every session exec in, and removes it at
the end; see ``supervisor``):

- cgroup v2 (one unified hierarchy): ``memory.max`` (and ``memory.swap.max`` 0), ``cpu.max``
  when the ``cpu`` controller is delegated too; the OOM killer's count is ``oom_kill`` in
  ``memory.events``. Usable when this process's group has the ``memory`` controller in its
  ``cgroup.subtree_control`` (delegated, or enabled here) and a child group can be made.
- cgroup v1 (a hierarchy per controller): ``memory.limit_in_bytes`` in the memory
  hierarchy, ``cpu.cfs_quota_us`` in the cpu one when it is writable too; the count is
  ``oom_kill`` in ``memory.oom_control``.

Otherwise ``RLIMIT_AS`` on the entrypoint and every process it starts (each process on its
own: a process over it gets allocation failures, not a kill), and CPU is not limited.
``resource_limits = "rlimit"`` forces that; ``"cgroup"`` refuses to run without a cgroup.

Processes: ``pids.max`` (the deployment's ``max_pids``) in a group of the sandbox's own in
the pids hierarchy (v2 where the ``pids`` controller is delegated, else v1), whatever
``resource_limits`` says and whether or not the sandbox asks for memory or CPU: without it
a sandbox could fork until its uid's RLIMIT_NPROC. A host with no writable pids group has
no per-sandbox process limit (the health check says so).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

Choice = Literal["auto", "cgroup", "rlimit"]
CPU_PERIOD_US = 100_000
# The file of a sandbox's group with its ``oom_kill`` count, by cgroup version.
OOM_EVENTS = {1: "memory.oom_control", 2: "memory.events"}


@dataclass(frozen=True)
class Mechanism:
    """What limits sandboxes here: ``cgroup`` (with the version and the groups new sandbox
    groups go under) or ``rlimit`` for memory and CPU; ``why`` says why a cgroup is not
    used. ``pids_parent``: where each sandbox's pids group goes, with either kind."""

    kind: Literal["cgroup", "rlimit"]
    version: int | None = None
    memory_parent: Path | None = None
    cpu_parent: Path | None = None
    why: str = ""
    pids_parent: Path | None = None

    def describe(self) -> str:
        pids = f"pids in {self.pids_parent}" if self.pids_parent else "processes not limited"
        if self.kind == "rlimit":
            return f"RLIMIT_AS (memory only, CPU not limited; {self.why}); {pids}"
        cpu = f"cpu in {self.cpu_parent}" if self.cpu_parent else "CPU not limited (no cpu group)"
        return f"cgroup v{self.version} (memory in {self.memory_parent}; {cpu}; {pids})"

    def launch(
        self,
        sandbox_id: str,
        memory_bytes: int | None,
        cpu: float | None,
        max_pids: int | None = None,
    ) -> dict[str, Any] | None:
        """The supervisor's ``cgroup`` launch field for one sandbox; None: no cgroup (none
        here, or no limit asked for). ``memory_dir`` (the group in the memory hierarchy, or
        the v2 group) is there with a memory or CPU limit, ``pids_dir`` with ``max_pids``."""
        name = f"corral-{sandbox_id}"
        memory_here = self.kind == "cgroup" and self.memory_parent is not None
        quota = round(cpu * CPU_PERIOD_US) if cpu and memory_here and self.cpu_parent else None
        memory_dir = self.memory_parent / name if self.memory_parent else None
        if not (memory_here and (memory_bytes or quota)):
            memory_dir = None
        pids = max_pids if self.pids_parent is not None else None
        if memory_dir is None and not pids:
            return None
        return {
            "version": self.version,
            "memory_dir": None if memory_dir is None else str(memory_dir),
            "cpu_dir": str(self.cpu_parent / name) if quota and self.cpu_parent else None,
            "pids_dir": str(self.pids_parent / name) if pids and self.pids_parent else None,
            "memory_bytes": memory_bytes if memory_dir is not None else None,
            "cpu_quota_us": quota,
            "cpu_period_us": CPU_PERIOD_US,
            "max_pids": pids,
        }


def group_dirs(cgroup: dict[str, Any] | None) -> list[str]:
    """The directories of a sandbox's groups (a ``launch`` field), each once: what its
    processes join (the supervisor finds the same)."""
    dirs: list[str] = []
    for key in ("memory_dir", "cpu_dir", "pids_dir"):
        found = (cgroup or {}).get(key)
        if found and found not in dirs:
            dirs.append(found)
    return dirs


def limits_memory(cgroup: dict[str, Any] | None) -> bool:
    """Whether a sandbox's groups (a ``launch`` field) hold a memory limit."""
    return bool(cgroup and cgroup.get("memory_dir") and cgroup.get("memory_bytes"))


def detect(choice: Choice, proc: Path = Path("/proc")) -> Mechanism:
    """The mechanism ``choice`` asks for, as far as this host allows it; a pids group
    wherever one can be made, whatever the choice."""
    mounts = _cgroup_mounts(proc / "self" / "mountinfo")
    groups = _own_groups(proc / "self" / "cgroup")
    pids = _pids_parent(mounts, groups)
    if choice == "rlimit":
        return Mechanism("rlimit", why="resource_limits is rlimit", pids_parent=pids)
    v2 = _v2(mounts, groups)
    if isinstance(v2, Mechanism):
        return dataclasses.replace(v2, pids_parent=pids)
    v1 = _v1(mounts, groups)
    if isinstance(v1, Mechanism):
        return dataclasses.replace(v1, pids_parent=pids)
    return Mechanism("rlimit", why=f"no writable cgroup: {v2}; {v1}", pids_parent=pids)


def _cgroup_mounts(mountinfo: Path) -> list[tuple[str, str, str, set[str]]]:
    """(fstype, mount root, mount point, options) of every cgroup mount."""
    found = []
    with contextlib.suppress(OSError):
        for line in mountinfo.read_text(encoding="utf-8").splitlines():
            head, _, tail = line.partition(" - ")
            fields, rest = head.split(), tail.split()
            if len(fields) >= 5 and len(rest) >= 3 and rest[0] in ("cgroup", "cgroup2"):
                found.append((rest[0], fields[3], fields[4], set(rest[2].split(","))))
    return found


def _own_groups(cgroup: Path) -> dict[str, str]:
    """This process's group path per controller ("" for the v2 hierarchy)."""
    groups = {}
    with contextlib.suppress(OSError):
        for line in cgroup.read_text(encoding="utf-8").splitlines():
            _, controllers, path = line.split(":", 2)
            for controller in controllers.split(",") if controllers else [""]:
                groups[controller] = path
    return groups


def _group_dir(root: str, point: str, path: str) -> Path:
    relative = path[len(root) :] if root != "/" and path.startswith(root) else path
    return Path(point) / relative.lstrip("/")


def _v2_parent(mounts: list[tuple[str, str, str, set[str]]], groups: dict[str, str]) -> Path | None:
    """This process's group in the v2 hierarchy, if there is one."""
    mount = next((m for m in mounts if m[0] == "cgroup2"), None)
    if mount is None or "" not in groups:
        return None
    return _group_dir(mount[1], mount[2], groups[""])


def _enabled(parent: Path, controllers: tuple[str, ...]) -> list[str]:
    """The controllers a v2 group gives its children, once those of ``controllers`` it has
    are enabled (where this process may)."""
    enabled = _read(parent / "cgroup.subtree_control").split()
    for controller in controllers:
        if controller not in enabled and controller in _read(parent / "cgroup.controllers"):
            with contextlib.suppress(OSError):
                (parent / "cgroup.subtree_control").write_text(f"+{controller}")
    return _read(parent / "cgroup.subtree_control").split()


def _v2(mounts: list[tuple[str, str, str, set[str]]], groups: dict[str, str]) -> Mechanism | str:
    parent = _v2_parent(mounts, groups)
    if parent is None:
        return "no cgroup v2 hierarchy"
    enabled = _enabled(parent, ("memory", "cpu"))
    if "memory" not in enabled:
        return f"cgroup v2 at {parent} has no memory controller for its children"
    if not _can_make_child(parent, "memory.max"):
        return f"cgroup v2 at {parent} is not writable"
    cpu = parent if "cpu" in enabled else None
    return Mechanism("cgroup", version=2, memory_parent=parent, cpu_parent=cpu)


def _v1_hierarchy(
    mounts: list[tuple[str, str, str, set[str]]], groups: dict[str, str], controller: str
) -> Path | None:
    """This process's group in the v1 hierarchy of ``controller``, if there is one."""
    mount = next((m for m in mounts if m[0] == "cgroup" and controller in m[3]), None)
    if mount is None or controller not in groups:
        return None
    return _group_dir(mount[1], mount[2], groups[controller])


def _v1(mounts: list[tuple[str, str, str, set[str]]], groups: dict[str, str]) -> Mechanism | str:
    memory = _v1_hierarchy(mounts, groups, "memory")
    if memory is None:
        return "no cgroup v1 memory hierarchy"
    if not _can_make_child(memory, "memory.limit_in_bytes"):
        return f"cgroup v1 memory group {memory} is not writable"
    cpu = _v1_hierarchy(mounts, groups, "cpu")
    if cpu is not None and not _can_make_child(cpu, "cpu.cfs_quota_us"):
        cpu = None
    return Mechanism("cgroup", version=1, memory_parent=memory, cpu_parent=cpu)


def _pids_parent(
    mounts: list[tuple[str, str, str, set[str]]], groups: dict[str, str]
) -> Path | None:
    """Where sandboxes' pids groups go: this process's v2 group where it gives its children
    the pids controller, else its group in the v1 pids hierarchy; None if neither can
    hold a child group."""
    v2 = _v2_parent(mounts, groups)
    if v2 is not None and "pids" in _enabled(v2, ("pids",)) and _can_make_child(v2, "pids.max"):
        return v2
    v1 = _v1_hierarchy(mounts, groups, "pids")
    if v1 is not None and _can_make_child(v1, "pids.max"):
        return v1
    return None


def _read(path: Path) -> str:
    try:
        return path.read_text(encoding="ascii")
    except OSError:
        return ""


def _can_make_child(parent: Path, limit_file: str) -> bool:
    """Whether a child group with ``limit_file`` can be made under ``parent`` (and removed)."""
    probe = parent / f"corral-probe-{os.getpid()}"
    try:
        probe.mkdir()
    except OSError:
        return False
    try:
        return (probe / limit_file).exists()
    finally:
        with contextlib.suppress(OSError):
            probe.rmdir()
