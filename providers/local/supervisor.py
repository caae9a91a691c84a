"""Supervisors of local sandboxes. Standard library only; run as a script by the provider.

    python -I -S supervisor.py

The spawner. The process the provider starts is a spawner, one per provider, started on the
first provision. It has imported all a supervisor needs, and keeps one supervisor forked
ahead (the spare), which already leads its own session and waits for the next launch on the
spawner's stdin. So a sandbox starts at the cost of a pipe write and one process waking up,
with no interpreter start, imports or fork on the way to the command (tens of milliseconds,
more than bubblewrap needs to build the sandbox). Once its entrypoint's process exists, the
supervisor writes its pid and start time into the sandbox's record (so that the record names
it even if the worker dies mid-provision), answers the provider with both (a JSON line on
the spawner's stdout), and tells the spawner, which forks the next spare once this sandbox
is built (its fork takes no CPU from the start), or at once if another launch waits. It reaps
its supervisors as they end and, a child subreaper too, what a supervisor killed from
outside leaves. When stdin closes (the provider closed it, or the worker died) it takes no
more launches and exits once its last supervisor has ended: a sandbox outlives its worker.
The spawner and its spare work in ``/``; a supervisor works in its sandbox's work
directory, which tells whose it is.

A launch (a 10-digit length, then the JSON object) holds: argv, env, registration_token
(given to the entrypoint on an inherited pipe, never in an environment), cwd, log_path,
log_max_bytes and log_tail_bytes (what the log keeps of the sandbox's output, see
``output``), record_path, timeout_s, grace_s, memory_bytes (RLIMIT_AS), cgroup (or null: the
sandbox's own cgroups to make, memory, cpu and pids, see ``limits``), result_path, started_path,
bwrap_status (whether argv is bubblewrap, to be asked for its JSON status stream),
egress_proxy (null, or argv, cwd and config of corral's egress proxy, started before the
entrypoint), and owner (null, or the uid and gid of the sandbox's own, whose keyrings are
emptied at the end).

The supervisor leads its sandbox's session and process group, with the sandbox's work
directory as its own and the sandbox's log as its stdout and stderr. It starts the
sandbox's entrypoint (inside bubblewrap when the provider isolates), applies the memory
limit, enforces the deadline, and writes the outcome to a result file, so that any worker
process — not only the one that started the sandbox — can tell what happened. The
entrypoint's stdout and stderr are a pipe, never the log file: the supervisor copies what
comes through it into the log within the deployment's bound (``output``).

It is also the sandbox's child subreaper: a process of the sandbox whose parent dies (the
pid-1 bubblewrap, once the outer one has exited) becomes its child rather than init's. At the
end it kills what is left and reaps it all, so that nothing outlives the sandbox, not even as
a zombie for an init that may never collect it. Only the supervisor itself is left for the
spawner to reap.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import resource
import select
import signal
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from typing import IO, TYPE_CHECKING, Any, NoReturn

if TYPE_CHECKING or __package__:  # corral's own module (its tests)
    from corral.providers.local.output import BoundedCopy, output_pipe
else:  # the script, under -I -S: its modules of its own lie beside it
    sys.path.append(os.path.dirname(os.path.realpath(__file__)))
    from output import BoundedCopy, output_pipe


def _write_json(path: str, payload: dict[str, Any]) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w", encoding="utf-8") as handle:
        json.dump(payload, handle)
    os.replace(tmp, path)


def _memory_limit(
    memory_bytes: int | None, groups: list[str] | None = None
) -> Callable[[], None] | None:
    """What runs in the child between fork and exec: the memory limit, if there is one
    (RLIMIT_AS, or joining the sandbox's cgroups). Without one the child starts by vfork,
    much quicker than a fork of this process."""
    if not memory_bytes and not groups:
        return None

    def apply() -> None:
        if memory_bytes:
            resource.setrlimit(resource.RLIMIT_AS, (memory_bytes, memory_bytes))
        for group in groups or ():
            with open(os.path.join(group, "cgroup.procs"), "w", encoding="ascii") as handle:
                handle.write(str(os.getpid()))

    return apply


def _write_limit(group: str, name: str, value: object, *, optional: bool = False) -> None:
    try:
        with open(os.path.join(group, name), "w", encoding="ascii") as handle:
            handle.write(str(value))
    except OSError:
        if not optional:
            raise


def _make_cgroups(cgroup: dict[str, Any] | None) -> list[str]:
    """Make the sandbox's cgroups with their limits; the groups its processes join (the
    memory group, or the v2 group; the cpu and pids groups), each once."""
    groups: list[str] = []
    for key in ("memory_dir", "cpu_dir", "pids_dir"):
        group = (cgroup or {}).get(key)
        if group and group not in groups:
            os.makedirs(group, exist_ok=True)
            groups.append(group)
    if cgroup:
        _write_limits(cgroup, cgroup["version"] == 2)
    return groups


def _write_limits(cgroup: dict[str, Any], v2: bool) -> None:
    """Write the sandbox's limits into its groups (file names by cgroup version)."""
    memory, cpu, pids = cgroup.get("memory_dir"), cgroup.get("cpu_dir"), cgroup.get("pids_dir")
    limit, quota = cgroup.get("memory_bytes"), cgroup.get("cpu_quota_us")
    period = cgroup.get("cpu_period_us", 100_000)
    if memory and limit and v2:
        _write_limit(memory, "memory.max", limit)
        _write_limit(memory, "memory.swap.max", 0, optional=True)  # no swap to hide in
    elif memory and limit:
        _write_limit(memory, "memory.limit_in_bytes", limit)
        _write_limit(memory, "memory.memsw.limit_in_bytes", limit, optional=True)
    if cpu and quota and v2:
        _write_limit(cpu, "cpu.max", f"{quota} {period}")
    elif cpu and quota:
        _write_limit(cpu, "cpu.cfs_period_us", period)
        _write_limit(cpu, "cpu.cfs_quota_us", quota)
    if pids and cgroup.get("max_pids"):
        _write_limit(pids, "pids.max", cgroup["max_pids"])  # the same name in v1 and v2


