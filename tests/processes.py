"""What ``/proc`` tells about the processes a run left behind: the descendants of a process
and which of them are zombies, and the bubblewrap processes that served a run's sandboxes.

A zombie's command line is empty, so a bubblewrap left as a zombie cannot be told by its
command line at the end; ``ProcessWatch`` notes each one while it still runs (its command line
names the run's sandbox root) and identifies it afterwards by pid and start time. It also notes
each one it ever sees orphaned: handed to a process outside the worker's tree (init), which may
collect it late or never."""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass
from pathlib import Path

PROC = Path("/proc")


@dataclass(frozen=True)
class Proc:
    pid: int
    ppid: int
    state: str
    start: int  # clock ticks since boot: tells a pid from its reuse
    name: str


def read_proc(pid: int) -> Proc | None:
    try:
        stat = (PROC / str(pid) / "stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return None
    # The name may hold spaces and parentheses; the fields after its last ")" are fixed.
    name = stat[stat.index("(") + 1 : stat.rindex(")")]
    fields = stat[stat.rindex(")") + 2 :].split()
    return Proc(pid, int(fields[1]), fields[0], int(fields[19]), name)


def supervisor_of(sandbox_root: Path, sandbox_id: str) -> tuple[int, int]:
    """The pid and start time of a local sandbox's supervisor, from the sandbox's record."""
    record = json.loads((sandbox_root / sandbox_id / "sandbox.json").read_text())
    return record["supervisor_pid"], record["supervisor_start"]


def all_procs() -> list[Proc]:
    found = (read_proc(int(entry.name)) for entry in PROC.iterdir() if entry.name.isdigit())
    return [proc for proc in found if proc is not None]


def cmdline(pid: int) -> str:
    try:
        return (PROC / str(pid) / "cmdline").read_bytes().replace(b"\0", b" ").decode()
    except (FileNotFoundError, ProcessLookupError):
        return ""


def cwd(pid: int) -> str:
    """The process's working directory ("" once it is gone)."""
    try:
        return str((PROC / str(pid) / "cwd").readlink())
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return ""


def descendants(pid: int, procs: list[Proc] | None = None) -> list[Proc]:
    """Every process below ``pid`` in the process tree (children, theirs, and so on)."""
    table = procs if procs is not None else all_procs()
    children: dict[int, list[Proc]] = {}
    for proc in table:
        children.setdefault(proc.ppid, []).append(proc)
    found: list[Proc] = []
    pending = [pid]
    while pending:
        for child in children.get(pending.pop(), []):
            found.append(child)
            pending.append(child.pid)
    return found


def descends_from(proc: Proc, ancestor: int, *, tries: int = 3) -> bool:
    """Whether ``ancestor`` is among the process's ancestors, read afresh now. A snapshot of
    ``/proc`` is read one process after another, so a parent may have ended between the
    child's line and its own (the child then has a new parent): the chain is read again.
    A process that has ended since counts as a descendant: nothing tells otherwise."""
    for _ in range(tries):
        current = read_proc(proc.pid)
        if current is None or current.start != proc.start:
            return True
        seen: set[int] = set()
        while current is not None and current.ppid not in (0, 1, ancestor, *seen):
            seen.add(current.pid)
            current = read_proc(current.ppid)
        if current is not None:
            return current.ppid == ancestor
    return True


def zombies_below(pid: int) -> list[Proc]:
    """Zombies among the descendants of ``pid`` (``State: Z``)."""
    return [proc for proc in descendants(pid) if proc.state == "Z"]


class ProcessWatch:
    """Notes, from a thread, every bubblewrap process whose command line holds ``marker``,
    and those among them whose parent is not ``worker`` or one of its descendants."""

    def __init__(self, marker: str, worker: int, *, interval_s: float = 0.05) -> None:
        self.marker = marker
        self.worker = worker
        self.interval_s = interval_s
        self.seen: dict[tuple[int, int], Proc] = {}
        self.orphaned: dict[tuple[int, int], Proc] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="process-watch", daemon=True)

    def __enter__(self) -> ProcessWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    def _loop(self) -> None:
        while not self._stop.is_set():
            self.sample()
            self._stop.wait(self.interval_s)

    def sample(self) -> None:
        procs = all_procs()
        tree = {self.worker, *(proc.pid for proc in descendants(self.worker, procs))}
        for proc in procs:
            key = (proc.pid, proc.start)
            # Looked at again until it is bubblewrap: a supervisor's child that has forked
            # but not yet executed bubblewrap still has the supervisor's name.
            bubblewrap = proc.state != "Z" and proc.name == "bwrap"
            if key not in self.seen and bubblewrap and self.marker in cmdline(proc.pid):
                self.seen[key] = proc
            if key in self.seen and proc.ppid not in tree and not descends_from(proc, self.worker):
                self.orphaned[key] = proc

    def left_behind(self) -> list[Proc]:
        """The noted bubblewrap processes that still exist, running or as zombies (a last
        sample first, so one running now is among them)."""
        self.sample()
        still = []
        for pid, start in list(self.seen):
            now = read_proc(pid)
            if now is not None and now.start == start:
                still.append(now)
        return still
