"""No local sandbox reaches the control plane: with network or without, with any
allowed_hosts, the host's Redis, PostgreSQL and loopback listeners are out of reach, while
what the deployment opened is reachable; and the egress proxy a sandbox can load holds to
the sandbox's user and its own bounds. Real bubblewrap, the real proxy, loopback only."""

from __future__ import annotations

import os
import socket
from pathlib import Path

import pytest

from corral.providers.egress.proxy import MAX_CONNECTIONS
from corral.providers.local.provider import LocalProvider
from tests.conftest import SpecFactory
from tests.egress_probe import proxies_under, recording_server
from tests.integration.test_local_provider import output_of, wait_until_final
from tests.integration.test_local_reaping import wait_for

# Inside the sandbox: through corral's proxy (the runner's forwarder), CONNECT each target
# and speak a line to it; then try it directly.
NETWORK_PROBE = r"""
import os, socket, sys
from runner.egress import start_forwarder
start_forwarder(os.environ)
port = int(os.environ["CORRAL_EGRESS_PROXY_PORT"])
for target in sys.argv[1:]:
    with socket.create_connection(("127.0.0.1", port), timeout=10) as proxy:
        proxy.sendall(f"CONNECT {target} HTTP/1.1\r\nHost: {target}\r\n\r\n".encode())
        answer = proxy.recv(300).split(b"\r\n")[0].decode()
        if " 200 " in answer:
            proxy.sendall(b"PING\r\n")
            answer += " then " + proxy.recv(100).decode(errors="replace").strip()
    print(f"proxy {target} {answer}", flush=True)
    host, _, number = target.rpartition(":")
    try:
        socket.create_connection((host.strip("[]"), int(number)), timeout=2).close()
        print(f"direct {target} connected", flush=True)
    except OSError:
        print(f"direct {target} refused", flush=True)
"""

REDIS = "127.0.0.1:6379"
POSTGRES = "127.0.0.1:5432"


def _listening(address: str) -> bool:
    host, _, port = address.rpartition(":")
    try:
        socket.create_connection((host, int(port)), timeout=2).close()
    except OSError:
        return False
    return True


@pytest.mark.parametrize(
    "allowed_hosts",
    [
        [],
        ["0.0.0.0/0"],
        ["::/0", "0.0.0.0/0"],
        [REDIS, POSTGRES, "localhost", "127.0.0.0/8"],
    ],
    ids=["any-host", "all-ipv4", "all-addresses", "loopback-named"],
)
def test_the_control_plane_is_out_of_reach_whatever_the_allowed_hosts(
    require_bwrap: str, sandbox_root: Path, make_spec: SpecFactory, allowed_hosts: list[str]
) -> None:
    assert _listening(REDIS) and _listening(POSTGRES), "the host's Redis and PostgreSQL run"
    provider = LocalProvider({"root_dir": sandbox_root, "isolation": "required"})
    with recording_server() as (loopback_port, seen):
        listener = f"127.0.0.1:{loopback_port}"
        targets = [REDIS, POSTGRES, listener, "localhost:6379", "0.0.0.0:6379"]
        targets.append("[::ffff:127.0.0.1]:6379")
        hosts = [*allowed_hosts, listener] if allowed_hosts else []
        spec = make_spec(
            provider_options={"command": ["python3", "-c", NETWORK_PROBE, *targets]},
            egress={"allow_network": True, "allowed_hosts": hosts},
        )
        handle = provider.provision(spec)
        wait_until_final(provider, handle, limit=60)
        output = output_of(provider, handle)
        provider.terminate(handle)

    for target in targets:
        assert f"direct {target} refused" in output, output
        line = next(line for line in output.splitlines() if line.startswith(f"proxy {target} "))
        assert " 200 " not in line, line
    assert "PONG" not in output
    assert seen == []


def test_what_the_deployment_opened_is_reachable_and_nothing_else(
    require_bwrap: str, sandbox_root: Path, make_spec: SpecFactory
) -> None:
    provider = LocalProvider({"root_dir": sandbox_root, "isolation": "required"})
    with recording_server() as (opened_port, _), recording_server() as (closed_port, _):
        opened, closed = f"127.0.0.1:{opened_port}", f"127.0.0.1:{closed_port}"
        provider.use_egress_openings((opened,))
        spec = make_spec(
            provider_options={"command": ["python3", "-c", NETWORK_PROBE, opened, closed]},
            egress={"allow_network": True},
        )
        handle = provider.provision(spec)
        wait_until_final(provider, handle, limit=60)
        output = output_of(provider, handle)
        provider.terminate(handle)
    assert f"proxy {opened} HTTP/1.1 200" in output, output
    assert f"proxy {closed} HTTP/1.1 403" in output, output


# Inside the sandbox: open many connections straight to the proxy's socket and hold them.
HOLDER = r"""
import socket, sys, time
held, refused = [], 0
for _ in range(int(sys.argv[1])):
    one = socket.socket(socket.AF_UNIX)
    try:
        one.connect("/run/corral/egress/proxy.sock")
    except OSError:
        refused += 1
        continue
    held.append(one)
print(f"held={len(held)} refused={refused}", flush=True)
open("holding", "w").write("1")
time.sleep(60)
"""


def _status(pid: int) -> dict[str, str]:
    lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    return dict(line.split(":\t", 1) for line in lines if ":\t" in line)


def test_a_sandbox_holding_a_thousand_connections_keeps_its_proxy_within_bounds(
    require_bwrap: str, sandbox_root: Path, make_spec: SpecFactory
) -> None:
    provider = LocalProvider({"root_dir": sandbox_root, "isolation": "required"})
    spec = make_spec(
        provider_options={"command": ["python3", "-c", HOLDER, "1000"]},
        egress={"allow_network": True},
    )
    handle = provider.provision(spec)
    box = sandbox_root / spec.sandbox_id
    try:
        holding = box / "work" / "holding"
        wait_for("the sandbox to hold its connections", holding.exists, limit_s=60)
        proxies = [pid for pid in proxies_under(box) if b"python" in _cmd(pid)]
        assert proxies, "the proxy runs"
        status = _status(proxies[-1])
        threads = int(status["Threads"])
        uid = int(status["Uid"].split()[0])
    finally:
        provider.terminate(handle)
    # At most one thread a held connection under the cap, plus the server's own.
    assert threads <= MAX_CONNECTIONS + 4, threads
    if os.geteuid() == 0:
        assert uid == provider.config.sandbox_uid, "the proxy runs as the sandbox's user"


def _cmd(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0]
    except OSError:
        return b""
