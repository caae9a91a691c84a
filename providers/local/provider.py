"""The local provider: each sandbox is a process group on this host.

Layout, one directory per sandbox under the configured root::

    <root>/<sandbox_id>/sandbox.json   what the provider knows (ids, labels, pids, deadline)
    <root>/<sandbox_id>/started.json   written by the supervisor once the entrypoint runs
    <root>/<sandbox_id>/result.json    written by the supervisor when the entrypoint ends
    <root>/<sandbox_id>/output.log     the entrypoint's stdout and stderr (max_log_mb at most)
    <root>/<sandbox_id>/work/          the sandbox's working directory (its HOME)
    <root>/<sandbox_id>/disk.img       its disk (disk_mb), mounted at disk/ (see ``disk``)
    <root>/<sandbox_id>/egress/        the egress proxy's Unix socket (with allowed_hosts)
    <root>/<sandbox_id>/egress.log     what the egress proxy refused and let through

Each sandbox has a supervisor (:mod:`corral.providers.local.supervisor`), forked ahead of time by
a spawner the provider starts once (:mod:`corral.providers.local.spawner`), so that no Python
interpreter starts between ``provision()`` and the entrypoint. Everything lives on disk, so
a worker that restarts finds the sandboxes it started (``list_managed``) and can still
report on and terminate them. ``terminate`` removes the directory; a sandbox whose directory
is gone reads as terminated.

Isolation: each sandbox runs under bubblewrap in its own pid, mount, ipc, uts and network
namespaces; see :mod:`corral.providers.local.isolation`. ``isolation="auto"`` (the default)
and ``"required"`` both refuse to provision without bubblewrap (the health check says so);
only an explicit ``"off"`` runs without it, for trusted work alone: a warning is logged, a
spec with ``allow_network=false`` or ``allowed_hosts`` is refused (nothing could enforce
it), and under a root worker the work still runs as the unprivileged sandbox user.

The tenant's environment: bubblewrap, setpriv, nsenter and ``timeout`` run on the host with
a fixed environment of corral's; the work's variables reach the sandbox in a memory file
and are applied inside it, once privileges are dropped (:mod:`corral.runner.work_env`).

Network: a sandbox never shares the host's network namespace. With ``allow_network`` (with
or without ``allowed_hosts``) corral's egress proxy (:mod:`corral.providers.egress.proxy`)
is its only way out, through a Unix socket mounted at ``/run/corral/egress``: it allows the
listed hosts (any host without a list) and connects only to open addresses, never to
loopback, private or link-local ones unless the deployment opened them
(``CORRAL_EGRESS_OPEN_NETWORKS``). The supervisor starts it before the entrypoint, under
bubblewrap of its own (the host's network, none of the sandbox's files), as the sandbox's
user and inside the sandbox's cgroup; it ends with the sandbox, however the sandbox ends.

Memory (and CPU) limits: a cgroup of the sandbox's own where one can be made, else RLIMIT_AS
(:mod:`corral.providers.local.limits`); a sandbox the kernel's OOM killer hit ends with
reason ``out_of_memory``. Processes: a pids group of its own (``max_pids``). A session exec
joins the sandbox's groups (or takes its RLIMIT_AS) before it runs anything of the sandbox's.

Users: under a root worker each live sandbox runs as a uid (and gid) of its own, the lowest
of the configured range no live sandbox holds, kept in its record (``run_as``), so that
per-uid kernel quotas are not shared between sandboxes.

Disk: under a root worker an isolated sandbox's work directory, home and /tmp are on a
filesystem image of its own of ``disk_mb`` (:mod:`corral.providers.local.disk`); its output
reaches ``output.log`` through its supervisor, within ``max_log_mb``
(:mod:`corral.providers.local.output`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import functools
import json
import logging
import os
import shutil
import signal
import time
import weakref
from collections.abc import Iterator, Mapping, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Literal

from pydantic import Field

from corral import runner
from corral.providers.base import (
    DEFAULT_DOWNLOAD_MAX_BYTES,
    DEFAULT_EXEC_OUTPUT_MAX_BYTES,
    Capacity,
    ExecResult,
    ManagedSandbox,
    ProviderHealth,
    SandboxHandle,
    SandboxProvider,
    SandboxSpec,
    SandboxState,
    SandboxStatus,
)
from corral.providers.config import ProviderConfig, ProviderOptions
from corral.providers.descriptors import BUILTIN
from corral.providers.egress.plan import PROXY_MODULES, PROXY_SCRIPT, plan_proxy
from corral.providers.errors import (
    CapacityExhaustedError,
    InvalidProviderConfigError,
    SandboxCreateError,
    SandboxNotRunningError,
    SandboxPathError,
    SandboxVerificationError,
)
from corral.providers.local.disk import SandboxDisk, disk_template, find_disk_tools
from corral.providers.local.files import WorkDirectory, relative_parts
from corral.providers.local.isolation import (
    SANDBOX_LIB_DIR,
    IsolationPlan,
    as_user,
    base_python,
    bwrap_takes_size,
    find_bwrap,
    find_setpriv,
)
from corral.providers.local.limits import (
    OOM_EVENTS,
    Choice,
    Mechanism,
    detect,
    group_dirs,
    limits_memory,
)
from corral.providers.local.processes import (
    await_exit,
    owns_group,
    process_alive,
    run_bounded,
    signal_group,
)
from corral.providers.local.runner_copy import compiled_copy
from corral.providers.local.spawner import SupervisorSpawner
from corral.providers.size_limits import file_tail
from corral.runner.work_env import WORK_ENV_FD_VARIABLE

logger = logging.getLogger(__name__)

RUNNER_PACKAGE = Path(runner.__file__).resolve().parent
# Applies the work's variables inside the sandbox, then executes the command after it.
WORK_ENV_SCRIPT = "work_env.py"
# Where corral's egress proxy script (and the modules it imports from beside it) is seen
# under its own bubblewrap.
PROXY_DIR_IN_SANDBOX = "/run/corral/proxy"
PROXY_SCRIPT_IN_SANDBOX = f"{PROXY_DIR_IN_SANDBOX}/egress_proxy.py"
# RLIMIT_AS of the egress proxy where no cgroup holds it with the sandbox.
PROXY_MEMORY_BYTES = 256 * 1024 * 1024
# Where an isolated runner reads its sandbox's OOM-kill count (runner/memory.py).
SANDBOX_OOM_EVENTS = "/run/corral/oom-events"
BASE_PATH = "/usr/local/bin:/usr/bin:/bin"
# What a session exec runs first, on the host: it joins the sandbox's cgroups (its own $$, so
# everything it executes is in them) and takes the sandbox's RLIMIT_AS in KiB ("" for none),
# then executes the rest. Fixed; its arguments come from the sandbox's record, never a client.
JOIN_LIMITS_SCRIPT = """\
limit=$1; shift
while [ "$1" != -- ]; do
  { echo $$ > "$1/cgroup.procs"; } 2>/dev/null || {
    echo "corral: the command could not join its sandbox's limits" >&2; exit 125; }
  shift