def _oom_kills(cgroup: dict[str, Any] | None) -> int:
    """How many processes the kernel's OOM killer killed in the sandbox's memory group."""
    if not cgroup or not cgroup.get("memory_dir"):
        return 0
    name = "memory.events" if cgroup["version"] == 2 else "memory.oom_control"
    try:
        with open(os.path.join(cgroup["memory_dir"], name), encoding="ascii") as handle:
            lines = handle.read().splitlines()
    except OSError:
        return 0
    counts = [int(line.split()[1]) for line in lines if line.startswith("oom_kill ")]
    return counts[0] if counts else 0


def _remove_cgroups(groups: list[str], limit_s: float = 2.0) -> None:
    """Remove the sandbox's (now empty) groups; a group still emptying is retried a while."""
    deadline = time.monotonic() + limit_s
    for group in groups:
        while os.path.isdir(group):
            try:
                os.rmdir(group)
            except OSError:
                if time.monotonic() > deadline:
                    break
                time.sleep(0.01)


def _await_setup(ns_pid: int, child: subprocess.Popen[bytes], limit_s: float = 10.0) -> bool:
    """Wait until bubblewrap has built the sandbox.

    bubblewrap reports its namespace pid before the sandbox's root is ready; its init forks
    the entrypoint only once setup is done, so the first child of that pid is the signal.
    """
    children = f"/proc/{ns_pid}/task/{ns_pid}/children"
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline and child.poll() is None:
        try:
            with open(children, encoding="ascii") as handle:
                if handle.read().strip():
                    return True
        except FileNotFoundError:
            return False
        time.sleep(0.001)
    return False


