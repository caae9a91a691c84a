"""corral's egress proxy for one sandbox. Standard library only; run as a script:

    python -I -S egress_proxy.py      (its configuration, JSON, on stdin)

It listens on a Unix socket, the sandbox's only way out: the sandbox has no network of its
own (bubblewrap ``--unshare-net``, Docker ``network_mode=none``) and reaches the socket
through a mount (the runner forwards ``127.0.0.1:<port>`` in the sandbox to it, so ordinary
tools work with ``HTTP_PROXY=http://127.0.0.1:<port>``). It takes HTTP requests in absolute
form (``GET http://host/path``) and ``CONNECT host:port``, only to the allowed hosts; any
other destination or request gets ``403`` and a line in its log (method, host and port,
never headers). It resolves and connects on the host's side, so ``127.0.0.1`` in an allowed
host is the host's loopback.

Secret bindings: the sandbox's environment holds a placeholder; in a plain-HTTP request to
a binding's host the proxy replaces the placeholder in the request's headers (only the
binding's header, when it names one) with the real value, which never enters the sandbox.
Inside ``CONNECT`` (TLS) nothing is replaced: the proxy does not intercept TLS.

Configuration (stdin): ``socket`` (a path, relative to the working directory: Unix socket
paths are short), ``rules`` (``[{"host", "port"}]``: a name, an address or a CIDR network;
port null for any), ``bindings`` (``[{"host", "port", "placeholder", "value", "header"}]``),
``log_path``, and ``exit_after_s`` (an upper bound on its life; null for none). Once it
listens it writes ``ready`` on stdout.
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
import os
import select
import socket
import socketserver
import sys
import threading
import time
from typing import Any
from urllib.parse import urlsplit

MAX_HEAD = 65_536
CONNECT_TIMEOUT_S = 30.0
_HEAD_END = b"\r\n\r\n"
# Hop-by-hop and proxy headers: never passed on to the destination.
# The client's Host goes too: the destination gets the checked URL's authority instead, so
# that a request to an allowed host cannot name another site behind the same server.
_DROPPED = frozenset(
    {"proxy-authorization", "proxy-connection", "connection", "keep-alive", "host"}
)


class RefusedError(Exception):
    """The request is not let through; ``status`` and the reason go back to the client."""

    def __init__(self, status: int, reason: str) -> None:
        super().__init__(reason)
        self.status = status


def _address(host: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    try:
        return ipaddress.ip_address(host)
    except ValueError:
        return None


def rule_matches(rule: dict[str, Any], host: str, port: int) -> bool:
    """Whether ``host:port`` is what ``rule`` allows: the same name, or an address inside
    its address or network (names are not resolved to match a network)."""
    if rule.get("port") is not None and rule["port"] != port:
        return False
    if rule["host"] == host:
        return True
    address = _address(host)
    if address is None:
        return False
    try:
        return address in ipaddress.ip_network(rule["host"], strict=False)
    except ValueError:
        return False


def _split_authority(authority: str, default_port: int) -> tuple[str, int]:
    parts = urlsplit(f"//{authority}")
    try:
        port = parts.port or default_port
    except ValueError as exc:
        raise RefusedError(400, "bad port") from exc
    if not parts.hostname:
        raise RefusedError(400, "no host")
    return parts.hostname.lower().rstrip("."), port


class Request:
    """The head of one client request: where it goes and what to send there."""

    def __init__(self, head: bytes) -> None:
        lines = head.decode("latin-1").split("\r\n")
        parts = lines[0].split(" ")
        if len(parts) != 3 or not parts[2].startswith("HTTP/"):
            raise RefusedError(400, "not an HTTP request")
        self.method, target, self.version = parts
        self.headers = [tuple(line.split(":", 1)) for line in lines[1:] if ":" in line]
        if self.method == "CONNECT":
            self.host, self.port = _split_authority(target, 443)
            self.path = ""
            return
        url = urlsplit(target)
        if url.scheme != "http" or not url.netloc:
            raise RefusedError(
                400, "only absolute http:// requests and CONNECT (for https) go through"
            )
        self.host, self.port = _split_authority(url.netloc, 80)
        self.path = (url.path or "/") + (f"?{url.query}" if url.query else "")

    def origin_form(self, bindings: list[dict[str, Any]]) -> bytes:
        """The request for the destination: origin form, no proxy or hop-by-hop headers,
        one request per connection, and the bindings' values in place of their
        placeholders."""
        default = self.port == 80
        host = f"[{self.host}]" if ":" in self.host else self.host
        lines = [f"{self.method} {self.path} {self.version}"]
        lines.append(f"Host: {host}" if default else f"Host: {host}:{self.port}")
        for name, value in self.headers:
            if name.strip().lower() in _DROPPED:
                continue
            lines.append(f"{name}:{_substituted(name, value, bindings)}")
        lines.append("Connection: close")
        return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")


def _substituted(name: str, value: str, bindings: list[dict[str, Any]]) -> str:
    for binding in bindings:
        header = binding.get("header")
        if header is None or header.lower() == name.strip().lower():
            value = value.replace(binding["placeholder"], binding["value"])
    return value


def _read_head(client: socket.socket) -> tuple[bytes, bytes]:
    """The request's head and whatever of its body came with it."""
    data = b""
    while _HEAD_END not in data:
        chunk = client.recv(65_536)
        if not chunk:
            raise RefusedError(400, "the request ended before its headers did")
        data += chunk
        if len(data) > MAX_HEAD and _HEAD_END not in data[:MAX_HEAD]:
            raise RefusedError(431, "request headers too large")
    head, rest = data.split(_HEAD_END, 1)
    return head, rest


