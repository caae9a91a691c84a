"""A short tour of the local provider: real sandboxes, their states, outputs and reasons.

``corral providers demo`` runs it (``make run`` runs the whole dispatch demo,
``corral dev --demo``).
"""

from __future__ import annotations

import contextlib
import http.server
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from corral.providers.base import SandboxSpec, SandboxState
from corral.providers.errors import ProviderError
from corral.providers.local.isolation import find_bwrap
from corral.providers.local.provider import LocalProvider

# In the sandbox: each URL through corral's egress proxy (the runner's forwarder, started
# here as the runner would), then a direct connection to the first one's port.
PROBE = (
    "import os, socket, sys, urllib.error, urllib.request\n"
    "from urllib.parse import urlsplit\n"
    "if os.environ.get('CORRAL_EGRESS_PROXY_SOCKET'):\n"
    "    from runner.egress import start_forwarder\n"
    "    start_forwarder(os.environ)\n"
    "for url in sys.argv[1:]:\n"
    "    try:\n"
    "        urllib.request.urlopen(url, timeout=5).close()\n"
    "        print(f'{urlsplit(url).hostname}: reached')\n"
    "    except urllib.error.HTTPError as exc:\n"
    "        print(f'{urlsplit(url).hostname}: refused by the egress proxy ({exc.code})')\n"
    "    except OSError as exc:\n"
    "        print(f'{urlsplit(url).hostname}: no network')\n"
)
# Stands for the world outside in the demo: opened to egress as a deployment would open it.
OUTSIDE = "127.0.0.2"


@dataclass(frozen=True)
class DemoCase:
    name: str
    command: list[str]
    allow_network: bool = True
    timeout_s: int | None = None


@dataclass(frozen=True)
class DemoRow:
    name: str
    state: str
    exit_code: str
    seconds: float
    detail: str


def demo_cases(outside_url: str, control_plane_url: str, isolated: bool) -> list[DemoCase]:
    """The tour: ``outside_url`` stands for the internet, ``control_plane_url`` for the
    host's own services (closed to every sandbox)."""
    cases = [
        DemoCase("shell command", ["sh", "-c", "echo hello from sandbox $(hostname)"]),
        DemoCase("python code", ["python3", "-c", "print(sum(range(10)))"]),
        DemoCase("failing step", ["sh", "-c", "echo installing; exit 3"]),
        DemoCase("deadline", ["sleep", "30"], timeout_s=1),
    ]
    if isolated:
        probe = ["python3", "-c", PROBE, outside_url, control_plane_url]
        cases.append(DemoCase("network allowed", probe, allow_network=True))
        cases.append(DemoCase("network cut", probe, allow_network=False))
    return cases


@contextlib.contextmanager
def _web_server(host: str) -> Iterator[int]:
    """A web server on ``host`` answering 204 to every GET, for as long as the tour runs:
    its port."""
    server = http.server.ThreadingHTTPServer((host, 0), _Empty)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server.server_address[1]
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


class _Empty(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        self.send_response(204)
        self.end_headers()

    def log_message(self, format: str, *args: object) -> None:
        return


def run_case(provider: LocalProvider, case: DemoCase) -> DemoRow:
    started = time.monotonic()
    spec = SandboxSpec.model_validate(
        {
            "work_item_id": f"demo-{uuid.uuid4().hex[:8]}",
            "sandbox_id": uuid.uuid4().hex[:12],
            "org_id": "demo",
            "project_id": "tour",
            "registration_token": "crt_demo-not-a-secret",
            "control_url": "http://127.0.0.1:9",
            "egress": {"allow_network": case.allow_network},
            "resources": {"timeout_s": case.timeout_s},
            "provider_options": {"command": case.command},
        }
    )
    try:
        handle = provider.provision(spec)
    except ProviderError as exc:
        return DemoRow(case.name, "refused", "-", time.monotonic() - started, str(exc))
    try:
        status = provider.status(handle)
        while not status.state.is_final:
            time.sleep(0.02)
            status = provider.status(handle)
        output = " | ".join(line for line in provider.stream_logs(handle) if line)
    finally:
        provider.terminate(handle)
    detail = output if status.state is SandboxState.TERMINATED else f"{status.reason}: {output}"
    exit_code = "-" if status.exit_code is None else str(status.exit_code)
    return DemoRow(case.name, status.state.value, exit_code, time.monotonic() - started, detail)


def run_demo(echo: Callable[[str], None]) -> bool:
    """Run every case and print a table. True when each ended as expected."""
    with (
        tempfile.TemporaryDirectory(prefix="corral-demo-") as root,
        _web_server(OUTSIDE) as outside,
        _web_server("127.0.0.1") as control_plane,
    ):
        isolated = find_bwrap("bwrap") is not None
        provider = LocalProvider(
            {
                "root_dir": Path(root),
                "grace_period_s": 0.5,
                # Without bubblewrap the tour runs what it can, unisolated (never as root).
                "isolation": "auto" if isolated else "off",
            }
        )
        provider.use_egress_openings((f"{OUTSIDE}:{outside}",))
        echo(f"local provider: {provider.health_check().message}")
        cases = demo_cases(
            f"http://{OUTSIDE}:{outside}/", f"http://127.0.0.1:{control_plane}/", isolated
        )
        rows = [run_case(provider, case) for case in cases]
    echo(f"{'SANDBOX':<16} {'STATE':<11} {'EXIT':<5} {'SECONDS':<8} OUTPUT / REASON")
    for row in rows:
        echo(f"{row.name:<16} {row.state:<11} {row.exit_code:<5} {row.seconds:<8.2f} {row.detail}")
    if not isolated:
        echo(
            "bubblewrap is not installed: isolation and the network cases were not shown "
            "(apt-get install bubblewrap)"
        )
    expected = {
        "shell command": "terminated",
        "python code": "terminated",
        "failing step": "failed",
        "deadline": "failed",
        "network allowed": "terminated",
        "network cut": "terminated",
    }
    return all(row.state == expected[row.name] for row in rows)
