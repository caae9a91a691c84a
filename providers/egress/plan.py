"""corral's egress proxy as the providers that run it (local, docker) use it: its
configuration from a spec's egress, the environment that points the sandbox at it, and
starting it as a host process.

The proxy itself is :mod:`corral.providers.egress.proxy` (standard library only, with
:mod:`.http1` and :mod:`.tls` beside it). In the sandbox its Unix socket is
``SANDBOX_PROXY_DIR/proxy.sock``; the runner listens on ``127.0.0.1:SANDBOX_PROXY_PORT`` and
forwards there (:mod:`corral.runner.egress`). A sandbox with secret bindings gets a CA of
its own (:mod:`.certificates`): the proxy shows the bound hosts' certificates, and the
sandbox's CA bundle holds the CA (``EGRESS_CA_VARIABLE``, written by the runner).
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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from corral.providers.base import Egress
from corral.providers.egress.certificates import sandbox_certificates
from corral.providers.egress.proxy import ANY_HOST
from corral.providers.egress.rules import HostRule, parse_host_rule, parse_host_rules
from corral.providers.errors import SandboxCreateError
from corral.providers.local.isolation import SANDBOX_PROXY_DIR
from corral.providers.local.processes import process_alive, start_ticks

PROXY_SCRIPT = Path(__file__).with_name("proxy.py")
# The script and the modules it imports from beside it: what a proxy under bubblewrap sees.
PROXY_MODULES = tuple(Path(__file__).with_name(name) for name in ("proxy.py", "http1.py", "tls.py"))
PROXY_SOCKET_NAME = "proxy.sock"
SANDBOX_PROXY_PORT = 3128
READY_TIMEOUT_S = 10.0
# Where the runner finds the proxy, and the port it forwards from (corral.runner.egress).
SOCKET_VARIABLE = "CORRAL_EGRESS_PROXY_SOCKET"
PORT_VARIABLE = "CORRAL_EGRESS_PROXY_PORT"
# The sandbox's own CA, which the runner adds to the sandbox's CA bundle (corral.runner.egress).
EGRESS_CA_VARIABLE = "CORRAL_EGRESS_CA_PEM"
UPSTREAM_CA_SETTING = "CORRAL_EGRESS_UPSTREAM_CA_FILE"


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
                "checkout_requests": [list(pair) for pair in binding.checkout_requests],
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


@dataclass(frozen=True)
class ProxyPlan:
    """One sandbox's proxy: its configuration (for its stdin) and the sandbox's variables
    that point at it (and, with bindings, the sandbox's CA for its bundle)."""

    config: dict[str, Any] = field(repr=False)
    env: dict[str, str]


def plan_proxy(
    egress: Egress,
    *,
    log_path: Path | None,
    exit_after_s: float | None,
    valid_s: float,
    open_networks: tuple[str, ...] = (),
    upstream_ca_file: Path | None = None,
) -> ProxyPlan:
    """The proxy of a sandbox whose life is at most ``valid_s`` seconds.

    A binding's host (a name or one address) gets a certificate of a CA made for this
    sandbox alone: the proxy terminates its TLS, and checks the destination's certificate
    against the system's store and ``upstream_ca_file`` (the deployment's
    CORRAL_EGRESS_UPSTREAM_CA_FILE).

    Raises:
        SandboxCreateError: ``upstream_ca_file`` cannot be read or holds no certificate.
    """
    config = proxy_config(
        egress, log_path=log_path, exit_after_s=exit_after_s, open_networks=open_networks
    )
    env = proxied_env(egress)
    hosts = {rule.host for rule in bound_hosts(egress) if rule.is_name or _one_address(rule)}
    if hosts:
        made = sandbox_certificates(hosts, valid_s=valid_s)
        config["tls"] = {
            "leaves": [{"host": h.host, "cert": h.cert_pem, "key": h.key_pem} for h in made.hosts],
            "upstream_ca_pem": _upstream_ca(upstream_ca_file),
        }
        env[EGRESS_CA_VARIABLE] = made.ca_pem
    return ProxyPlan(config, env)


def bound_hosts(egress: Egress) -> list[HostRule]:
    """The host rule of each secret binding (the git input's credential's included)."""
    return [parse_host_rule(binding.host) for binding in egress.secret_bindings.values()]


def _one_address(rule: HostRule) -> bool:
    return rule.network is not None and rule.network.num_addresses == 1


def _upstream_ca(path: Path | None) -> str | None:
    """The deployment's CA bundle for destinations, as PEM; None without one.

    Raises:
        SandboxCreateError: it cannot be read, or holds no certificate.
    """
    if path is None:
        return None
    try:
        pem = path.read_text(encoding="ascii")
    except (OSError, UnicodeDecodeError) as exc:
        raise SandboxCreateError(
            f"{UPSTREAM_CA_SETTING} cannot be read by the worker ({type(exc).__name__})"
        ) from exc
    if "-----BEGIN CERTIFICATE-----" not in pem:
        raise SandboxCreateError(f"{UPSTREAM_CA_SETTING} holds no PEM certificate")
    return pem


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

    def __init__(
        self,
        root: Path,
        open_networks: tuple[str, ...] = (),
        upstream_ca_file: Path | None = None,
    ) -> None:
        self.root = root
        self.open_networks = open_networks
        self.upstream_ca_file = upstream_ca_file

    def start(
        self, name: str, egress: Egress, *, exit_after_s: float
    ) -> tuple[Path, dict[str, str]]:
        """Start the proxy of sandbox ``name``; the directory of its socket and the
        sandbox's variables for it (:attr:`ProxyPlan.env`).

        Raises:
            SandboxCreateError: it did not start.
        """
        directory = self.root / name
        plan = plan_proxy(
            egress,
            log_path=directory / "egress.log",
            exit_after_s=exit_after_s,
            valid_s=exit_after_s,
            open_networks=self.open_networks,
            upstream_ca_file=self.upstream_ca_file,
        )
        process = start_proxy(plan.config, directory)
        threading.Thread(target=process.wait, name="egress-proxy-wait", daemon=True).start()
        record = {"pid": process.pid, "start": start_ticks(process.pid)}
        (directory / "proxy.json").write_text(json.dumps(record), encoding="utf-8")
        return directory, plan.env

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
