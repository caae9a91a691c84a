"""The egress proxy runs in the host's network, where the host's own services listen on
every address it has, global ones included: a global address of the host itself is closed
like loopback unless the deployment opened it. Run in a network namespace the test makes,
where a global address stands on the namespace's loopback interface: no packet leaves it."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

from tests.conftest import require

PROBE = r"""
import os, socket, subprocess, sys, threading
subprocess.run(["ip", "link", "set", "lo", "up"], check=True)
subprocess.run(["ip", "addr", "add", "1.2.3.4/32", "dev", "lo"], check=True)
service = socket.socket()
service.bind(("0.0.0.0", 0))  # the host's own service, on every address it has
service.listen(8)
port = service.getsockname()[1]

def serve():
    while True:
        connection, _ = service.accept()
        connection.sendall(b"SECRET")
        connection.close()

threading.Thread(target=serve, daemon=True).start()
from corral.providers.egress.proxy import Policy, Server
os.chdir(sys.argv[1])
for opened in ([], [{"host": "1.2.3.4", "port": port}]):
    name = f"p{len(opened)}.sock"
    rules = [{"host": "*", "port": None}]
    server = Server(name, Policy({"rules": rules, "open_networks": opened, "log_path": None}))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    with socket.socket(socket.AF_UNIX) as proxy:
        proxy.connect(name)
        proxy.sendall(f"CONNECT 1.2.3.4:{port} HTTP/1.1\r\n\r\n".encode())
        received = b""
        while chunk := proxy.recv(4096):  # both ends close once the service has answered
            received += chunk
    head, _, body = received.partition(b"\r\n\r\n")
    answer = head.split(b"\r\n")[0].decode()
    if " 200 " in answer:
        answer += " then " + body.decode()
    print(f"opened={bool(opened)} {answer}", flush=True)
"""


def test_the_hosts_own_global_address_is_closed_unless_opened(tmp_path: Path) -> None:
    require(os.geteuid() == 0, "root, to make a network namespace")
    require(shutil.which("ip") is not None and shutil.which("unshare") is not None, "iproute2")
    done = subprocess.run(
        ["unshare", "--net", "--", sys.executable, "-c", PROBE, str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0].startswith("opened=False HTTP/1.1 403"), done.stdout
    assert lines[1] == "opened=True HTTP/1.1 200 Connection established then SECRET", done.stdout