done
shift
if [ -n "$limit" ]; then ulimit -v "$limit" || exit 125; fi
exec "$@"
"""
START_TIMEOUT_S = 10.0
# What a sandbox's log keeps of the output dropped past max_log_mb: its end, which the end log
# shows (corral.shared.end_logs reads far less).
LOG_TAIL_BYTES = 64 * 1024
EXIT_WAIT_S = 5.0


class LocalProviderConfig(ProviderConfig):
    """Configuration of the local provider on one host."""

    root_dir: Path | None = Field(
        default=None,
        description="Where sandbox directories live; default <CORRAL_STATE_DIR>/local-sandboxes.",
    )
    command: tuple[str, ...] = Field(
        # -S: the runner, which holds the sandbox's tokens, runs no code of the host's
        # site-packages (.pth files, sitecustomize) nor of its home's user site, and starts
        # without them (it needs only the standard library).
        default=(base_python(), "-S", "-m", "runner"),
        min_length=1,
        description="The sandbox entrypoint: corral's runner unless a pool says otherwise.",
    )
    isolation: Literal["auto", "required", "off"] = Field(
        default="auto",
        description="auto and required: bubblewrap, or refuse to provision; off: plain "
        "process groups in the host's namespaces, for trusted work only (logged as a warning).",
    )
    bwrap_path: str = Field(default="bwrap", description="bubblewrap executable name or path.")
    max_concurrent: int | None = Field(default=None, gt=0, description="live sandboxes at most")
    default_timeout_s: int = Field(default=3600, gt=0, description="deadline when none is asked")
    default_memory_mb: int | None = Field(
        default=None, gt=0, description="memory limit when the spec asks for none"
    )
    resource_limits: Choice = Field(
        default="auto",
        description="auto: a cgroup of each sandbox's own where this host lets corral make "
        "one, else RLIMIT_AS; cgroup: refuse to provision without one; rlimit: RLIMIT_AS "
        "(memory only, CPU not limited)",
    )
    grace_period_s: float = Field(default=5.0, ge=0, description="TERM to KILL on terminate")
    read_only_binds: tuple[str, ...] = Field(
        default=(), description="Extra host paths visible read-only inside isolated sandboxes."
    )
    tool_cache_dir: Path | None = Field(
        default=None,
        description="a directory visible read-only in every sandbox at the same path, named "
        "by CORRAL_TOOL_CACHE: where kits are found offline",
    )
    max_pids: int = Field(
        default=1024,
        gt=0,
        description="processes and threads a sandbox may have at once, its session execs and "
        "egress proxy included: pids.max of a pids cgroup of its own, where this host lets "
        "corral make one",
    )
    disk_mb: int | None = Field(
        default=10240,
        ge=16,
        description="what an isolated sandbox may write to this host's disk at most, in MiB "
        "(its work directory, home and /tmp): a filesystem image of its own under a root "
        "worker, which refuses to provision where it cannot make one; null: not bounded",
    )
    max_log_mb: int = Field(
        default=64,
        gt=0,
        description="what a sandbox's log (output.log: its entrypoint's stdout and stderr) "
        "keeps at most, in MiB; past it the output is dropped but for its last 64 KiB, kept "
        "at the log's end",
    )
    sandbox_uid: int = Field(
        default=10001,
        gt=0,
        description="The first uid of the range isolated sandboxes run as when the worker runs "
        "as root: each live sandbox has one of its own (a worker that is not root runs them "
        "as itself).",
    )
    sandbox_gid: int = Field(
        default=10001, gt=0, description="The first gid of the range, likewise (uid's offset)."
    )
    sandbox_uid_count: int = Field(
        default=1000,
        gt=0,
        description="How many uids (and gids) the range holds: live sandboxes at most under a "
        "root worker",
    )


class LocalProviderOptions(ProviderOptions):
    """Per-sandbox options of the local provider."""

    command: tuple[str, ...] | None = Field(
        default=None, min_length=1, description="Run this argv instead of the configured one."
    )


class LocalProvider(SandboxProvider):
    """Sandboxes as process groups on this host, each under bubblewrap (unless isolation is off)."""

    id = "local"
    display_name = BUILTIN["local"].display_name
    config_model = LocalProviderConfig
    options_model = LocalProviderOptions
    mounts_api_socket = True
    egress_through_proxy = True
    config: LocalProviderConfig

    def __init__(self, config: LocalProviderConfig | Mapping[str, Any] | None = None) -> None:
        super().__init__(config)
        # Supervisors are the spawner's children, and it collects them as they end, whichever
        # process ends their sandboxes (usually the maintenance worker, not this one).
        self._spawner = SupervisorSpawner(BASE_PATH)
        # A provider that goes away lets its spawner go once its sandboxes have ended.
        weakref.finalize(self, self._spawner.close)
        if self.config.isolation == "off":
            logger.warning(
                "the local provider runs with isolation=off: sandboxes share this host's "
                "namespaces and network; run trusted work only"
            )
        elif self.config.disk_mb is not None and os.geteuid() != 0:
            logger.warning(
                "the local provider runs as a user other than root: what its sandboxes write "
                "to their work directories is not bounded (disk_mb needs a filesystem image "
                "per sandbox, which needs root)"
            )

    @functools.cached_property
    def runner_package(self) -> Path:
        """The runner package its sandboxes import: a copy compiled once (runner_copy)."""
        return compiled_copy(RUNNER_PACKAGE, self.root)

    @functools.cached_property
    def limits(self) -> Mechanism:
        """How this host limits sandboxes' memory and CPU (found once).

        Raises:
            InvalidProviderConfigError: ``resource_limits`` is ``cgroup`` and no cgroup can
                be made here.
        """
        found = detect(self.config.resource_limits)
        if self.config.resource_limits == "cgroup" and found.kind != "cgroup":
            raise InvalidProviderConfigError(
                f"resource_limits is cgroup, but {found.why}; give corral a writable cgroup "
                "(cgroup v2 with the memory controller delegated, or a writable cgroup v1 "
                "memory hierarchy) or set resource_limits to auto or rlimit"
            )
        return found

    @property
    def root(self) -> Path:
        """Where sandboxes' directories are: the configured ``root_dir``, else
        ``local-sandboxes`` in the deployment's state directory."""
        return self.config.root_dir or self.state_dir / "local-sandboxes"

    # -- lifecycle -----------------------------------------------------------------------

    def provision(self, spec: SandboxSpec) -> SandboxHandle:
        options = self.parse_options(spec)
        assert isinstance(options, LocalProviderOptions)
        if spec.resources.gpu:
            raise InvalidProviderConfigError(
                "the local provider has no GPUs; route GPU work to a pool that declares gpu"
            )
        bwrap = self._bwrap_for(spec)
        base = self._run_as(bwrap)  # it may refuse: before anything is made
        disk = self._bounded_disk(bwrap)  # and so may this
        command = options.command or self.config.command
        if options.command is None:
            # The deployment's own command only: a pool's is never looked up on the host
            # (that would tell whether a host path exists); a missing one fails in the sandbox.
            _check_entrypoint(command[0], BASE_PATH)
        self.root.mkdir(parents=True, exist_ok=True)
        # Only what decides whether and as whom the sandbox starts is made under the host
        # lock: its record (which holds its place and its uid from then on, see capacity()).
        # Its disk and its start are not: the sandboxes of a host start side by side.
        with self._host_lock():
            box = _SandboxDir(self.root, spec.sandbox_id)
            if box.path.exists():
                return self._adopt(spec, box)
            self._check_capacity()
            launch = self._prepare(spec, box, command, bwrap, base)
        return self._start(spec, box, launch, disk_bytes=disk)

    def status(self, handle: SandboxHandle) -> SandboxStatus:
        box = _SandboxDir(self.root, handle.external_id)
        record = box.read("sandbox.json")
        if record is None:
            return SandboxStatus(state=SandboxState.TERMINATED, reason="sandbox no longer exists")
        result = box.read("result.json")
        if result is not None:
            # The supervisor exits right after writing its result: wait for that, so that a
            # final state always means no process is left.
            _await_exit(record, EXIT_WAIT_S)
            return _status_from_result(result, record)
        if record["supervisor_pid"] is None:
            return SandboxStatus(state=SandboxState.PROVISIONING)
        if process_alive(record["supervisor_pid"], record["supervisor_start"]):
            return SandboxStatus(state=SandboxState.RUNNING)
        if record.get("terminate_requested_at"):
            return SandboxStatus(state=SandboxState.TERMINATED, reason="terminated")
        return SandboxStatus(
            state=SandboxState.FAILED,
            reason="the sandbox's supervisor was killed from outside before it finished",
        )

    def terminate(self, handle: SandboxHandle) -> None:
        box = _SandboxDir(self.root, handle.external_id)
        record = box.read("sandbox.json")
        if record is not None:
            box.write("sandbox.json", {**record, "terminate_requested_at": time.time()})
            self._kill_group(record)
            _remove_groups(record)
        SandboxDisk(box.path).release(box.work)  # before its files go: they are on it
        with contextlib.suppress(FileNotFoundError):
            shutil.rmtree(box.path)

    def health_check(self, org_id: str | None = None) -> ProviderHealth:
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            probe = self.root / ".health"
            probe.write_text("ok")
            probe.unlink()
        except OSError as exc:
            return ProviderHealth(healthy=False, message=f"sandbox root {self.root}: {exc}")
        bwrap = find_bwrap(self.config.bwrap_path)
        if bwrap is None and self.config.isolation != "off":
            return ProviderHealth(
                healthy=False,
                message=f"isolation is {self.config.isolation} but bubblewrap "
                f"({self.config.bwrap_path}) is not installed: apt-get install bubblewrap "
                "(isolation: off runs trusted work only)",
            )
        mode = "off" if self.config.isolation == "off" or bwrap is None else f"bubblewrap {bwrap}"
        try:
            limits = self.limits.describe()
        except InvalidProviderConfigError as exc:
            return ProviderHealth(healthy=False, message=exc.message)
        disk = self._describe_disk(bwrap)
        if disk is None:
            return ProviderHealth(healthy=False, message=self._disk_refusal())
        return ProviderHealth(
            healthy=True,
            message=f"root {self.root}; isolation: {mode}; limits: {limits}; disk: {disk}; "
            f"output log: at most {self.config.max_log_mb} MiB",
        )

    def _describe_disk(self, bwrap: str | None) -> str | None:
        """How a sandbox's disk is bounded here, in words; None where a root worker cannot
        bound it as configured (it refuses to provision)."""
        if self.config.disk_mb is None:
            return "not bounded (disk_mb is null)"
        if bwrap is None:
            return "not bounded (no isolation)"
        tools = find_disk_tools()
        if tools.usable:
            return f"{self.config.disk_mb} MiB per sandbox (an ext4 image of its own)"
        if os.geteuid() == 0:
            return None
        tmp = f"its /tmp a tmpfs of {self.config.disk_mb} MiB"
        if not bwrap_takes_size(bwrap):
            tmp = "nor its /tmp (this bubblewrap has no --size)"
        return f"not bounded: the work directory ({tools.why_not}); {tmp}"

    def _disk_refusal(self) -> str:
        return (
            f"the local provider bounds what each sandbox writes to this host's disk "
            f"(disk_mb: {self.config.disk_mb}) with a filesystem image of its own, and cannot "
            f"make one here: {find_disk_tools().why_not}; provide it, or set disk_mb to null "
            "(not bounded: a sandbox can then fill this host's disk)"
        )

    def _bounded_disk(self, bwrap: str | None) -> int | None:
        """The size of a new sandbox's disk image: ``disk_mb``, for an isolated sandbox under
        a root worker; None when it gets none (no bound, or one this worker cannot make).

        Raises:
            SandboxCreateError: the worker is root and cannot make an image here.
        """
        if bwrap is None or self.config.disk_mb is None:
            return None
        if not find_disk_tools().usable:
            if os.geteuid() == 0:
                raise SandboxCreateError(self._disk_refusal())
            return None
        return self.config.disk_mb * 1024 * 1024

    # -- optional abilities ---------------------------------------------------------------

    def list_managed(self) -> list[ManagedSandbox]:
        managed = []
        for _, record in self._records():
            if record.get("terminate_requested_at"):
                continue
            handle = SandboxHandle(
                provider_id=self.id,
                external_id=record["sandbox_id"],
                metadata={"org_id": record["org_id"], "sandbox_id": record["sandbox_id"]},
            )
            managed.append(
                ManagedSandbox(
                    handle=handle,
                    sandbox_id=record["sandbox_id"],
                    labels=record["labels"],
                    started_at=datetime.fromtimestamp(record["started_at"], UTC),
                    state=self._listed_state(_SandboxDir(self.root, record["sandbox_id"]), record),
                )
            )
        return managed

    @staticmethod
    def _listed_state(box: _SandboxDir, record: dict[str, Any]) -> SandboxState:
        """The state as far as the files tell, without reaping (that is status()'s job)."""
        result = box.read("result.json")
        if result is not None:
            return _status_from_result(result, record).state
        if record["supervisor_pid"] is None:
            return SandboxState.PROVISIONING
        if process_alive(record["supervisor_pid"], record["supervisor_start"]):
            return SandboxState.RUNNING
        return SandboxState.FAILED

    def capacity(self) -> Capacity:
        """Live sandboxes: those whose supervisor runs, and those still being started (a
        record, no supervisor named yet), which hold their place from the moment their
        record is written under the host lock."""
        in_use = sum(
            1
            for directory, record in self._records()
            if not (directory / "result.json").exists()
            and (
                record["supervisor_pid"] is None
                or process_alive(record["supervisor_pid"], record["supervisor_start"])
            )
        )
        return Capacity(limit=self.config.max_concurrent, in_use=in_use)

    def stream_logs(self, handle: SandboxHandle, *, follow: bool = False) -> Iterator[str]:
        log_path = _SandboxDir(self.root, handle.external_id).path / "output.log"
        try:
            log = log_path.open("r", encoding="utf-8", errors="replace")
        except FileNotFoundError:
            return
        with log:
            pending = ""
            while True:
                chunk = log.readline()
                if chunk:
                    pending += chunk
                    if pending.endswith("\n"):
                        yield pending.rstrip("\n")
                        pending = ""
                    continue
                if not follow or self.status(handle).state.is_final:
                    break
                time.sleep(0.05)
            if pending:
                yield pending

    def end_log(self, handle: SandboxHandle, *, max_lines: int, max_bytes: int) -> str | None:
        box = _SandboxDir(self.root, handle.external_id)
        return box.tail_output(max_lines=max_lines, max_bytes=max_bytes)

    def exec_command(
        self,
        handle: SandboxHandle,
        command: str | Sequence[str],
        *,
        env: Mapping[str, str] | None = None,
        cwd: str | None = None,
        timeout_s: float | None = None,
        max_output_bytes: int = DEFAULT_EXEC_OUTPUT_MAX_BYTES,
    ) -> ExecResult:
        box = _SandboxDir(self.root, handle.external_id)
        record = box.read("sandbox.json")
        if record is None or self.status(handle).state is not SandboxState.RUNNING:
            raise SandboxNotRunningError(f"sandbox {handle.external_id} is not running")
        workdir = box.work
        if record["isolated"]:
            # The client's cwd is entered inside the sandbox alone (nsenter's inner cd, as
            # its user), checked as text here: the host never resolves or enters it.
            parts = relative_parts(cwd, workdir) if cwd else []
            directory = workdir.joinpath(*parts)
        else:
            directory = box.confine(cwd) if cwd else workdir
        argv = ["/bin/sh", "-c", command] if isinstance(command, str) else list(command)
        if env:  # applied inside the sandbox: never the environment of nsenter or timeout
            argv = [*work_env_prefix(isolated=record["isolated"]), *argv]
        if record["isolated"]:
            started = box.read("started.json") or {}
            if not started.get("ns_pid"):
                # Never run on the host what is meant for the sandbox.
                raise SandboxNotRunningError(
                    f"sandbox {handle.external_id} has no namespaces to run a command in"
                )
            argv = _entering(started["ns_pid"], record, directory, argv)
        argv = _within_limits(record, argv)
        host_env = {"PATH": BASE_PATH, "HOME": str(workdir)}
        # The command's timeout holds without this process too (a killed api): the guard
        # leads its process group and kills it.
        guard = shutil.which("timeout", path=BASE_PATH)
        with _work_env_file(env, host_env) as pass_fds:
            return run_bounded(
                argv,
                cwd=workdir if record["isolated"] else directory,
                env=host_env,
                timeout_s=timeout_s,
                max_output_bytes=max_output_bytes,
                guard=guard,
                pass_fds=pass_fds,
            )

    def upload_file(self, handle: SandboxHandle, source: Path, target: str) -> None:
        self._files(handle).upload(source, target)

    def download_file(
        self,
        handle: SandboxHandle,
        source: str,
        target: Path,
        *,
        max_bytes: int = DEFAULT_DOWNLOAD_MAX_BYTES,
    ) -> None:
        self._files(handle).download(source, target, max_bytes)

    def _files(self, handle: SandboxHandle) -> WorkDirectory:
        """The sandbox's work directory as file transfer reaches it: by descriptor, never by
        name (:mod:`corral.providers.local.files`); what is put there becomes its user's."""
        box = self._existing(handle)
        run_as = (box.read("sandbox.json") or {}).get("run_as")
        return WorkDirectory(box.work, (run_as[1], run_as[2]) if run_as else None)

    # -- internals -----------------------------------------------------------------------

    def _bwrap_for(self, spec: SandboxSpec) -> str | None:
        """bubblewrap's path, or None with isolation off.

        Raises:
            SandboxCreateError: bubblewrap is not installed (isolation auto or required),
                or the spec asks for what only isolation enforces.
        """
        if self.config.isolation == "off":
            bwrap = None
        else:
            bwrap = find_bwrap(self.config.bwrap_path)
            if bwrap is None:
                raise SandboxCreateError(
                    f"the local provider's isolation is {self.config.isolation} but "
                    f"bubblewrap ({self.config.bwrap_path}) is not installed: apt-get install "
                    "bubblewrap (isolation: off runs trusted work only)"
                )
        if bwrap is not None and (spec.egress.http_proxy or spec.egress.https_proxy):
            raise SandboxCreateError(
                "egress.http_proxy/https_proxy: a local sandbox's only way out is corral's "
                "egress proxy, so a proxy of the work's own cannot be reached; leave them out "
                "(allowed_hosts limits the destinations)"
            )
        if bwrap is None and (not spec.egress.allow_network or spec.egress.proxied):
            asked = "allow_network=false"
            if spec.egress.allow_network:
                asked = "allowed_hosts" if spec.egress.restricted else "a secret binding"
            raise SandboxCreateError(
                f"{asked} needs bubblewrap isolation, which is "
                f"{'off' if self.config.isolation == 'off' else 'not installed'} on this host; "
                "install bubblewrap or route the item to a provider that can cut the network"
            )
        return bwrap

    def _check_capacity(self) -> None:
        limit = self.config.max_concurrent
        if limit is not None and self.capacity().in_use >= limit:
            raise CapacityExhaustedError(
                f"local provider is at its limit of {limit} live sandboxes"
            )

    @contextlib.contextmanager
    def _host_lock(self) -> Iterator[None]:
        # Serialises capacity checks across the threads and processes of this host.
        with (self.root / ".lock").open("a") as lock_file:
            fcntl.flock(lock_file, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(lock_file, fcntl.LOCK_UN)

    def _prepare(
        self,
        spec: SandboxSpec,
        box: _SandboxDir,
        command: Sequence[str],
        bwrap: str | None,
        base: tuple[str, int, int] | None,
    ) -> dict[str, Any]:
        """Make the sandbox's directory and its record; its launch. Called under the host
        lock."""
        # Before anything is made: it may refuse (the uid range used up).
        run_as = self._own_identity(base)
        box.work.mkdir(parents=True)
        if run_as is not None:
            os.chown(box.work, run_as[1], run_as[2])
        try:
            launch = self._launch(spec, box, command, bwrap, run_as)
        except BaseException:  # e.g. the deployment's CA bundle unreadable: nothing stays
            shutil.rmtree(box.path, ignore_errors=True)
            raise
        started_at = time.time()
        record = {
            "sandbox_id": spec.sandbox_id,
            "org_id": spec.org_id,
            "labels": spec.managed_labels(),
            "supervisor_pid": None,
            "supervisor_start": None,
            "started_at": started_at,
            "deadline_at": started_at + launch["timeout_s"],
            "isolated": bwrap is not None,
            "allow_network": spec.egress.allow_network,
            "run_as": None if run_as is None else list(run_as),
            # What a session exec joins before it runs anything of the sandbox's.
            "cgroups": group_dirs(launch["cgroup"]),
            "rlimit_as_bytes": launch["memory_bytes"],
        }
        # Written before the process starts, so that a crash right after leaves a sandbox
        # that list_managed still finds; the spawner adds the supervisor's pid to it.
        box.write("sandbox.json", record)
        return launch

    def _start(
        self,
        spec: SandboxSpec,
        box: _SandboxDir,
        launch: dict[str, Any],
        *,
        disk_bytes: int | None = None,
    ) -> SandboxHandle:
        """Make the sandbox's disk (with ``disk_bytes``) and start it."""
        try:
            if disk_bytes:
                owner = launch["owner"]  # the sandbox's uid and gid, or None
                template = disk_template(find_disk_tools(), self.root, disk_bytes)
                SandboxDisk(box.path).make(template, box.work, owner and (owner[0], owner[1]))
            supervisor = self._spawner.spawn(launch, START_TIMEOUT_S)
        except SandboxCreateError:
            self.terminate(self._handle(spec, spec.sandbox_id))
            raise
        self._await_start(spec, box, supervisor, isolated=launch["bwrap_status"])
        return self._handle(spec, spec.sandbox_id)

    def _launch(
        self,
        spec: SandboxSpec,
        box: _SandboxDir,
        command: Sequence[str],
        bwrap: str | None,
        run_as: tuple[str, int, int] | None = None,
    ) -> dict[str, Any]:
        """What the supervisor is asked to run (the supervisor's launch). Its ``env`` is
        corral's alone; the work's variables go in ``work_env``, applied inside the sandbox,
        and the registration token on a pipe."""
        env = {
            "PATH": BASE_PATH,
            "HOME": str(box.work),
            "CORRAL_CONTROL_URL": spec.control_url,
            "CORRAL_SANDBOX_ID": spec.sandbox_id,
        }
        work_env = {**spec.work_env(), **spec.egress.sandbox_env()}
        cgroup, rlimit_bytes, binds = self._limits(spec, env, isolated=bwrap is not None)
        if self.config.tool_cache_dir is not None:
            cache = str(self.config.tool_cache_dir)
            env["CORRAL_TOOL_CACHE"] = cache
            binds.append((cache, cache))
        proxy, proxy_env = self._egress_proxy(spec, box, bwrap, run_as, limits_memory(cgroup))
        for name, value in proxy_env.items():
            (env if name.startswith("CORRAL_") else work_env)[name] = value
        argv = _applying_work_env(command, bool(work_env), isolated=bwrap is not None)
        if bwrap is not None:
            env["PYTHONPATH"] = SANDBOX_LIB_DIR
            plan = self._isolation_plan(spec, box, bwrap, run_as, proxied=proxy is not None)
            argv = dataclasses.replace(plan, extra_binds=tuple(binds)).argv(argv)
        else:
            env["PYTHONPATH"] = str(self.runner_package.parent)
        return {
            "argv": argv,
            "env": env,
            "work_env": {"variable": WORK_ENV_FD_VARIABLE, "values": work_env},
            "registration_token": spec.registration_token.get_secret_value(),
            "cwd": str(box.work),
            "timeout_s": spec.resources.timeout_s or self.config.default_timeout_s,
            "grace_s": self.config.grace_period_s,
            "memory_bytes": rlimit_bytes,
            "cgroup": cgroup,
            "log_path": str(box.path / "output.log"),
            "log_max_bytes": self.config.max_log_mb * 1024 * 1024,
            "log_tail_bytes": LOG_TAIL_BYTES,
            "record_path": str(box.path / "sandbox.json"),
            "result_path": str(box.path / "result.json"),
            "started_path": str(box.path / "started.json"),
            "bwrap_status": bwrap is not None,
            "egress_proxy": proxy,
            "owner": None if run_as is None else [run_as[1], run_as[2]],
        }

    def _limits(
        self, spec: SandboxSpec, env: dict[str, str], *, isolated: bool
    ) -> tuple[dict[str, Any] | None, int | None, list[tuple[str, str]]]:
        """The sandbox's cgroups (the launch's ``cgroup``), its RLIMIT_AS where no group
        limits its memory, and the bind of its OOM-kill count; ``env`` tells the runner how
        its memory is limited."""
        memory_mb = spec.resources.memory_mb or self.config.default_memory_mb
        memory_bytes = memory_mb * 1024 * 1024 if memory_mb else None
        cgroup = self.limits.launch(
            spec.sandbox_id, memory_bytes, spec.resources.cpu, max_pids=self.config.max_pids
        )
        if cgroup is not None and cgroup["memory_dir"]:
            events = os.path.join(cgroup["memory_dir"], OOM_EVENTS[cgroup["version"]])
            env["CORRAL_OOM_EVENTS"] = SANDBOX_OOM_EVENTS if isolated else events
            return cgroup, None, [(events, SANDBOX_OOM_EVENTS)]
        if memory_bytes:
            env["CORRAL_MEMORY_LIMIT"] = "rlimit"  # the runner recognises allocation failures
        return cgroup, memory_bytes, []

    def _egress_proxy(
        self,
        spec: SandboxSpec,
        box: _SandboxDir,
        bwrap: str | None,
        run_as: tuple[str, int, int] | None,
        memory_limited: bool,
    ) -> tuple[dict[str, Any] | None, dict[str, str]]:
        """What the supervisor starts as corral's egress proxy, for an isolated sandbox with
        network (it has none of its own: the proxy is its only way out, and ends with it),
        and the sandbox's variables for it. The proxy runs under bubblewrap of its own, in
        the host's network and nothing of the sandbox's files, as the sandbox's user, in its
        cgroups; under its own RLIMIT_AS unless they limit the sandbox's memory
        (``memory_limited``).

        Raises:
            SandboxCreateError: the deployment's CA bundle for destinations is unreadable.
        """
        if bwrap is None or not spec.egress.allow_network:
            return None, {}
        plan = plan_proxy(
            spec.egress,
            log_path=None,
            exit_after_s=None,
            # Its certificates outlive the sandbox's deadline by a little, not by more.
            valid_s=(spec.resources.timeout_s or self.config.default_timeout_s) + 60,
            open_networks=self.egress_open_networks,
            upstream_ca_file=self.egress_upstream_ca_file,
        )
        box.egress.mkdir()
        if run_as is not None:  # the proxy, as the sandbox's user, makes its socket there
            os.chown(box.egress, run_as[1], run_as[2])
        isolation = IsolationPlan(
            bwrap=bwrap,
            workdir=box.egress,
            hostname="corral-egress",
            share_network=True,
            extra_binds=tuple(
                (str(module), f"{PROXY_DIR_IN_SANDBOX}/{_name_in_sandbox(module)}")
                for module in PROXY_MODULES
            ),
            run_as=run_as,
        )
        launch = {
            "argv": isolation.argv([base_python(), "-I", "-S", PROXY_SCRIPT_IN_SANDBOX]),
            "cwd": str(box.egress),
            "config": plan.config,
            "log_path": str(box.egress_log),
            "memory_bytes": None if memory_limited else PROXY_MEMORY_BYTES,
        }
        return launch, plan.env

    def _run_as(self, bwrap: str | None) -> tuple[str, int, int] | None:
        """setpriv and the user and group an isolated sandbox runs as under a root worker;
        None when the worker is not root (sandboxes run as the worker's user).

        Raises:
            SandboxCreateError: the worker is root and isolation is off (tenant work never
                runs as root), or setpriv is not installed.

        The uid and gid are the range's first; :meth:`_own_identity` picks a sandbox's own.
        """
        if os.geteuid() != 0:
            return None
        if bwrap is None:
            raise SandboxCreateError(
                "the local provider's isolation is off and the worker runs as root: tenant "
                "work never runs as root; run the worker as an unprivileged user, or install "
                "bubblewrap and set isolation to auto"
            )
        setpriv = find_setpriv()
        if setpriv is None:
            raise SandboxCreateError(
                "the worker runs as root, and running its sandboxes as an unprivileged user "
                "needs setpriv, which is not installed: apt-get install util-linux"
            )
        return setpriv, self.config.sandbox_uid, self.config.sandbox_gid

    def _own_identity(self, run_as: tuple[str, int, int] | None) -> tuple[str, int, int] | None:
        """A uid and gid of the configured range for a new sandbox, the lowest no live
        sandbox here holds: per-uid kernel quotas (RLIMIT_NPROC, inotify instances,
        keyrings, pipe buffers) are then the sandbox's own. Called under the host lock.

        Raises:
            CapacityExhaustedError: every uid of the range is held by a live sandbox.
        """
        if run_as is None:
            return None
        setpriv, first_uid, first_gid = run_as
        held = {
            record["run_as"][1]
            for directory, record in self._records()
            if _holds(directory, record)
        }
        for offset in range(self.config.sandbox_uid_count):
            if first_uid + offset not in held:
                return setpriv, first_uid + offset, first_gid + offset
        raise CapacityExhaustedError(
            f"local provider: every uid of its range ({first_uid} to "
            f"{first_uid + self.config.sandbox_uid_count - 1}) is held by a live sandbox"
        )

    def _isolation_plan(
        self,
        spec: SandboxSpec,
        box: _SandboxDir,
        bwrap: str,
        run_as: tuple[str, int, int] | None = None,
        *,
        proxied: bool = False,
    ) -> IsolationPlan:
        socket = None
        if spec.control_url.startswith("unix://"):
            socket = Path(spec.control_url.removeprefix("unix://"))
        return IsolationPlan(
            bwrap=bwrap,
            workdir=box.work,
            hostname=f"corral-{spec.sandbox_id[:40]}",
            read_only_binds=self.config.read_only_binds,
            runner_package=self.runner_package,
            control_socket=socket,
            egress_proxy_dir=box.egress if proxied else None,
            run_as=run_as,
            **self._tmp(box, bwrap),
        )

    def _tmp(self, box: _SandboxDir, bwrap: str) -> dict[str, Any]:
        """Where a sandbox's /tmp is: on its disk image where it has one, else a tmpfs of
        ``disk_mb`` where bubblewrap can size it (memory, charged to the sandbox's group)."""
        if self._bounded_disk(bwrap):
            return {"tmp_source": SandboxDisk(box.path).tmp}
        if self.config.disk_mb and bwrap_takes_size(bwrap):
            return {"tmp_bytes": self.config.disk_mb * 1024 * 1024}
        return {}

    def _await_start(
        self,
        spec: SandboxSpec,
        box: _SandboxDir,
        supervisor: tuple[int, int | None],
        *,
        isolated: bool,
    ) -> None:
        """Return once the entrypoint runs; fail, and clean up, if it never does."""
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            started = box.read("started.json")
            if started is not None:
                if started["setup_ok"] or not isolated:
                    return
                break  # bubblewrap exited before it made the sandbox
            if not process_alive(*supervisor):
                break
            time.sleep(0.002)
        output = (box.tail_output() or "").strip()
        handle = self._handle(spec, spec.sandbox_id)
        self.terminate(handle)
        raise SandboxVerificationError(
            f"local sandbox {spec.sandbox_id} did not start: {output or 'no output'}"
        )

    def _adopt(self, spec: SandboxSpec, box: _SandboxDir) -> SandboxHandle:
        """A second provision for the same sandbox id returns the existing sandbox (which
        the first may still be starting, outside the host lock: status() then tells)."""
        record = box.read("sandbox.json")
        if record is None or record.get("org_id") != spec.org_id:
            raise SandboxCreateError(
                f"sandbox directory {spec.sandbox_id} exists but does not belong to this spec"
            )
        return self._handle(spec, spec.sandbox_id)

    def _records(self) -> Iterator[tuple[Path, dict[str, Any]]]:
        """Each sandbox directory on this host with its record; terminated ones are gone."""
        if not self.root.exists():
            return
        for entry in sorted(self.root.glob("*/sandbox.json")):
            record = _read_json(entry)
            if record is not None:
                yield entry.parent, record

    def _existing(self, handle: SandboxHandle) -> _SandboxDir:
        box = _SandboxDir(self.root, handle.external_id)
        if not box.work.is_dir():
            raise SandboxNotRunningError(f"sandbox {handle.external_id} no longer exists")
        return box

    def _kill_group(self, record: dict[str, Any]) -> None:
        pid, start = record["supervisor_pid"], record["supervisor_start"]
        if pid is None or not owns_group(pid, start):
            return
        # The supervisor stops the group itself: TERM, the grace period, then KILL. Wait
        # for it; KILL the group ourselves only if it does not finish in time.
        signal_group(pid, signal.SIGTERM)
        if not _await_exit(record, self.config.grace_period_s + 2.0):
            signal_group(pid, signal.SIGKILL)
            _await_exit(record, EXIT_WAIT_S)


class _SandboxDir:
    """One sandbox's directory and the JSON files in it."""

    def __init__(self, root: Path, sandbox_id: str) -> None:
        if not sandbox_id or sandbox_id.startswith(".") or "/" in sandbox_id:
            raise SandboxPathError(f"invalid sandbox id {sandbox_id!r}")
        self.path = root / sandbox_id
        self.work = self.path / "work"
        self.egress = self.path / "egress"  # the egress proxy's socket, if it has one
        self.egress_log = self.path / "egress.log"  # what the proxy refused and let through

    def read(self, name: str) -> dict[str, Any] | None:
        return _read_json(self.path / name)

    def write(self, name: str, payload: dict[str, Any]) -> None:
        tmp = self.path / f".{name}.tmp"
        tmp.write_text(json.dumps(payload), encoding="utf-8")
        tmp.replace(self.path / name)

    def tail_output(self, *, max_lines: int = 40, max_bytes: int = 2000) -> str | None:
        """The end of the sandbox's output (its log, written by its supervisor, in this
        directory of the provider's, which the sandbox does not see); None without one."""
        return file_tail(self.path / "output.log", max_lines=max_lines, max_bytes=max_bytes)

    def confine(self, path: str) -> Path:
        """``path`` inside the work directory, or SandboxPathError.

        Relative paths are taken from the work directory; absolute ones must lie inside it.
        Symbolic links are followed before the check, so a link cannot lead outside.
        """
        work = self.work.resolve()
        candidate = (work / path).resolve()
        if candidate != work and not candidate.is_relative_to(work):
            raise SandboxPathError(
                f"path {path!r} is outside the sandbox work directory; use a path relative to it"
            )
        return candidate


def _host_program(name: str) -> str:
    """The path of a host program the provider runs, found in ``BASE_PATH`` only: never
    through a PATH a caller gave (an exec's env), which could name the sandbox's own work
    directory, seen at the same path on the host.

    Raises:
        InvalidProviderConfigError: it is not installed there.
    """
    found = shutil.which(name, path=BASE_PATH)
    if found is None:
        raise InvalidProviderConfigError(f"{name} is not installed (in {BASE_PATH})")
    return found


def _entering(ns_pid: int, record: dict[str, Any], directory: Path, argv: list[str]) -> list[str]:
    """``argv`` run in the sandbox's own namespaces (same processes, network and files), as
    its user, in ``directory``. nsenter resolves --wd=PATH before it changes root, so the
    directory is changed inside."""
    return [
        _host_program("nsenter"),
        f"--target={ns_pid}",
        "--mount",
        "--uts",
        "--ipc",
        "--net",
        "--pid",
        "--root",
        "--wd",
        "--",
        *_as_sandbox_user(record),
        "/bin/sh",
        "-c",
        'cd "$0" && exec "$@"',
        str(directory),
        *argv,
    ]


def _within_limits(record: dict[str, Any], argv: list[str]) -> list[str]:
    """``argv`` within the sandbox's limits: its process joins the sandbox's cgroups and
    takes its RLIMIT_AS (JOIN_LIMITS_SCRIPT) before it executes anything of the sandbox's,
    so that a session exec counts against the sandbox, not the api. A shell, not
    preexec_fn: the api is multi-threaded. (A record written before execs joined has
    neither: the command runs as it did then.)"""
    groups: list[str] = record.get("cgroups") or []
    rlimit: int | None = record.get("rlimit_as_bytes")
    if not groups and not rlimit:
        return argv
    limit = str(rlimit // 1024) if rlimit else ""
    return ["/bin/sh", "-c", JOIN_LIMITS_SCRIPT, "corral-limits", limit, *groups, "--", *argv]


def _remove_groups(record: dict[str, Any], wait_s: float = EXIT_WAIT_S) -> None:
    """Remove the sandbox's cgroups once its supervisor is gone: one killed from outside
    never removed them. Its sandbox dies with it (``--die-with-parent``), but not at once:
    a group is removed once its last process has left it, waiting up to ``wait_s`` in all
    (one still in use then is left, as rmdir refuses it)."""
    if process_alive(record["supervisor_pid"], record["supervisor_start"]):
        return  # it removes them itself
    deadline = time.monotonic() + wait_s
    for group in record.get("cgroups") or ():
        while _in_use(Path(group)) and time.monotonic() < deadline:
            time.sleep(0.01)
        with contextlib.suppress(OSError):
            os.rmdir(group)


def _in_use(group: Path) -> bool:
    """Whether a process is still in cgroup ``group`` (v1 or v2: both list them)."""
    try:
        return bool((group / "cgroup.procs").read_text().strip())
    except OSError:
        return False  # gone already, or not a group: rmdir says


def _holds(directory: Path, record: dict[str, Any]) -> bool:
    """Whether a sandbox's record holds its uid: until its result is written (its
    supervisor has ended every process of it by then) or its directory is removed."""
    return bool(record.get("run_as")) and not (directory / "result.json").exists()


def _as_sandbox_user(record: dict[str, Any]) -> list[str]:
    """The argv prefix that runs a command as the sandbox's user (none if it runs as the
    worker's)."""
    run_as = record.get("run_as")
    return as_user(*run_as) if run_as else []


def _applying_work_env(command: Sequence[str], has_env: bool, *, isolated: bool) -> list[str]:
    """``command`` preceded, unless it is corral's runner (which applies the work's
    variables itself) or there are none, by the script that applies them inside the
    sandbox and then executes it."""
    if not has_env or tuple(command[-2:]) == ("-m", "runner"):
        return list(command)
    return [*work_env_prefix(isolated=isolated), *command]


@contextlib.contextmanager
def _work_env_file(
    values: Mapping[str, str] | None, host_env: dict[str, str]
) -> Iterator[tuple[int, ...]]:
    """A memory file holding ``values`` for a command to inherit, named in ``host_env``
    (nothing when there are none); closed afterwards."""
    if not values:
        yield ()
        return
    fd = os.memfd_create("corral-work-env")  # close-on-exec: pass_fds hands it on
    try:
        with os.fdopen(os.dup(fd), "wb") as writer:
            writer.write(json.dumps(dict(values)).encode())
        host_env[WORK_ENV_FD_VARIABLE] = str(fd)
        yield (fd,)
    finally:
        os.close(fd)


def work_env_prefix(*, isolated: bool) -> list[str]:
    """The argv prefix that applies the work's variables (CORRAL_WORK_ENV_FD), in the
    sandbox or, without isolation, from the runner package on the host."""
    package = f"{SANDBOX_LIB_DIR}/runner" if isolated else str(RUNNER_PACKAGE)
    return [base_python(), "-I", "-S", f"{package}/{WORK_ENV_SCRIPT}"]


def _name_in_sandbox(module: Path) -> str:
    """A proxy module's file name under its bubblewrap: the script's names it as corral's
    egress proxy in the process table."""
    return PROXY_SCRIPT_IN_SANDBOX.rsplit("/", 1)[1] if module == PROXY_SCRIPT else module.name


def _await_exit(record: dict[str, Any], limit_s: float) -> bool:
    """Wait until the sandbox's supervisor has ended; whether it did within ``limit_s``."""
    return await_exit(record["supervisor_pid"], record["supervisor_start"], limit_s)


def _check_entrypoint(program: str, search_path: str) -> None:
    """Refuse, before allocating anything, an entrypoint that cannot be executed.

    Raises:
        SandboxCreateError: naming the program and where it was looked for.
    """
    if "/" in program:
        if os.access(program, os.X_OK) and Path(program).is_file():
            return
        raise SandboxCreateError(f"sandbox entrypoint {program!r} is not an executable file")
    if shutil.which(program, path=search_path) is None:
        raise SandboxCreateError(
            f"sandbox entrypoint {program!r} is not on the sandbox PATH ({search_path}); "
            "give an absolute path or install it"
        )


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        loaded: dict[str, Any] = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return None
    return loaded


def _status_from_result(result: dict[str, Any], record: dict[str, Any]) -> SandboxStatus:
    exit_code = result.get("exit_code")
    if result["reason"] == "deadline":
        timeout = round(record["deadline_at"] - record["started_at"])
        return SandboxStatus(
            state=SandboxState.FAILED,
            reason=f"deadline of {timeout}s exceeded; the sandbox was killed",
            exit_code=exit_code,
        )
    if result.get("out_of_memory"):
        return SandboxStatus(
            state=SandboxState.FAILED,
            reason=f"out_of_memory: the kernel killed a process of the sandbox at its memory "
            f"limit (exit code {exit_code})",
            exit_code=exit_code,
        )
    if exit_code == 0:
        return SandboxStatus(state=SandboxState.TERMINATED, reason="exited", exit_code=0)
    if exit_code is not None and exit_code < 0:
        reason = f"killed by signal {signal.Signals(-exit_code).name}"
    else:
        reason = f"exited with code {exit_code}"
    return SandboxStatus(state=SandboxState.FAILED, reason=reason, exit_code=exit_code)
