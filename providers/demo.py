"""A short tour of the local provider: real sandboxes, their states, outputs and reasons.

``corral providers demo`` runs it (``make run`` runs the whole dispatch demo,
``corral dev --demo``).
"""

from __future__ import annotations

import socket
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from corral.providers.base import SandboxSpec, SandboxState
from corral.providers.errors import ProviderError
from corral.providers.local import LocalProvider
from corral.providers.local_isolation import find_bwrap

PROBE = (
    "import socket, sys\n"
    "try:\n"
    "    socket.create_connection(('127.0.0.1', int(sys.argv[1])), timeout=2).close()\n"
    "    print('reached the host listener')\n"
    "except OSError as exc:\n"
    "    print(f'no network: {exc.strerror or exc}')\n"
)


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


def demo_cases(listener_port: int, isolated: bool) -> list[DemoCase]:
    cases = [
        DemoCase("shell command", ["sh", "-c", "echo hello from sandbox $(hostname)"]),
        DemoCase("python code", [sys.executable, "-c", "print(sum(range(10)))"]),
        DemoCase("failing step", ["sh", "-c", "echo installing; exit 3"]),
        DemoCase("deadline", ["sleep", "30"], timeout_s=1),
    ]
    if isolated:
        probe = ["python3", "-c", PROBE, str(listener_port)]
        cases.append(DemoCase("network allowed", probe, allow_network=True))
        cases.append(DemoCase("network cut", probe, allow_network=False))
    return cases


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
    with tempfile.TemporaryDirectory(prefix="corral-demo-") as root, socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        isolated = find_bwrap("bwrap") is not None
        provider = LocalProvider({"root_dir": Path(root), "grace_period_s": 0.5})
        echo(f"local provider: {provider.health_check().message}")
        rows = [
            run_case(provider, case) for case in demo_cases(listener.getsockname()[1], isolated)
        ]
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