def relay(one: socket.socket, other: socket.socket) -> None:
    """Pass bytes both ways until both sides have finished sending."""
    open_ends = {one: other, other: one}
    while open_ends:
        readable, _, _ = select.select(list(open_ends), [], [])
        for source in readable:
            try:
                chunk = source.recv(65_536)
            except OSError:
                chunk = b""
            target = open_ends[source]
            if chunk:
                try:
                    target.sendall(chunk)
                    continue
                except OSError:
                    return
            del open_ends[source]
            with contextlib.suppress(OSError):
                target.shutdown(socket.SHUT_WR)


class Policy:
    """What the proxy lets through, and its log."""

    def __init__(self, config: dict[str, Any]) -> None:
        self.rules: list[dict[str, Any]] = config["rules"]
        self.bindings: list[dict[str, Any]] = config.get("bindings", [])
        self._log_path: str | None = config.get("log_path")
        self._lock = threading.Lock()

    def allows(self, host: str, port: int) -> bool:
        return any(rule_matches(rule, host, port) for rule in self.rules)

    def bindings_for(self, host: str, port: int) -> list[dict[str, Any]]:
        return [b for b in self.bindings if rule_matches(b, host, port)]

    def log(self, event: str, **fields: Any) -> None:
        line = json.dumps({"time": time.time(), "event": event, **fields})
        with self._lock:
            if self._log_path is None:
                print(line, file=sys.stderr, flush=True)
                return
            with open(self._log_path, "a", encoding="utf-8") as handle:
                handle.write(line + "\n")


class Handler(socketserver.BaseRequestHandler):
    server: Server

    def handle(self) -> None:
        client: socket.socket = self.request
        policy = self.server.policy
        try:
            head, rest = _read_head(client)
            request = Request(head)
            where = {"method": request.method, "host": request.host, "port": request.port}
            if not policy.allows(request.host, request.port):
                policy.log("egress_refused", reason="not in allowed_hosts", **where)
                raise RefusedError(403, f"{request.host}:{request.port} is not in allowed_hosts")
            upstream = self._connect(request, where)
        except RefusedError as refusal:
            _answer(client, refusal.status, str(refusal))
            return
        except OSError:
            return  # the client went away
        with upstream:
            policy.log("egress_allowed", **where)
            if request.method == "CONNECT":
                client.sendall(b"HTTP/1.1 200 Connection established\r\n\r\n")
            else:
                bindings = policy.bindings_for(request.host, request.port)
                upstream.sendall(request.origin_form(bindings))
            if rest:
                upstream.sendall(rest)
            relay(client, upstream)

    def _connect(self, request: Request, where: dict[str, Any]) -> socket.socket:
        try:
            upstream = socket.create_connection((request.host, request.port), CONNECT_TIMEOUT_S)
        except OSError as exc:
            self.server.policy.log("egress_unreachable", error=type(exc).__name__, **where)
            raise RefusedError(502, f"{request.host}:{request.port} could not be reached") from exc
        # Link-local addresses (a cloud's metadata service) are never a destination, whatever
        # a name resolves to: checked on the address actually connected to.
        if forbidden_destination(upstream.getpeername()[0]):
            upstream.close()
            self.server.policy.log("egress_refused", reason="link-local address", **where)
            raise RefusedError(403, f"{request.host}:{request.port} is a link-local address")
        return upstream


def forbidden_destination(address: str) -> bool:
    """Whether the proxy refuses to connect to ``address`` whatever the allowed hosts say:
    link-local ones (169.254.0.0/16, fe80::/10, and IPv4 ones mapped into IPv6)."""
    ip = ipaddress.ip_address(address.split("%", maxsplit=1)[0])
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return ip.is_link_local


def _answer(client: socket.socket, status: int, reason: str) -> None:
    body = f"corral egress proxy: {reason}\n".encode()
    words = {400: "Bad Request", 403: "Forbidden", 431: "Too Large", 502: "Bad Gateway"}
    head = (
        f"HTTP/1.1 {status} {words.get(status, 'Error')}\r\nContent-Type: text/plain\r\n"
        f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    )
    with contextlib.suppress(OSError):
        client.sendall(head.encode() + body)


class Server(socketserver.ThreadingMixIn, socketserver.UnixStreamServer):
    daemon_threads = True

    def __init__(self, path: str, policy: Policy) -> None:
        self.policy = policy
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        super().__init__(path, Handler)
        # The sandbox may run as another user (Docker images do); only its mount reaches here.
        os.chmod(path, 0o666)  # noqa: S103


def main() -> None:
    config = json.load(sys.stdin)
    server = Server(config["socket"], Policy(config))
    limit = config.get("exit_after_s")
    if limit:  # never outlive the sandbox it serves, even if nobody ends it
        timer = threading.Timer(float(limit), lambda: os._exit(0))
        timer.daemon = True
        timer.start()
    print("ready", flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main()