def _start_egress_proxy(proxy: dict[str, Any], groups: list[str], limit_s: float = 10.0) -> None:
    """Start corral's egress proxy for the sandbox (providers/egress/proxy.py) and wait
    until it listens. It is in the supervisor's process group, so it ends with the sandbox
    (the group is stopped and what is left is killed), and in the sandbox's cgroups (or
    under its own RLIMIT_AS), so that what the sandbox makes it hold counts against the
    sandbox. Its configuration, which holds the secret bindings' values, goes on its stdin,
    never on disk; what it logs goes to ``log_path``.

    Raises:
        RuntimeError: it did not start listening in time.
    """
    log = os.open(proxy["log_path"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    try:
        proxy_process = subprocess.Popen(
            proxy["argv"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=log,
            cwd=proxy["cwd"],
            # Few malloc arenas: a thread a connection would each reserve one under RLIMIT_AS.
            env={"PATH": "/usr/bin:/bin", "MALLOC_ARENA_MAX": "2"},
            preexec_fn=_memory_limit(proxy.get("memory_bytes"), groups),  # noqa: PLW1509
        )
    finally:
        os.close(log)
    assert proxy_process.stdin is not None and proxy_process.stdout is not None
    proxy_process.stdin.write(json.dumps(proxy["config"]).encode())
    proxy_process.stdin.close()
    ready = select.select([proxy_process.stdout], [], [], limit_s)[0]
    if not ready or proxy_process.stdout.readline().strip() != b"ready":
        raise RuntimeError("corral's egress proxy for this sandbox did not start")
    proxy_process.stdout.close()


def _start(
    launch: dict[str, Any], spawned: Callable[[], None], groups: list[str]
) -> tuple[subprocess.Popen[bytes], IO[bytes] | None, BoundedCopy]:
    """Start the egress proxy if there is one, then the entrypoint in ``groups``, then call
    ``spawned``; return the entrypoint, the bubblewrap status stream (kept open) and the
    copy of its output into the sandbox's log (the supervisor's stdout)."""
    if launch.get("egress_proxy"):
        _start_egress_proxy(launch["egress_proxy"], groups)
    argv = list(launch["argv"])
    env = dict(launch["env"])
    status_read = status_write = None
    if launch.get("bwrap_status"):
        status_read, status_write = os.pipe()
        argv[1:1] = ["--json-status-fd", str(status_write)]
    token_read = _token_pipe(launch.get("registration_token"), env)
    work_env = _work_env_file(launch.get("work_env"), env)
    pass_fds = tuple(fd for fd in (status_write, token_read, work_env) if fd is not None)
    # Its stdout and stderr are a pipe, never the log file: the supervisor bounds the log.
    output_read, output_write = output_pipe()
    output = BoundedCopy(output_read, 1, launch["log_max_bytes"], launch["log_tail_bytes"])
    # The supervisor is single-threaded, so preexec_fn is safe here.
    child = subprocess.Popen(
        argv,
        stdin=subprocess.DEVNULL,
        stdout=output_write,
        stderr=output_write,
        env=env,
        pass_fds=pass_fds,
        preexec_fn=_memory_limit(launch.get("memory_bytes"), groups),  # noqa: PLW1509
    )
    spawned()
    for fd in (*pass_fds, output_write):
        os.close(fd)
    started: dict[str, Any] = {"child_pid": child.pid, "ns_pid": None, "setup_ok": True}
    status: IO[bytes] | None = None
    if status_read is not None:
        status = os.fdopen(status_read, "rb")
        started.update(_await_sandbox(status, child))
        if not started["setup_ok"]:
            output.pump()  # bubblewrap's own words on why, before the provider reads them
    try:
        _write_json(launch["started_path"], started)
    except FileNotFoundError:
        # The sandbox was terminated (its directory removed) before this supervisor was on
        # its record: nobody else can end it, so it ends as if asked to.
        _Term.requested = True
    return child, status, output


def _work_env_file(work_env: dict[str, Any] | None, env: dict[str, str]) -> int | None:
    """A memory file holding the work's variables (JSON), whose descriptor the entrypoint
    inherits, named in ``env`` (``work_env["variable"]``): they are applied inside the
    sandbox (corral.runner.work_env), never the environment of bubblewrap or setpriv, which
    run on the host. A file, not a pipe: any size is written before anyone reads."""
    if not work_env or not work_env.get("values"):
        return None
    fd = os.memfd_create("corral-work-env")  # close-on-exec: pass_fds hands it on
    data = json.dumps(work_env["values"]).encode()
    while data:
        data = data[os.write(fd, data) :]
    os.lseek(fd, 0, os.SEEK_SET)
    env[work_env["variable"]] = str(fd)
    return fd


def _token_pipe(token: str | None, env: dict[str, str]) -> int | None:
    """A pipe holding the registration token, whose read end the entrypoint inherits, named
    in ``env`` (``CORRAL_REGISTRATION_TOKEN_FD``): the token is in no environment block, not
    even bubblewrap's, which a process of the sandbox's user could read."""
    if not token:
        return None
    read_end, write_end = os.pipe()
    os.write(write_end, token.encode())  # far below a pipe's buffer: it cannot block
    os.close(write_end)
    env["CORRAL_REGISTRATION_TOKEN_FD"] = str(read_end)
    return read_end


def _await_sandbox(status: IO[bytes], child: subprocess.Popen[bytes]) -> dict[str, Any]:
    """Read bubblewrap's status stream until the sandbox is built, or known not to be.

    bubblewrap writes {"child-pid": N} first, and {"exit-code": N} only if the entrypoint
    really ran. Setup and exec failures write no exit code.
    """
    first = status.readline()
    ns_pid = json.loads(first).get("child-pid") if first.strip() else None
    if ns_pid is not None and _await_setup(ns_pid, child):
        return {"ns_pid": ns_pid, "setup_ok": True}
    # The entrypoint was never seen running: it either finished at once or never started.
    return {"ns_pid": None, "setup_ok": b'"exit-code"' in status.read()}


# keyctl(2) by number, as the C library has no wrapper for it; elsewhere keyrings are left.
_KEYCTL = {"x86_64": 250, "aarch64": 219}.get(os.uname().machine)
_KEYCTL_GET_PERSISTENT, _KEYCTL_CLEAR = 22, 7
_USER_KEYRINGS = (-4, -5)  # KEY_SPEC_USER_KEYRING, KEY_SPEC_USER_SESSION_KEYRING


def _clear_keyrings(owner: list[int] | None) -> None:
    """Empty the keyrings the kernel keeps for the sandbox's uid beyond its processes (its
    user, user-session and persistent keyrings), so that the sandbox given the uid next finds
    nothing of this one's. Done as that uid, in a child: the sandbox has ended, so no process
    of the uid is left to meet it (and it is as non-dumpable as this one)."""
    if not owner or _KEYCTL is None:
        return
    child = os.fork()
    if child == 0:
        try:
            os.setgroups([])
            os.setresgid(owner[1], owner[1], owner[1])
            os.setresuid(owner[0], owner[0], owner[0])
            syscall = ctypes.CDLL(None, use_errno=True).syscall
            persistent = syscall(_KEYCTL, _KEYCTL_GET_PERSISTENT, -1, _USER_KEYRINGS[0])
            for keyring in (persistent, *_USER_KEYRINGS):
                if keyring != -1:  # no persistent keyrings in this kernel
                    syscall(_KEYCTL, _KEYCTL_CLEAR, keyring)
        finally:
            os._exit(0)
    os.waitpid(child, 0)


_PR_SET_DUMPABLE = 4  # linux/prctl.h
_PR_SET_CHILD_SUBREAPER = 36
_END_LIMIT_S = 5.0
_POLL_S = 0.005  # how often a child is looked at where the kernel has no pidfd


def _find_prctl() -> Callable[..., int] | None:
    try:
        prctl: Callable[..., int] = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    return prctl


# Looked up once, in the spawner: a supervisor's start does not pay for it.
_PRCTL = _find_prctl()


def _become_subreaper() -> None:
    """Orphaned processes of the sandbox become this process's children (Linux 3.4+); best
    effort: elsewhere they go to init, as before."""
    if _PRCTL is not None:
        _PRCTL(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)


def _stat(pid: int | str) -> list[str] | None:
    """The fields of /proc/PID/stat after the command name (state, parent, group, ...)."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as handle:
            stat = handle.read()
    except OSError:
        return None  # gone
    # The name may hold spaces and parentheses; the fields after its last ")" are fixed.
    return stat[stat.rindex(")") + 2 :].split()


def _left_behind(me: int, groups: list[str]) -> list[int]:
    """Live processes of this sandbox but the supervisor: those of its cgroup and the
    supervisor's children (what it adopted as subreaper: one that left the group, or a
    group that cannot be read, is found once its parents are gone); without a group, its
    process group and its children, from a walk of /proc. A group's list and the children's
    are two short reads; the walk reads every process of the host (5 ms at 300)."""
    members = _members(groups[0]) if groups else None
    children = _children(me)
    if members is None or children is None:
        return _walk_proc(me)
    return sorted({*members, *(c for c in children if (_stat(c) or ["Z"])[0] != "Z")} - {me})


def _members(group: str) -> set[int] | None:
    """The processes in ``group``; None when it cannot be read."""
    try:
        with open(os.path.join(group, "cgroup.procs"), encoding="ascii") as handle:
            return {int(line) for line in handle.read().split()}
    except OSError:
        return None


def _children(me: int) -> list[int] | None:
    """This process's children (zombies too); None where the kernel does not list them."""
    try:
        with open(f"/proc/{me}/task/{me}/children", encoding="ascii") as handle:
            return [int(pid) for pid in handle.read().split()]
    except OSError:
        return None


def _walk_proc(me: int) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == me:
            continue
        fields = _stat(entry)
        if fields is None:
            continue
        state, parent, group = fields[0], int(fields[1]), int(fields[2])
        if state != "Z" and me in (group, parent):
            found.append(int(entry))
    return found


def _reap_exited() -> bool:
    """Collect every child that has ended; whether any child is still running."""
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return False
        if pid == 0:
            return True


def _end_sandbox(groups: list[str], limit_s: float = _END_LIMIT_S) -> None:
    """Kill what the entrypoint left behind and reap it, until nothing is left (or, should a
    process keep escaping, until ``limit_s`` has passed)."""
    me = os.getpid()
    deadline = time.monotonic() + limit_s
    while True:
        left = _left_behind(me, groups)
        for pid in left:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        running = _reap_exited()
        if (not left and not running) or time.monotonic() > deadline:
            return
        time.sleep(0.002)


class _TerminationRequestedError(Exception):
    """SIGTERM arrived: the provider is terminating the sandbox."""


class _Term:
    """What SIGTERM has done so far (a signal handler has no other place to keep state).

    Only the first TERM counts, and it interrupts only the wait for the entrypoint (armed):
    one that lands while the entrypoint starts is raised once it has started. Once the
    supervisor is stopping the group (which sends TERM to itself too) or writing its result,
    further ones change nothing."""

    requested = False
    armed = False
    stopping = False


def _on_term(signum: int, frame: object) -> None:
    if _Term.stopping or _Term.requested:
        return
    _Term.requested = True
    if _Term.armed:
        _Term.stopping = True
        raise _TerminationRequestedError


def _arm_termination() -> None:
    """From here on a TERM interrupts; one that came while the entrypoint started does now."""
    _Term.armed = True
    if _Term.requested and not _Term.stopping:
        _Term.stopping = True
        raise _TerminationRequestedError


def _wait(child: subprocess.Popen[bytes], timeout_s: float | None, output: BoundedCopy) -> int:
    """``child.wait(timeout_s)``, copying the sandbox's output meanwhile.

    Raises:
        subprocess.TimeoutExpired: the child is still running at the timeout.
    """
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    try:
        exited: int | None = os.pidfd_open(child.pid)
    except OSError:  # a kernel before 5.3: the child is looked at every few milliseconds
        exited = None
    try:
        while (code := child.poll()) is None:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise subprocess.TimeoutExpired(child.args, timeout_s or 0)
            if exited is None:
                left = _POLL_S if left is None else min(left, _POLL_S)
            waiting = [
                fd for fd in (exited, output.source if output.open else None) if fd is not None
            ]
            if output.source in select.select(waiting, [], [], left)[0]:
                output.pump()
        return code
    finally:
        if exited is not None:
            os.close(exited)


def _stop_group(child: subprocess.Popen[bytes], grace_s: float, output: BoundedCopy) -> int | None:
    """TERM the whole group, give it ``grace_s`` to exit, and report the child's code."""
    _Term.stopping = True
    os.killpg(0, signal.SIGTERM)
    try:
        return _wait(child, grace_s, output)
    except subprocess.TimeoutExpired:
        return None


def supervise(
    launch: dict[str, Any], spawned: Callable[[], None], built: Callable[[], None]
) -> NoReturn:
    """Run one sandbox to its end and write its result; never returns. ``spawned`` is called
    once the entrypoint's process exists, ``built`` once it runs (or is known not to)."""
    signal.signal(signal.SIGTERM, _on_term)
    _become_subreaper()
    groups = _make_cgroups(launch.get("cgroup"))
    child, status_stream, output = _start(launch, spawned, groups)
    built()
    grace_s = launch.get("grace_s", 5)
    try:
        _arm_termination()
        exit_code = _wait(child, launch.get("timeout_s"), output)
        result: dict[str, Any] = {"reason": "exited", "exit_code": exit_code}
    except subprocess.TimeoutExpired:
        result = {"reason": "deadline", "exit_code": _stop_group(child, grace_s, output)}
    except _TerminationRequestedError:
        result = {"reason": "terminated", "exit_code": _stop_group(child, grace_s, output)}
    _Term.stopping = True  # from here on, nothing interrupts writing the result
    if status_stream is not None:
        # Held open until here so bubblewrap can always report the exit code.
        status_stream.close()
    result["ended_at"] = time.time()
    # The entrypoint is done: nothing it left behind outlives it. Ended before the result is
    # written, so that a sandbox read as finished has no process left but this one.
    _end_sandbox(groups)
    output.finish()
    _clear_keyrings(launch.get("owner"))  # before the result: it hands the uid on
    if _oom_kills(launch.get("cgroup")):
        result["out_of_memory"] = True
    _remove_cgroups(groups)
    _write_json(launch["result_path"], result)
    sys.stdout.flush()
    # Gone the moment the result is there, without the interpreter's teardown: whoever waits
    # for this supervisor to end (a terminate in another process) reads the result just after.
    os._exit(0)


# -- the spawner ----------------------------------------------------------------------------
#
# Launches come as framed messages (a 10-digit length, then the JSON) on the spawner's stdin,
# which the spare reads itself: one process wakes between the provider's write and the
# entrypoint's start. The spare answers on the spawner's stdout (its inherited copy), and
# tells the spawner on a pipe of its own that it took a launch, then that its sandbox is
# built (by closing the pipe); see serve() for when the next spare is forked.

_HEADER = 10


def _read_exactly(fd: int, size: int) -> bytes:
    """``size`` bytes from ``fd``, or fewer if the file ends first."""
    data = b""
    while len(data) < size:
        chunk = os.read(fd, size - len(data))
        if not chunk:
            break
        data += chunk
    return data


def _read_launch() -> dict[str, Any] | None:
    """The next launch on stdin; None once stdin has closed."""
    header = _read_exactly(0, _HEADER)
    if len(header) < _HEADER:
        return None
    launch: dict[str, Any] = json.loads(_read_exactly(0, int(header)))
    return launch


def _take_sandbox(launch: dict[str, Any]) -> None:
    """The supervisor's working directory and output become the sandbox's, and it lets go
    of the spawner's pipes to the worker."""
    os.chdir(launch["cwd"])
    null = os.open(os.devnull, os.O_RDONLY)
    log = os.open(launch["log_path"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o666)
    for target, source in ((0, null), (1, log), (2, log)):
        os.dup2(source, target)
    os.close(null)
    os.close(log)


def _record_supervisor(record_path: str, pid: int, start: int | None) -> None:
    """Name the supervisor in the sandbox's record (written by the provider beforehand)."""
    try:
        with open(record_path, encoding="utf-8") as handle:
            record = json.load(handle)
        record.update(supervisor_pid=pid, supervisor_start=start)
        _write_json(record_path, record)
    except OSError:
        pass  # the sandbox was removed meanwhile: the supervisor ends it (see _start)


class _Announcer:
    """What a supervisor tells once its entrypoint's process exists (or it failed before):
    it goes on its sandbox's record, answers the provider and tells the spawner it took the
    launch; and, once the sandbox is built, that the spawner may fork the next spare (which
    it does sooner if another launch waits). Each of them once."""

    def __init__(self, launch: dict[str, Any], answer: int, taken: int) -> None:
        self.record_path = launch["record_path"]
        self.answer, self.taken = answer, taken

    def spawned(self) -> None:
        if self.answer < 0:
            return
        pid = os.getpid()
        fields = _stat(pid)
        start = None if fields is None else int(fields[19])
        _record_supervisor(self.record_path, pid, start)
        with contextlib.suppress(BrokenPipeError):  # the worker died waiting: the record tells
            os.write(self.answer, json.dumps({"pid": pid, "start": start}).encode() + b"\n")
        os.close(self.answer)
        self.answer = -1
        with contextlib.suppress(BrokenPipeError):  # the spawner was killed: no next spare
            os.write(self.taken, b"L")

    def built(self) -> None:
        if self.taken >= 0:
            os.close(self.taken)
            self.taken = -1


def _spare(settled: int, taken: int) -> NoReturn:
    """A spare's life: lead a new session, take the next launch and supervise it. Never
    returns to the spawner's loop; a spare that finds stdin closed just exits."""
    launch = None
    try:
        os.setsid()
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        os.close(settled)  # the spawner may now let it take a launch
        launch = _read_launch()
        if launch is not None:
            announcer = _Announcer(launch, os.dup(1), taken)
            try:
                _take_sandbox(launch)
                supervise(launch, announcer.spawned, announcer.built)
            finally:  # it failed before its entrypoint ran: the provider finds it ended
                announcer.spawned()
                announcer.built()
    except BaseException:  # whatever it was (a TERM raised early too), the log shows it
        traceback.print_exc()
        sys.stderr.flush()
    os._exit(0 if launch is None else 1)


def _fork_spare() -> int:
    """Fork the next supervisor ahead of its launch, so that no fork lies between a launch
    and its sandbox. Returns once the spare leads its own session, with the pipe on which
    it says it took a launch ("L"), and ends once its sandbox is built (end of file without
    a word: it ended without a launch)."""
    ready, settled = os.pipe()
    said, taken = os.pipe()
    if os.fork() == 0:
        os.close(ready)
        os.close(said)
        _spare(settled, taken)
    os.close(settled)
    os.close(taken)
    os.read(ready, 1)  # end of file once the spare leads its session (or has died)
    os.close(ready)
    return said


def _on_child(signum: int, frame: object) -> None:
    _reap_exited()


def serve() -> None:
    """The spawner: always one spare waiting for a launch, until one finds stdin closed (or
    dies without a launch: the stream is not to be trusted then); then wait for the last of
    the supervisors. Non-dumpable, as are the supervisors it forks: a launch holds the
    sandbox's registration token, which no process of the sandbox's user may read."""
    if _PRCTL is not None:
        _PRCTL(_PR_SET_DUMPABLE, 0, 0, 0, 0)
    _become_subreaper()
    signal.signal(signal.SIGCHLD, _on_child)
    while True:
        said = _fork_spare()
        if not os.read(said, 1):
            os.close(said)
            break
        # The next fork waits until this sandbox is built, so as not to take CPU from its
        # start, unless another launch is already waiting (or stdin has closed).
        select.select([said, 0], [], [])
        os.close(said)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    while True:
        try:
            os.wait()
        except ChildProcessError:
            return


if __name__ == "__main__":
    serve()
