"""corral's egress proxy as the providers that run it (local, docker) use it: its
configuration from a spec's egress, the environment that points the sandbox at it, and
starting it as a host process.

The proxy itself is :mod:`corral.providers.egress.proxy` (standard library only). In the
sandbox its Unix socket is ``SANDBOX_PROXY_DIR/proxy.sock``; the runner listens on
``127.0.0.1:SANDBOX_PROXY_PORT`` and forwards there (:mod:`corral.runner.egress`).
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from corral.providers.base import Egress
from corral.providers.egress.proxy import ANY_HOST
from corral.providers.egress.rules import parse_host_rule, parse_host_rules
from corral.providers.errors import SandboxCreateError
from corral.providers.local.isolation import SANDBOX_PROXY_DIR
from corral.providers.local.processes import process_alive, start_ticks

PROXY_SCRIPT = Path(__file__).with_name("proxy.py")
PROXY_SOCKET_NAME = "proxy.sock"
SANDBOX_PROXY_PORT = 3128
READY_TIMEOUT_S = 10.0
# Where the runner finds the proxy, and the port it forwards from (corral.runner.egress).
SOCKET_VARIABLE = "CORRAL_EGRESS_PROXY_SOCKET"
PORT_VARIABLE = "CORRAL_EGRESS_PROXY_PORT"


def proxy_config(
    egress: Egress,
    *,
    log_path: Path | None,
    exit_after_s: float | None,
    open_networks: tuple[str, ...] = (),
) -> dict[str, Any]:
    """What the proxy is started with (on its stdin: it holds the bindings' values).

    Without allowed hosts every destination is allowed (the rule ``*``): the proxy still
    connects only to open addresses. ``open_networks`` are the deployment's
    (``CORRAL_EGRESS_OPEN_NETWORKS``), never a message's."""
    if egress.allowed_hosts:
        rules = [rule.as_json() for rule in parse_host_rules(egress.allowed_hosts)]
    else:
        rules = [{"host": ANY_HOST, "port": None}]
    bindings = []
    for name, binding in egress.secret_bindings.items():
        rule = parse_host_rule(binding.host)
        bindings.append(
            {
                **rule.as_json(),
                "placeholder": binding.placeholder_for(name),
                "value": binding.value.get_secret_value(),
                "header": binding.header,
            }
        )
    return {
        "socket": PROXY_SOCKET_NAME,
        "rules": rules,
        "bindings": bindings,
        "open_networks": [rule.as_json() for rule in parse_host_rules(open_networks)],
        "log_path": None if log_path is None else str(log_path),
        "exit_after_s": exit_after_s,
    }


def proxied_env(egress: Egress) -> dict[str, str]:
    """The sandbox's proxy variables when corral's proxy is its way out: they win over
    the message's (which cannot name a proxy of their own beside allowed_hosts)."""
    # No NO_PROXY of corral's own: the sandbox's loopback holds nothing but the forwarder.
    # (The host's loopback is closed to the proxy unless the deployment opened it.)
    local = f"http://127.0.0.1:{SANDBOX_PROXY_PORT}"
    env = egress.proxy_env(local, local)
    env[SOCKET_VARIABLE] = f"{SANDBOX_PROXY_DIR}/{PROXY_SOCKET_NAME}"
    env[PORT_VARIABLE] = str(SANDBOX_PROXY_PORT)
    return env


def start_proxy(config: dict[str, Any], directory: Path) -> subprocess.Popen[bytes]:
    """Start the proxy as a host process in its own session, listening in ``directory``;
    return once it listens.

    Raises:
        SandboxCreateError: it did not start listening within READY_TIMEOUT_S.
    """
    directory.mkdir(parents=True, exist_ok=True)
    process = subprocess.Popen(
        [sys.executable, "-I", "-S", str(PROXY_SCRIPT)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        cwd=directory,
        env={"PATH": "/usr/bin:/bin"},
        start_new_session=True,
    )
    assert process.stdin is not None and process.stdout is not None
    process.stdin.write(json.dumps(config).encode())
    process.stdin.close()
    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline:
        if select.select([process.stdout], [], [], deadline - time.monotonic())[0]:
            if process.stdout.readline().strip() == b"ready":
                process.stdout.close()
                return process
            break
    process.kill()
    process.wait()
    raise SandboxCreateError("corral's egress proxy for the sandbox did not start")


class HostProxies:
    """Egress proxies run as host processes, one per sandbox, each in a directory of its
    own under ``root`` (its socket, its log ``egress.log`` and ``proxy.json``, which names
    its process): for a provider whose sandboxes have no supervisor on this host (docker).

    Any process of the deployment can stop one (``terminate`` often runs in the maintenance
    worker); the one that started it collects it. One that nobody stops ends by itself at
    its ``exit_after_s``.
    """

    def __init__(self, root: Path, open_networks: tuple[str, ...] = ()) -> None:
        self.root = root
        self.open_networks = open_networks

    def start(self, name: str, egress: Egress, *, exit_after_s: float) -> Path:
        """Start the proxy of sandbox ``name``; the directory of its socket.

        Raises:
            SandboxCreateError: it did not start.
        """
        directory = self.root / name
        log_path = directory / "egress.log"
        config = proxy_config(
            egress,
            log_path=log_path,
            exit_after_s=exit_after_s,
            open_networks=self.open_networks,
        )
        process = start_proxy(config, directory)
        threading.Thread(target=process.wait, name="egress-proxy-wait", daemon=True).start()
        record = {"pid": process.pid, "start": start_ticks(process.pid)}
        (directory / "proxy.json").write_text(json.dumps(record), encoding="utf-8")
        return directory

    def stop(self, name: str) -> None:
        """End the proxy of sandbox ``name`` if it runs, and remove its directory.
        Idempotent."""
        directory = self.root / name
        try:
            record = json.loads((directory / "proxy.json").read_text(encoding="utf-8"))
        except (FileNotFoundError, ValueError):
            record = None
        if record is not None and process_alive(record["pid"], record["start"]):
            with contextlib.suppress(ProcessLookupError):
                os.kill(record["pid"], signal.SIGKILL)
        shutil.rmtree(directory, ignore_errors=True)

    def log(self, name: str) -> str:
        """What the proxy of sandbox ``name`` logged (refusals and connections)."""
        try:
            return (self.root / name / "egress.log").read_text(encoding="utf-8")
        except FileNotFoundError:
            return ""
