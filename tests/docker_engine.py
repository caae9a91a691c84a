"""The Docker Engine and the sandbox image the Docker tests run against.

The engine is the one ``CORRAL_TEST_DOCKER_HOST`` names when it answers, else a private
``dockerd`` this module starts on its own socket, data root and exec root in a directory of
the test run's own (``/tmp/corral-dk-*``), so two runs on one machine never see each other's
containers (a run's reaper would take another's for orphans). The pytest-xdist workers of one
run share its engine (a directory named for the run): their tests keep apart by deployment
label, as two deployments on one engine do, and the image is imported and built once. An
engine whose run died is stopped, and its directory removed, by the next run to start one.
The private engine has no bridge, no iptables rules and no IP forwarding: the tests create
no network on a private range and their traffic stays on loopback. It needs root, as any
rootful dockerd does.

The image is ``corral-sandbox:dev``, built without a registry from ``deploy/images/sandbox/``
(see ``deploy/images/README.md``) and rebuilt only when its recipe, those files and the
``runner/`` sources, changes.

Plain functions and classes: the pytest fixtures that use them live in the conftest files.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

REPO_ROOT = Path(__file__).resolve().parents[1]
RECIPE_DIRECTORY = "deploy/images/sandbox"
ROOTFS_SCRIPT = f"{RECIPE_DIRECTORY}/build-rootfs.sh"
RUNNER_PACKAGE = "runner"

ENGINE_HOST_VARIABLE = "CORRAL_TEST_DOCKER_HOST"
# Short: the Unix socket paths under a run's directory must fit in sun_path.
RUNS_DIR = Path("/tmp")
RUN_PREFIX = "corral-dk-"
ABANDONED_AFTER_S = 600.0  # a run directory with no engine, older than this, is a leftover
# Shared by every run: root filesystem tarballs, by recipe hash, made once per machine.
DEFAULT_IMAGE_CACHE = RUNS_DIR / "corral-docker-image-cache"
SANDBOX_TAG = "corral-sandbox:dev"
BASE_REPOSITORY = "corral-sandbox-base"
RECIPE_HASH_LABEL = "corral.recipe-hash"

# sun_path holds 108 bytes with its NUL; containerd adds ".ttrpc" to its socket's path.
MAX_SOCKET_PATH_BYTES = 100
START_TIMEOUT_S = 30.0
STOP_TIMEOUT_S = 30.0
ROOTFS_TIMEOUT_S = 900.0
PING_TIMEOUT_S = 5
LOG_TAIL_LINES = 30
SYSTEM_PATH = ("/usr/local/sbin", "/usr/local/bin", "/usr/sbin", "/usr/bin", "/sbin", "/bin")
# gVisor, registered with a private engine when runsc is installed (apt-get install runsc).
# ptrace: the platform that needs no KVM; host-uds=open: a sandbox may connect to the api's
# Unix socket mounted into it (docs/providers/docker.md, "gVisor (runsc)"); network=none:
# Debian 12's runsc cannot start its own network stack on kernels that show
# net.core.rmem_default in every network namespace (gvisor#10704), and the tests' sandboxes
# need no network.
RUNSC_RUNTIME = "runsc"
RUNSC_ARGS = ("--platform=ptrace", "--host-uds=open", "--network=none")

# Backgrounds dockerd and prints its pid. The shell exits at once, so dockerd belongs to no
# test process: it outlives the run that started it if that run dies, and a later run, which
# finds it through its pidfile, stops it (see DockerEngine.stop).
_LAUNCHER = 'log=$1; shift; "$@" </dev/null >"$log" 2>&1 & echo $!'


class DockerHarnessError(RuntimeError):
    """The Docker test harness could not provide an engine or the sandbox image."""


@dataclass(frozen=True)
class EngineDirectory:
    """Where a private engine keeps its socket, state, pidfile, log and locks."""

    base: Path

    @property
    def socket(self) -> Path:
        return self.base / "docker.sock"

    @property
    def url(self) -> str:
        return f"unix://{self.socket}"

    @property
    def data_root(self) -> Path:
        return self.base / "data"

    @property
    def exec_root(self) -> Path:
        return self.base / "exec"

    @property
    def pidfile(self) -> Path:
        return self.base / "docker.pid"

    @property
    def log(self) -> Path:
        return self.base / "dockerd.log"

    @property
    def config_file(self) -> Path:
        return self.base / "daemon.json"

    @property
    def start_lock(self) -> Path:
        """Held exclusively while an engine is started, adopted or stopped."""
        return self.base / "start.lock"

    @property
    def users_lock(self) -> Path:
        """Held shared by every DockerEngine using this engine, until its stop()."""
        return self.base / "users.lock"

    def check_socket_paths(self) -> None:
        """Raises: DockerHarnessError: a socket path would be too long for sun_path."""
        containerd = self.exec_root / "containerd" / "containerd.sock.ttrpc"
        for path in (self.socket, containerd):
            if len(os.fsencode(path)) >= MAX_SOCKET_PATH_BYTES:
                raise DockerHarnessError(
                    f"socket path {path} is {len(os.fsencode(path))} bytes; a Unix socket "
                    f"path must stay under {MAX_SOCKET_PATH_BYTES}: choose a shorter base_dir"
                )


class DockerEngine:
    """A Docker Engine the tests talk to, at ``url``.

    Call ``stop()`` when done, whether or not ``started_here``: it stops a private engine
    once no other harness user holds it, and leaves an engine ``CORRAL_TEST_DOCKER_HOST``
    named alone.

    Attributes:
        socket: the engine's Unix socket.
        started_here: this call started the engine's dockerd; False when it reused an
            engine already running (another test run's, or the one the variable named).
        pid: the private engine's dockerd; None for an engine the variable named.
    """

    def __init__(
        self,
        *,
        socket: Path,
        started_here: bool,
        pid: int | None = None,
        directory: EngineDirectory | None = None,
        users_lock_fd: int | None = None,
        own_directory: bool = False,
    ) -> None:
        self.socket = socket
        self.started_here = started_here
        self.pid = pid
        self._directory = directory
        self._users_lock_fd = users_lock_fd
        self._own_directory = own_directory  # a run's own: removed once its engine stops

    @property
    def url(self) -> str:
        return f"unix://{self.socket}"

    def __repr__(self) -> str:
        return f"DockerEngine(url={self.url!r}, started_here={self.started_here}, pid={self.pid})"

    def stop(self) -> None:
        """Stop the private engine unless another harness user still holds it; idempotent.

        A private engine is shared by the test runs using the same base_dir at the same
        time. It is stopped by the last of them, even if an earlier run started it: that is
        how an engine left by a run that died gets stopped. SIGTERM to its pid only, then
        SIGKILL after STOP_TIMEOUT_S.
        """
        directory, users_fd = self._directory, self._users_lock_fd
        if directory is None or users_fd is None:
            return
        self._users_lock_fd = None
        with _exclusive(directory.start_lock):
            try:
                fcntl.flock(users_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                logger.info("docker engine at %s is still in use; leaving it running", self.url)
                return
            finally:
                # Closing drops the lock: the start lock keeps newcomers out until we return.
                os.close(users_fd)
            if self.pid is not None:
                _terminate(self.pid, directory)
            if self._own_directory:
                _remove(directory.base)


def ensure_engine(
    *, base_dir: Path | None = None, install: bool = False, run_id: str | None = None
) -> DockerEngine:
    """An answering Docker Engine: the one CORRAL_TEST_DOCKER_HOST names, else a private one.

    A private engine already running under ``base_dir`` (another run's) is reused, else one
    is started. Without ``base_dir`` the engine is the run's own, in a new directory; with
    ``run_id`` (pytest-xdist's id of the run, which its workers share) in the directory named
    for it, which every worker of the run uses, and the last of them to stop the engine
    removes. ``install`` allows ``apt-get install docker.io`` when dockerd is missing.

    Raises:
        DockerHarnessError: CORRAL_TEST_DOCKER_HOST is not a unix:// URL; dockerd is missing
            or cannot run here (not root); or it did not answer within START_TIMEOUT_S (the
            message holds its log's tail).
    """
    external = _external_engine()
    if external is not None:
        return external
    own = base_dir is None
    if own:
        stop_abandoned_engines()
        if run_id is None:
            base_dir = Path(tempfile.mkdtemp(prefix=RUN_PREFIX, dir=RUNS_DIR))
        else:
            base_dir = RUNS_DIR / f"{RUN_PREFIX}{run_id}"
    assert base_dir is not None
    directory = EngineDirectory(base_dir)
    directory.check_socket_paths()
    with _exclusive(directory.start_lock):
        users_fd = _lock(directory.users_lock, fcntl.LOCK_SH)
        try:
            pid = _running_pid(directory)
            started_here = pid is None
            if pid is None:
                pid = _start_dockerd(directory, _dockerd_executable(install=install))
            try:
                _wait_until_answering(directory, pid)
            except DockerHarnessError:
                if started_here:
                    _terminate(pid, directory)
                raise
        except BaseException:
            os.close(users_fd)
            raise
    logger.info("docker engine at %s (pid %d, started here: %s)", directory.url, pid, started_here)
    return DockerEngine(
        socket=directory.socket,
        started_here=started_here,
        pid=pid,
        directory=directory,
        users_lock_fd=users_fd,
        own_directory=own,
    )


def stop_abandoned_engines() -> list[Path]:
    """Stop the private engines of runs that ended without stopping theirs (killed, or
    interrupted) and remove their directories; the directories removed.

    A run holds its directory's users lock from before its engine starts until it stops
    it, so an engine whose lock can be taken has no user left. A directory with no engine
    is removed only once it is old: a run that has just made its own has not locked it yet.
    """
    removed = []
    for base in sorted(RUNS_DIR.glob(f"{RUN_PREFIX}*")):
        directory = EngineDirectory(base)
        try:
            users_fd = _lock(directory.users_lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            continue  # in use (BlockingIOError), or gone meanwhile
        try:
            pid = _running_pid(directory)
            if pid is None and time.time() - base.stat().st_mtime < ABANDONED_AFTER_S:
                continue
            if pid is not None:
                _terminate(pid, directory)
        except OSError:
            continue
        finally:
            os.close(users_fd)
        _remove(base)
        removed.append(base)
    return removed


def _remove(base: Path) -> None:
    """Remove an engine's directory, with what dockerd left mounted in it (the default
    network namespace's bind mount stays after it stops)."""
    prefix = os.fsencode(f"{base}/")
    mounts = Path("/proc/self/mounts").read_bytes().splitlines()
    points = [line.split()[1] for line in mounts if len(line.split()) > 1]
    for point in sorted((p for p in points if p.startswith(prefix)), reverse=True):
        subprocess.run(["umount", "-l", os.fsdecode(point)], check=False, capture_output=True)
    shutil.rmtree(base, ignore_errors=True)


def _external_engine() -> DockerEngine | None:
    url = os.environ.get(ENGINE_HOST_VARIABLE, "").strip()
    if not url:
        return None
    if not url.startswith("unix://"):
        raise DockerHarnessError(
            f"{ENGINE_HOST_VARIABLE}={url!r}: expected unix:///path/to/docker.sock; the tests "
            "use only a local engine"
        )
    if _answers(url):
        return DockerEngine(socket=Path(url.removeprefix("unix://")), started_here=False)
    logger.warning("%s=%s does not answer; starting a private engine", ENGINE_HOST_VARIABLE, url)
    return None


def _answers(url: str) -> bool:
    import docker

    # docker-py leaks its socket when connecting fails (a ResourceWarning, an error under
    # pytest's filterwarnings); a socket that accepts no connection is tried without it.
    if not _accepts_connections(Path(url.removeprefix("unix://"))):
        return False
    try:
        client = docker.DockerClient(base_url=url, timeout=PING_TIMEOUT_S)
    except Exception:  # no socket, refused, or not an engine: all mean "not answering"
        return False
    try:
        return bool(client.ping())
    except Exception:
        return False
    finally:
        client.close()


def _accepts_connections(path: Path) -> bool:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        probe.settimeout(PING_TIMEOUT_S)
        try:
            probe.connect(str(path))
        except OSError:
            return False
    return True


def _dockerd_executable(*, install: bool) -> str:
    if os.geteuid() != 0:
        raise DockerHarnessError(
            f"a private dockerd needs root; run as root or set {ENGINE_HOST_VARIABLE}"
        )
    found = shutil.which("dockerd", path=_search_path())
    if found is None and install:
        _install_docker()
        found = shutil.which("dockerd", path=_search_path())
    if found is None:
        raise DockerHarnessError(
            f"dockerd is not installed (apt-get install docker.io), and {ENGINE_HOST_VARIABLE} "
            "names no answering engine"
        )
    return found


def _search_path() -> str:
    """PATH with the system directories: dockerd, containerd and runc live in sbin or bin."""
    entries = os.environ.get("PATH", "").split(os.pathsep)
    return os.pathsep.join([*entries, *(d for d in SYSTEM_PATH if d not in entries)])


def _install_docker() -> None:
    logger.info("installing docker.io with apt-get")
    # docker.io's postinst starts the system dockerd, which makes the docker0 bridge on a
    # private range; policy-rc.d forbids that, as .ci/run does.
    policy = Path("/usr/sbin/policy-rc.d")
    placed = not policy.exists()
    if placed:
        policy.write_text("#!/bin/sh\nexit 101\n")
        policy.chmod(0o755)
    try:
        for argv in (
            ["apt-get", "update", "-qq"],
            ["apt-get", "install", "-y", "-qq", "docker.io"],
        ):
            result = subprocess.run(
                argv,
                capture_output=True,
                text=True,
                check=False,
                env={**os.environ, "DEBIAN_FRONTEND": "noninteractive"},
            )
            if result.returncode != 0:
                raise DockerHarnessError(
                    f"{' '.join(argv)} exited {result.returncode}:\n"
                    f"{_tail(result.stdout + result.stderr)}"
                )
    finally:
        if placed:
            policy.unlink(missing_ok=True)


def daemon_config() -> dict[str, Any]:
    """A private engine's daemon.json: gVisor's runsc as the runtime ``runsc`` when it is
    installed, else nothing (the machine's /etc/docker/daemon.json is not ours to inherit)."""
    runsc = shutil.which("runsc", path=_search_path())
    if runsc is None:
        return {}
    return {"runtimes": {RUNSC_RUNTIME: {"path": runsc, "runtimeArgs": list(RUNSC_ARGS)}}}


def _start_dockerd(directory: EngineDirectory, dockerd: str) -> int:
    directory.config_file.write_text(json.dumps(daemon_config(), indent=2) + "\n")
    args = [
        f"--host={directory.url}",
        f"--data-root={directory.data_root}",
        f"--exec-root={directory.exec_root}",
        f"--pidfile={directory.pidfile}",
        f"--config-file={directory.config_file}",
        "--bridge=none",
        "--iptables=false",
        "--ip6tables=false",
        "--ip-forward=false",
        # dockerd uses a system containerd when one runs: keep to namespaces of our own.
        "--containerd-namespace=corral-test",
        "--containerd-plugins-namespace=corral-test-plugins",
    ]
    launched = subprocess.run(
        ["sh", "-c", _LAUNCHER, "sh", str(directory.log), dockerd, *args],
        capture_output=True,
        text=True,
        check=True,
        start_new_session=True,
        env={**os.environ, "PATH": _search_path()},
    )
    pid = int(launched.stdout.strip())
    logger.info("started dockerd (pid %d) on %s, log %s", pid, directory.url, directory.log)
    return pid


def _wait_until_answering(directory: EngineDirectory, pid: int) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while not _answers(directory.url):
        if not _is_alive(pid):
            raise DockerHarnessError(
                f"dockerd (pid {pid}) exited while starting; {directory.log} ends:\n"
                f"{_file_tail(directory.log)}"
            )
        if time.monotonic() > deadline:
            raise DockerHarnessError(
                f"dockerd (pid {pid}) did not answer on {directory.socket} within "
                f"{START_TIMEOUT_S:.0f} s; {directory.log} ends:\n{_file_tail(directory.log)}"
            )
        time.sleep(0.2)


def _running_pid(directory: EngineDirectory) -> int | None:
    """The pid of the dockerd serving this directory, if its pidfile names a live one."""
    try:
        pid = int(directory.pidfile.read_text().strip())
    except (OSError, ValueError):
        return None
    return pid if _is_alive(pid) and _serves(pid, directory) else None


def _serves(pid: int, directory: EngineDirectory) -> bool:
    """Whether ``pid`` is a dockerd listening on this directory's socket (not a reused pid)."""
    try:
        arguments = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    return os.fsencode(f"--host={directory.url}") in arguments


def _is_alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    # The state follows the parenthesised command name; a zombie has exited.
    return stat.rpartition(")")[2].split()[0] != "Z"


def _terminate(pid: int, directory: EngineDirectory) -> None:
    if not (_is_alive(pid) and _serves(pid, directory)):
        return
    logger.info("stopping dockerd (pid %d) on %s", pid, directory.url)
    for sig, wait_s in ((signal.SIGTERM, STOP_TIMEOUT_S), (signal.SIGKILL, 5.0)):
        with suppress(ProcessLookupError):
            os.kill(pid, sig)
        deadline = time.monotonic() + wait_s
        while _is_alive(pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        if not _is_alive(pid):
            return
        logger.warning("dockerd (pid %d) is still running after %s", pid, sig.name)


def _lock(path: Path, operation: int) -> int:
    # A raw descriptor: no file object to warn about when a test run ends without stop().
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, operation)
    except BaseException:
        os.close(fd)
        raise
    return fd


@contextmanager
def _exclusive(path: Path) -> Iterator[None]:
    while True:
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        fd = _lock(path, fcntl.LOCK_EX)
        # The last user of a shared engine removes its directory, lock file and all, while
        # holding the lock: a process that waited for it holds a lock nobody else can see.
        if _is_file(fd, path):
            break
        os.close(fd)
    try:
        yield
    finally:
        os.close(fd)


def _is_file(fd: int, path: Path) -> bool:
    """Whether ``path`` is still the file open as ``fd``."""
    try:
        found = path.stat()
    except FileNotFoundError:
        return False
    opened = os.fstat(fd)
    return (found.st_dev, found.st_ino) == (opened.st_dev, opened.st_ino)


def recipe_hash(*paths: str) -> str:
    """The hash build.sh computes: sha256 over ``<sha256>  <path>`` lines (sha256sum's
    format), one per file under ``paths`` (relative to the repository; sorted; __pycache__
    and .pyc left out), as 16 hex digits.
    """
    files: list[str] = []
    for path in paths:
        top = REPO_ROOT / path
        for file in [top] if top.is_file() else top.rglob("*"):
            relative = file.relative_to(REPO_ROOT)
            if file.is_file() and "__pycache__" not in relative.parts and file.suffix != ".pyc":
                files.append(relative.as_posix())
    manifest = "".join(
        f"{hashlib.sha256((REPO_ROOT / file).read_bytes()).hexdigest()}  {file}\n"
        for file in sorted(files)
    )
    return hashlib.sha256(manifest.encode()).hexdigest()[:16]


def ensure_sandbox_image(
    client: Any, *, tag: str = SANDBOX_TAG, cache_dir: Path | None = None
) -> str:
    """The sandbox image's tag, built on ``client``'s engine unless already current there.

    Current means: ``tag`` carries the label corral.recipe-hash with the hash of the recipe
    files and the runner sources. Otherwise the base image corral-sandbox-base:<base hash>
    is imported (from a root filesystem tarball cached in ``cache_dir``, made by
    build-rootfs.sh once per machine and recipe) unless present, and the Dockerfile is
    built on it. A lock in ``cache_dir`` makes concurrent callers build once.

    Raises:
        DockerHarnessError: build-rootfs.sh, the import or the build failed; the message
            holds the end of their output.
    """
    recipe = recipe_hash(RECIPE_DIRECTORY, RUNNER_PACKAGE)
    if _recipe_label(client, tag) == recipe:
        return tag
    cache = cache_dir or DEFAULT_IMAGE_CACHE
    cache.mkdir(parents=True, exist_ok=True)
    with _exclusive(cache / "build.lock"):
        if _recipe_label(client, tag) == recipe:  # built by another caller meanwhile
            return tag
        started = time.monotonic()
        base = _ensure_base_image(client, cache)
        _build_image(client, base=base, tag=tag, recipe=recipe)
        logger.info("built %s (recipe %s) in %.1f s", tag, recipe, time.monotonic() - started)
    return tag


def _recipe_label(client: Any, tag: str) -> str | None:
    import docker.errors

    try:
        image = client.images.get(tag)
    except docker.errors.ImageNotFound:
        return None
    label = image.labels.get(RECIPE_HASH_LABEL)
    return label if isinstance(label, str) else None


def _image_exists(client: Any, name: str) -> bool:
    import docker.errors

    try:
        client.images.get(name)
    except docker.errors.ImageNotFound:
        return False
    return True


def _ensure_base_image(client: Any, cache: Path) -> str:
    import docker.errors

    base_hash = recipe_hash(ROOTFS_SCRIPT)
    base = f"{BASE_REPOSITORY}:{base_hash}"
    if _image_exists(client, base):
        return base
    tarball = _rootfs_tarball(cache, base_hash)
    try:
        result = client.api.import_image_from_file(
            str(tarball), repository=BASE_REPOSITORY, tag=base_hash
        )
    except docker.errors.APIError as error:
        raise DockerHarnessError(f"docker import of {tarball} as {base} failed: {error}") from error
    # The engine reports a bad archive in the response body, not always as an HTTP error.
    if not _image_exists(client, base):
        raise DockerHarnessError(f"docker import of {tarball} made no {base}:\n{_tail(result)}")
    logger.info("imported %s from %s", base, tarball)
    return base


def _rootfs_tarball(cache: Path, base_hash: str) -> Path:
    tarball = cache / f"rootfs-{base_hash}.tar"
    if tarball.exists():
        return tarball
    log = cache / f"rootfs-{base_hash}.log"
    logger.info("making the sandbox root filesystem with debootstrap; log %s", log)
    with log.open("wb") as output:
        # Its own process group, so that an interrupted run stops debootstrap as well.
        process = subprocess.Popen(
            ["bash", str(REPO_ROOT / ROOTFS_SCRIPT), str(tarball)],
            stdin=subprocess.DEVNULL,
            stdout=output,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            code: int | None = process.wait(timeout=ROOTFS_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            code = None
        finally:
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGTERM)
                process.wait()
    if code != 0 or not tarball.exists():
        outcome = f"exited {code}" if code is not None else f"ran over {ROOTFS_TIMEOUT_S:.0f} s"
        raise DockerHarnessError(f"{ROOTFS_SCRIPT} {outcome}; {log} ends:\n{_file_tail(log)}")
    return tarball


def _build_image(client: Any, *, base: str, tag: str, recipe: str) -> None:
    import docker.errors

    with tempfile.TemporaryDirectory(prefix="corral-sandbox-context-") as directory:
        context = Path(directory)
        shutil.copy2(REPO_ROOT / RECIPE_DIRECTORY / "Dockerfile", context / "Dockerfile")
        shutil.copytree(
            REPO_ROOT / RUNNER_PACKAGE,
            context / RUNNER_PACKAGE,
            ignore=shutil.ignore_patterns("__pycache__", "*.pyc"),
        )
        try:
            client.images.build(
                path=str(context),
                tag=tag,
                buildargs={"BASE_IMAGE": base, "RECIPE_HASH": recipe},
                # Every step works offline, and a private engine has no bridge.
                network_mode="none",
                pull=False,
                rm=True,
                forcerm=True,
            )
        except docker.errors.BuildError as error:
            lines = "".join(str(chunk.get("stream") or chunk) for chunk in error.build_log)
            raise DockerHarnessError(
                f"docker build of {tag} FROM {base} failed: {error.msg}\n{_tail(lines)}"
            ) from error
        except docker.errors.APIError as error:
            raise DockerHarnessError(f"docker build of {tag} failed: {error}") from error


def _tail(text: object) -> str:
    return "\n".join(str(text).rstrip().splitlines()[-LOG_TAIL_LINES:])


def _file_tail(path: Path) -> str:
    try:
        return _tail(path.read_text(errors="replace"))
    except OSError as error:
        return f"(unreadable: {error})"
