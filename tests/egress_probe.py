"""Helpers for the enforced-egress tests: loopback HTTP servers that record what reaches
them, the probe a sandbox runs, and the egress proxies still running for a directory."""

from __future__ import annotations

import http.server
import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

# Part of a probe: get(url) asks for url through the proxy (HTTP_PROXY, HTTPS_PROXY) with the
# bound token's placeholder; its status and body, or what failed.
FETCH = r"""
import os, urllib.error, urllib.request
def get(url):
    token = "Bearer " + os.environ.get("API_TOKEN", "")
    request = urllib.request.Request(url, headers={"Authorization": token})
    try:
        with urllib.request.urlopen(request, timeout=20) as answer:
            return f"{answer.status} {answer.read().decode()}"
    except urllib.error.HTTPError as error:
        return str(error.code)
    except OSError as error:
        return f"error {error}"
"""

# Run inside the sandbox with python3: starts the runner's forwarder (as the runner does),
# asks for URL A (allowed) and URL B (not allowed), tries port A directly, then dumps its
# environment and the files of its work directory.
PROBE = (
    FETCH
    + r"""
import json, socket, sys
from runner.egress import start_forwarder
start_forwarder(os.environ)
print("A=" + get(sys.argv[1]), flush=True)
print("B=" + get(sys.argv[2]), flush=True)
try:
    socket.create_connection(("127.0.0.1", int(sys.argv[3])), timeout=2).close()
    print("direct=connected")
except OSError:
    print("direct=refused")
print("env=" + json.dumps(dict(os.environ)))
for folder, _, names in os.walk(os.environ.get("HOME", ".")):
    for name in names:
        with open(os.path.join(folder, name), "rb") as handle:
            print("file=" + handle.read().decode(errors="replace"))
for pid in os.listdir("/proc"):
    if pid.isdigit():
        try:
            with open(f"/proc/{pid}/environ", "rb") as handle:
                print("environ=" + handle.read().decode(errors="replace"))
        except OSError:
            pass
"""
)


class Recorded(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        self.server.seen.append((self.path, dict(self.headers.items())))  # type: ignore[attr-defined]
        self._answer(b"hello from the host")

    def do_TRACE(self) -> None:
        # As Apache httpd answers by default (TraceEnable On): the request's head, echoed.
        self.server.seen.append((self.path, dict(self.headers.items())))  # type: ignore[attr-defined]
        self._answer(f"{self.requestline}\r\n{self.headers}".encode("latin-1"))

    def _answer(self, body: bytes) -> None:
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:
        return


@contextmanager
def recording_server(
    host: str = "127.0.0.1",
) -> Iterator[tuple[int, list[tuple[str, dict[str, str]]]]]:
    """An HTTP server on ``host`` (loopback): its port and the (path, headers) of each
    request."""
    server = http.server.ThreadingHTTPServer((host, 0), Recorded)
    seen: list[tuple[str, dict[str, str]]] = []
    server.seen = seen  # type: ignore[attr-defined]
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server.server_address[1], seen
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


def proxies_under(directory: Path) -> list[int]:
    """Pids of egress proxies working in ``directory`` or below."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes()
            cwd = os.readlink(f"/proc/{entry}/cwd")
        except OSError:
            continue
        # Its script: egress/proxy.py on the host, egress_proxy.py under its bubblewrap.
        script = b"egress/proxy.py" in cmdline or b"egress_proxy.py" in cmdline
        if script and cwd.startswith(str(directory)):
            found.append(int(entry))
    return found
