"""A `corral dev` process of a test's own, and the `corral` commands run beside it."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

from corral.providers.local.disk import unmount_below
from tests.acceptance.stack import REPO
from tests.processes import Proc, all_procs, cmdline, cwd

START_TIMEOUT_S = 60
T = TypeVar("T")


def until(condition: Callable[[], T], what: str, timeout_s: float = 30) -> T:
    """``condition()``'s first true value, asked every 50 ms for up to ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not (result := condition()):
        if time.monotonic() > deadline:
            raise TimeoutError(what)
        time.sleep(0.05)
    return result


def dev_env(state_dir: Path, **extra: str) -> dict[str, str]:
    """The environment of a `corral dev` (and its commands) on ``state_dir`` alone: none of
    the test run's CORRAL_* settings."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("CORRAL_")}
    return {**env, "PYTHONPATH": str(REPO), "CORRAL_STATE_DIR": str(state_dir), **extra}


class DevProcess:
    """`corral dev` on a state directory; :meth:`corral` runs a command beside it."""

    def __init__(self, state_dir: Path, **extra_env: str) -> None:
        self.state_dir = state_dir
        self.env = dev_env(state_dir, **extra_env)
        self.output = state_dir.parent / f"{state_dir.name}-dev.log"
        self.process: subprocess.Popen[bytes] | None = None

    def start(self) -> DevProcess:
        with self.output.open("wb") as log:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "corral", "dev"],
                env=self.env,
                cwd=REPO,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # a Ctrl-C of the test run is not its
            )
        until(self._ready, f"corral dev did not start:\n{self.log()}", START_TIMEOUT_S)
        return self

    def _ready(self) -> bool:
        assert self.process is not None
        if self.process.poll() is not None:
            raise RuntimeError(f"corral dev ended at its start:\n{self.log()}")
        return (self.state_dir / "api-url").exists() and self.answers()

    @property
    def pid(self) -> int:
        assert self.process is not None
        return self.process.pid

    @property
    def api_url(self) -> str:
        return (self.state_dir / "api-url").read_text().strip()

    @property
    def admin_token(self) -> str:
        return (self.state_dir / "admin-token").read_text().strip()

    def log(self) -> str:
        return self.output.read_text(errors="replace") if self.output.exists() else ""

    def answers(self) -> bool:
        try:
            status, _ = self.request("GET", "/v1/admin/pools")
        except (OSError, urllib.error.URLError):
            return False
        return status == 200

    def request(
        self, method: str, path: str, body: Any = None, *, token: str | None = None
    ) -> tuple[int, Any]:
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(self.api_url + path, data=data, method=method)
        request.add_header("Authorization", f"Bearer {token or self.admin_token}")
        request.add_header("Content-Type", "application/json")
        try:
            with urllib.request.urlopen(request, timeout=10) as answer:
                return answer.status, json.loads(answer.read() or b"null")
        except urllib.error.HTTPError as error:
            return error.code, json.loads(error.read() or b"null")

    def corral(
        self,
        *args: str,
        env: dict[str, str] | None = None,
        stdin: str | None = None,
        timeout: float = 120,
    ) -> subprocess.CompletedProcess[str]:
        """``corral ARGS`` beside this dev (its environment, or ``env``), ``stdin`` on its
        standard input."""
        return subprocess.run(
            [sys.executable, "-m", "corral", *args],
            input=stdin,
            env=env or self.env,
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )

    def setup_pool(self, org: str = "acme") -> None:
        """A profile ``default`` and a ``local`` pool of ``org``, through the admin api."""
        profile = {"name": "default", "model": "m", "auth_mode": "byok"}
        status, body = self.request("POST", "/v1/admin/profiles", profile)
        assert status == 201, body
        pool = {"org_id": org, "name": "local", "provider_id": "local", "max_concurrent": 4}
        status, body = self.request("POST", "/v1/admin/pools", pool)
        assert status == 201, body

    def stop(self, number: signal.Signals = signal.SIGTERM, timeout_s: float = 60) -> int:
        """Send ``number`` and wait for the process to end; its exit status."""
        assert self.process is not None
        if self.process.poll() is None:
            self.process.send_signal(number)
        return self.process.wait(timeout=timeout_s)

    def kill(self) -> None:
        """End it and everything in its session, now, and whatever runs in its state
        directory (the sandboxes of a test that failed before they were ended)."""
        if self.process is not None and self.process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(timeout=30)
        for proc in in_state_dir(self.state_dir):
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.pid, signal.SIGKILL)


def in_state_dir(state_dir: Path) -> list[Proc]:
    """The processes working in ``state_dir`` or naming it on their command line: a local
    sandbox's supervisor works in its sandbox's directory, bubblewrap names it."""
    where = str(state_dir)
    return [
        proc
        for proc in all_procs()
        if proc.pid != os.getpid()
        and (cwd(proc.pid).startswith(where) or where in cmdline(proc.pid))
    ]


@contextlib.contextmanager
def short_state_dir() -> Iterator[Path]:
    """A state directory with a short path: the api's Unix socket path must stay under 108
    bytes."""
    parent = Path(tempfile.mkdtemp(prefix="corral-dev-", dir="/tmp"))
    try:
        yield parent / "state"
    finally:
        unmount_below(parent)  # the disks of sandboxes nobody terminated
        shutil.rmtree(parent, ignore_errors=True)


@contextlib.contextmanager
def running_dev(**extra_env: str) -> Iterator[DevProcess]:
    """A started `corral dev` on a fresh state directory, killed at the end if still alive."""
    with short_state_dir() as state_dir:
        dev = DevProcess(state_dir, **extra_env)
        try:
            yield dev.start()
        finally:
            dev.kill()
