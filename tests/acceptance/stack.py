"""Running corral as separate processes, as in production: api, scheduler, a local provider
worker, the maintenance worker and beat, on real Redis and PostgreSQL.

Each process gets its own log file; the stack stops exactly the processes it started (by
process group, recorded at start).
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from corral.providers.local.disk import unmount_below
from corral.shared.settings import is_redis_url
from tests.conftest import require_bwrap_path
from tests.processes import all_procs, cmdline, cwd
from tests.standins.e2b import E2BStandin

# A loopback address that stands for the world outside in the tests (opened to egress).
OUTSIDE_ADDRESS = "127.0.0.2"
REPO = Path(__file__).resolve().parents[2]
CORRAL = [sys.executable, "-m", "corral"]
# How long a started process may take to answer or say it is ready. Its imports alone take
# seconds of CPU, a stack starts five processes at once, and under make test the workers of
# a run start theirs at the same time, on 2 cores: a deadline, not an expected time.
START_TIMEOUT_S = 120.0


# Ports handed to processes that bind them later. Not from the kernel's ephemeral range
# (net.ipv4.ip_local_port_range, 32768-60999 by default): an outgoing connection of any
# process (to PostgreSQL, Redis, ...) takes its local port from that range, and could take
# the port between the probe and the process's bind ("Address already in use").
_PORTS = range(20000, 32768)
_handed_out: set[int] = set()


def worker_ports(environ: Mapping[str, str]) -> range:
    """The ports this test process hands out: the whole range, or under pytest-xdist (which
    names each worker gw0, gw1, ... and says how many there are) every n-th port from the
    worker's number, so that two workers never hand out the same port before it is bound."""
    worker = environ.get("PYTEST_XDIST_WORKER", "")
    count = int(environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if not worker.startswith("gw") or count < 2:
        return _PORTS
    return _PORTS[int(worker.removeprefix("gw")) % count :: count]


def free_port() -> int:
    """A loopback port nothing listens on, outside the ephemeral range, not handed out
    before in this run (its process may not have bound it yet), and of this worker's share."""
    rng = secrets.SystemRandom()
    ports = worker_ports(os.environ)
    for _ in range(1000):
        port = rng.choice(ports)
        if port in _handed_out:
            continue
        with socket.socket() as probe:
            try:
                probe.bind(("127.0.0.1", port))
            except OSError:
                continue
        _handed_out.add(port)
        return port
    raise RuntimeError(
        f"no free port in this process's share of {_PORTS.start}-{_PORTS.stop - 1} on 127.0.0.1"
    )


def delete_broker_keys(broker_url: str, prefix: str) -> None:
    """Remove what a run left in Redis under its own key prefix."""
    import redis

    client = redis.Redis.from_url(broker_url)
    try:
        for key in client.scan_iter(f"{prefix}*"):
            client.delete(key)
    finally:
        client.close()


@dataclass
class Stack:
    database_url: str
    broker_url: str
    worker_concurrency: int = 16
    scheduler_loops: int | None = None  # each scheduler's --concurrency (its default: None)
    local_max_concurrent: int | None = None
    provider_config: dict[str, dict[str, Any]] = field(default_factory=dict)
    extra_env: dict[str, str] = field(default_factory=dict)
    processes: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        # A short directory: the api's Unix socket path must stay under 108 bytes.
        self.state_dir = Path(tempfile.mkdtemp(prefix="corral-", dir="/tmp"))
        self.sandbox_root = self.state_dir / "sandboxes"
        self.port = free_port()
        self.api_metrics_port = free_port()  # the api's metrics listener
        self.metrics_port = free_port()  # the maintenance worker's Prometheus endpoint
        self.worker_metrics_ports: dict[str, int] = {}  # each provider worker's
        self.flower_port = free_port()  # `corral flower`, when started
        self.admin_token = secrets.token_urlsafe(24)
        # On RabbitMQ the run has a vhost of its own (the broker URL's), and no key prefix.
        on_redis = is_redis_url(self.broker_url)
        self.key_prefix = f"corral-test-{uuid.uuid4().hex[:10]}:" if on_redis else ""
        local: dict[str, Any] = {"root_dir": str(self.sandbox_root), "grace_period_s": 1}
        if self.local_max_concurrent:
            local["max_concurrent"] = self.local_max_concurrent
        self.env = {
            **os.environ,
            "PYTHONPATH": str(REPO),
            "CORRAL_STATE_DIR": str(self.state_dir),
            "CORRAL_DATABASE_URL": self.database_url,
            "CORRAL_BROKER_URL": self.broker_url,
            "CORRAL_BROKER_KEY_PREFIX": self.key_prefix,
            "CORRAL_API_PORT": str(self.port),
            "CORRAL_API_METRICS_PORT": str(self.api_metrics_port),
            "CORRAL_CONTROL_URL": f"http://127.0.0.1:{self.port}",
            "CORRAL_ADMIN_TOKEN": self.admin_token,
            "CORRAL_PROVIDER_CONFIG": json.dumps({"local": local, **self.provider_config}),
            "CORRAL_REDRIVE_INTERVAL_S": "1",
            "CORRAL_REAPER_INTERVAL_S": "1",
            "CORRAL_RECONCILE_INTERVAL_S": "0",
            "CORRAL_HEARTBEAT_INTERVAL_S": "1",
            # The tests' stand-ins for the outside world listen there: the control plane
            # (127.0.0.1) stays closed to sandboxes, as in a deployment.
            "CORRAL_EGRESS_OPEN_NETWORKS": OUTSIDE_ADDRESS,
            **self.extra_env,
        }

    @property
    def api_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log_path(self, name: str) -> Path:
        return self.state_dir / f"{name}.log"

    def start(self) -> Stack:
        return self.start_only(["api", "scheduler", "worker-local", "maintenance", "beat"])

    def start_only(self, names: list[str]) -> Stack:
        """Start the named processes; wait for the api, Flower and the Celery workers among
        them."""
        loops = [] if self.scheduler_loops is None else ["--concurrency", str(self.scheduler_loops)]
        commands = {
            "api": ["api"],
            "scheduler": ["scheduler", *loops],
            "maintenance": ["worker", "--maintenance", "--metrics-port", str(self.metrics_port)],
            "beat": ["beat"],
            "flower": ["flower", "--port", str(self.flower_port)],
        }
        for name in names:
            if name.startswith("scheduler-"):  # another scheduler, a node of its own
                commands[name] = ["scheduler", "--name", name, *loops]
            if name.startswith("worker-"):  # worker-e2b; worker-e2b+2: a second process of it
                port = self.worker_metrics_ports[name] = free_port()
                commands[name] = [
                    "worker",
                    "--provider",
                    name.removeprefix("worker-").partition("+")[0],
                    "--concurrency",
                    str(self.worker_concurrency),
                    "--metrics-port",
                    str(port),
                ]
            with self.log_path(name).open("wb") as log:
                self.processes[name] = subprocess.Popen(
                    [*CORRAL, *commands[name]],
                    env=self.env,
                    cwd=self.state_dir,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
        if "api" in names:
            self.wait_for_api()
        if "flower" in names:
            self.wait_for_flower()
        self.wait_for_workers({n for n in names if n not in ("api", "beat", "flower")})
        return self

    @property
    def flower_url(self) -> str:
        return f"http://127.0.0.1:{self.flower_port}"

    def wait_for_flower(self, timeout_s: float = START_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            self.check_alive()
            try:
                with urllib.request.urlopen(f"{self.flower_url}/healthcheck", timeout=2):
                    return
            except OSError:
                time.sleep(0.1)
        raise TimeoutError(f"flower did not answer: {self.log_path('flower').read_text()}")

    def wait_for_api(self, timeout_s: float = START_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            self.check_alive()
            try:
                with urllib.request.urlopen(f"{self.api_url}/readyz", timeout=2) as answer:
                    if answer.status == 200:
                        return
            except OSError:
                time.sleep(0.1)
        raise TimeoutError(f"the api did not answer: {self.log_path('api').read_text()}")

    def wait_for_workers(self, names: set[str], timeout_s: float = START_TIMEOUT_S) -> None:
        """Wait until each worker logged that it is ready to consume."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            self.check_alive()
            if all(b"ready." in self.log_path(name).read_bytes() for name in names):
                return
            time.sleep(0.1)
        raise TimeoutError(f"workers not ready: {self.logs()}")

    def check_alive(self) -> None:
        for name, process in self.processes.items():
            if process.poll() is not None:
                raise RuntimeError(f"{name} exited with {process.returncode}: {self.logs()}")

    def logs(self) -> str:
        return "\n".join(
            f"--- {name}\n{self.log_path(name).read_text(errors='replace')[-4000:]}"
            for name in self.processes
        )

    def scrape(self, port: int) -> dict[str, float]:
        """What the metrics listener on ``port`` serves: each sample by name and labels."""
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as answer:
            text = answer.read().decode()
        return {
            line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
            for line in text.splitlines()
            if line and not line.startswith("#")
        }

    def sweeps_done(self) -> list[datetime]:
        """When each of the maintenance worker's reaper sweeps ended, from its JSON log."""
        times = []
        for line in self.log_path("maintenance").read_text(errors="replace").splitlines():
            if line.startswith("{") and '"reaper sweep done"' in line:
                times.append(datetime.fromisoformat(json.loads(line)["ts"]))
        return times

    def stop(self) -> None:
        for process in self.processes.values():
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGTERM)
        deadline = time.monotonic() + 20
        for process in self.processes.values():
            try:
                process.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()
        self._end_sandboxes()
        if self.key_prefix:
            delete_broker_keys(self.broker_url, self.key_prefix)
        unmount_below(self.state_dir)  # the disks of sandboxes nobody terminated
        shutil.rmtree(self.state_dir, ignore_errors=True)  # logs, socket, sandbox roots

    def _end_sandboxes(self) -> None:
        """Kill the local sandboxes the stack's processes left running (a test that stopped
        its maintenance worker, or killed the broker under it, leaves some): each one's
        supervisor leads its own process group, and works in its sandbox's directory under
        this stack's sandbox root."""
        root = str(self.sandbox_root)
        for proc in all_procs():
            if "local/supervisor.py" in cmdline(proc.pid) and cwd(proc.pid).startswith(root):
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(proc.pid, signal.SIGKILL)

    # -- the api, as a client ------------------------------------------------------------

    def request(
        self,
        method: str,
        path: str,
        body: Any = None,
        *,
        token: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> tuple[int, Any]:
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(self.api_url + path, data=data, method=method)
        request.add_header("Content-Type", "application/json")
        request.add_header("Authorization", f"Bearer {token or self.admin_token}")
        for key, value in (headers or {}).items():
            request.add_header(key, value)
        try:
            with urllib.request.urlopen(request, timeout=10) as answer:
                return answer.status, json.loads(answer.read() or b"null")
        except urllib.error.HTTPError as error:
            with error:
                return error.code, json.loads(error.read() or b"null")

    def make_org(
        self, org: str, *, max_concurrent: int = 64, provider_id: str = "local", name: str = "local"
    ) -> str:
        """Org ``org`` with one pool (a local one, ``local``, unless said); the profile
        `default` too, unless an earlier test of the session made it (the session's database
        is shared)."""
        profile = {"name": "default", "model": "m", "auth_mode": "byok"}
        status, body = self.request("POST", "/v1/admin/profiles", profile)
        assert status in (201, 409), body
        pool = {
            "org_id": org,
            "name": name,
            "provider_id": provider_id,
            "max_concurrent": max_concurrent,
        }
        status, body = self.request("POST", "/v1/admin/pools", pool)
        assert status == 201, body
        return org

    def until(self, condition: Any, what: str, timeout_s: float = 30) -> Any:
        """``condition()``'s first true value, checked while every process is alive."""
        deadline = time.monotonic() + timeout_s
        while not (result := condition()):
            if time.monotonic() > deadline:
                raise TimeoutError(f"{what}\n{self.logs()}")
            self.check_alive()
            time.sleep(0.1)
        return result

    def wait_final(self, item_ids: list[str], timeout_s: float = 120) -> list[dict[str, Any]]:
        final = {"succeeded", "failed", "cancelled", "dispatch_error"}
        deadline = time.monotonic() + timeout_s
        while True:
            views = [self.request("GET", f"/v1/work-items/{i}")[1] for i in item_ids]
            if all(v["state"] in final for v in views):
                return views
            if time.monotonic() > deadline:
                pending = [v for v in views if v["state"] not in final]
                raise TimeoutError(
                    f"{len(pending)} items not final, e.g. {pending[:2]}\n{self.logs()}"
                )
            self.check_alive()
            time.sleep(0.2)


def e2b_stack(cloud: E2BStandin, database_url: str, broker_url: str, **config: Any) -> Stack:
    """A stack (not started) whose e2b provider reaches the stand-in ``cloud``, with its key
    in ``CORRAL_E2B_API_KEY`` and ``config`` beside the stand-in's addresses."""
    return Stack(
        database_url=database_url,
        broker_url=broker_url,
        worker_concurrency=32,
        provider_config={"e2b": {**cloud.corral_config(), **config}},
        extra_env={"CORRAL_E2B_API_KEY": cloud.api_key},
    )


@contextlib.contextmanager
def running_stack(database_url: str, broker_url: str, **env: str) -> Iterator[Stack]:
    """A started stack of a test's own with these ``CORRAL_*`` settings, stopped afterwards
    (its local provider needs bubblewrap)."""
    require_bwrap_path()
    running = Stack(database_url=database_url, broker_url=broker_url, extra_env=env)
    try:
        yield running.start()
    finally:
        running.stop()
