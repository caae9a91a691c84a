"""corral's egress proxy where it terminates a bound host's TLS, in this process, against a
loopback HTTPS server: hostile clients (bad TLS, slow or huge heads, bad bodies, too many
connections) are answered or cut off, and the proxy still serves the next one; a checkout
binding applies to its own requests alone, until the checkout is done."""

from __future__ import annotations

import contextlib
import socket
import ssl
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from corral.providers.base import Egress, SecretBinding
from corral.providers.egress import http1, tls
from corral.providers.egress.plan import EGRESS_CA_VARIABLE, plan_proxy
from corral.providers.egress.proxy import Policy, Server
from tests.egress_probe import recording_server
from tests.tls_servers import LoopbackCa, recording_https_server

SECRET = "sk-intercepted"
CHECKOUT = (
    ("GET", "/o/r.git/info/refs?service=git-upload-pack"),
    ("POST", "/o/r.git/git-upload-pack"),
)


@dataclass
class Running:
    socket_path: Path
    ca_pem: str  # the sandbox's CA
    host: str  # 127.0.0.1:<port> of the HTTPS server
    seen: list[object]
    server: Server

    def connect(self, where: str | None = None) -> socket.socket:
        """A connection to the proxy, CONNECT answered."""
        proxy = socket.socket(socket.AF_UNIX)
        proxy.settimeout(10)
        proxy.connect(str(self.socket_path))
        try:
            proxy.sendall(f"CONNECT {where or self.host} HTTP/1.1\r\n\r\n".encode())
            answer = proxy.recv(4096)
            assert answer.startswith(b"HTTP/1.1 200 "), answer
        except BaseException:  # refused (past the cap, say): closed here, not left to the GC
            proxy.close()
            raise
        return proxy

    def once(self, request: str) -> bytes:
        """What the proxy first answers ``request`` on a connection of its own."""
        with socket.socket(socket.AF_UNIX) as proxy:
            proxy.settimeout(10)
            proxy.connect(str(self.socket_path))
            with contextlib.suppress(BrokenPipeError):  # refused at once, past the cap
                proxy.sendall(request.encode("latin-1"))
            return proxy.recv(4096)

    def tls(self, *, alpn: list[str] | None = None) -> ssl.SSLSocket:
        context = ssl.create_default_context(cadata=self.ca_pem)
        if alpn:
            context.set_alpn_protocols(alpn)
        raw = self.connect()
        try:
            return context.wrap_socket(raw, server_hostname="127.0.0.1")
        except BaseException:
            raw.close()
            raise


def _ask(connection: socket.socket, request: bytes) -> bytes:
    connection.sendall(request)
    data = b""
    with contextlib.suppress(TimeoutError, OSError):
        while b"\r\n\r\n" not in data or not (
            data.endswith(b"tls") or b" 403 " in data or b"close" in data
        ):
            chunk = connection.recv(65_536)
            if not chunk:
                break
            data += chunk
    return data


@contextlib.contextmanager
def running_proxy(
    tmp_path: Path,
    binding: SecretBinding | None = None,
    *,
    allowed: bool = True,
    max_connections: int = 256,
) -> Iterator[Running]:
    ca = LoopbackCa(tmp_path / "ca")
    with recording_https_server(ca) as (port, seen):
        host = f"127.0.0.1:{port}"
        bound = binding or SecretBinding(host=host, value=SECRET, header="Authorization")
        bound = bound.model_copy(update={"host": host})
        egress = Egress(
            allow_network=True,
            allowed_hosts=(host,) if allowed else ("elsewhere.example",),
            secret_bindings={"TOKEN" if not bound.checkout_requests else "inputs.git": bound},
        )
        plan = plan_proxy(
            egress,
            log_path=tmp_path / "egress.log",
            exit_after_s=None,
            valid_s=600,
            open_networks=(host,),
            upstream_ca_file=ca.ca_file,
        )
        path = tmp_path / "p.sock"
        server = Server(str(path), Policy(plan.config), max_connections)
        thread = threading.Thread(target=server.serve_forever, daemon=True)
        thread.start()
        try:
            yield Running(path, plan.env[EGRESS_CA_VARIABLE], host, seen, server)
        finally:
            server.shutdown()
            server.server_close()
            thread.join(timeout=10)


GOOD = b"GET /ok HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer corral-secret-binding:TOKEN\r\n\r\n"


def test_hostile_clients_never_stop_the_proxy(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(http1, "HEADER_TIMEOUT_S", 0.5)
    monkeypatch.setattr(tls, "HANDSHAKE_TIMEOUT_S", 0.5)
    with running_proxy(tmp_path) as proxy:
        # Not TLS at all after the CONNECT's answer, and no handshake at all: closed.
        for opening in (b"GET / HTTP/1.1\r\n\r\n", b""):
            raw = proxy.connect()
            raw.sendall(opening)
            raw.settimeout(10)
            with contextlib.suppress(OSError):  # a TLS alert at most, then the end
                while raw.recv(4096):
                    pass
            raw.close()
        # Data sent before the CONNECT's answer: refused.
        assert b" 400 " in proxy.once(f"CONNECT {proxy.host} HTTP/1.1\r\n\r\n\x16\x03\x01")
        # Inside TLS: a huge head, a bad chunked body, a head a byte at a time.
        with proxy.tls() as inner:
            assert b" 431 " in _ask(inner, b"GET / HTTP/1.1\r\nX: " + b"a" * 70_000 + b"\r\n\r\n")
        with proxy.tls() as inner:
            bad = b"POST / HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\nnope\r\n"
            assert b" 400 " in _ask(inner, bad)
        with proxy.tls() as inner:
            for byte in b"GET / HTTP/1.1\r\nX: " + b"a" * 100:
                try:
                    inner.send(bytes([byte]))
                except OSError:
                    break
                time.sleep(0.02)
            assert b" 408 " in _ask(inner, b"")
        # HTTP/2 is not offered: a client asking for it gets HTTP/1.1 or nothing.
        with proxy.tls(alpn=["h2", "http/1.1"]) as inner:
            assert inner.selected_alpn_protocol() == "http/1.1"
            assert _ask(inner, GOOD).endswith(b"hello over tls")
        # After all that, served as ever, the value put in.
        with proxy.tls() as inner:
            for _ in range(3):  # keep-alive: three requests, one connection
                assert _ask(inner, GOOD).endswith(b"hello over tls")
    # (The bad body's head reached the server, its body cut short: never a request more.)
    served = [s for s in proxy.seen if s.path == "/ok"]
    assert [s.headers["Authorization"] for s in served] == [f"Bearer {SECRET}"] * 4
    assert len(proxy.seen) == 5


def test_past_max_connections_the_next_is_refused_and_served_once_one_ends(tmp_path: Path) -> None:
    with running_proxy(tmp_path, max_connections=2) as proxy:
        held = [proxy.tls(), proxy.tls()]
        assert b" 503 " in proxy.once(f"CONNECT {proxy.host} HTTP/1.1\r\n\r\n")
        for connection in held:
            connection.close()
        deadline = time.monotonic() + 10
        while True:
            try:
                with proxy.tls() as inner:
                    assert _ask(inner, GOOD).endswith(b"hello over tls")
                break
            except AssertionError:
                if time.monotonic() > deadline:
                    raise


def test_a_checkout_binding_applies_to_its_requests_alone_until_the_checkout_is_done(
    tmp_path: Path,
) -> None:
    binding = SecretBinding(
        host="x", value="Basic c2VjcmV0", header="Authorization", checkout_requests=CHECKOUT
    )
    placeholder = b"Authorization: corral-secret-binding:inputs.git\r\n\r\n"
    git = b"GET /o/r.git/info/refs?service=git-upload-pack HTTP/1.1\r\n" + placeholder
    other = b"GET /o/other.git/info/refs?service=git-upload-pack HTTP/1.1\r\n" + placeholder
    with running_proxy(tmp_path, binding, allowed=False) as proxy:
        opened_before = proxy.tls()
        with proxy.tls() as inner:
            assert _ask(inner, git).endswith(b"hello over tls")
        with proxy.tls() as inner:  # not in allowed_hosts: the checkout's requests alone
            assert b" 403 " in _ask(inner, other)
        # Plain HTTP to the same host never gets the credential (nor goes through).
        plain = socket.socket(socket.AF_UNIX)
        plain.connect(str(proxy.socket_path))
        assert b" 403 " in _ask(
            plain,
            f"GET http://{proxy.host}{CHECKOUT[0][1]} HTTP/1.1\r\n\r\n".encode(),
        )
        plain.close()
        done = proxy.once("POST /corral/checkout-done HTTP/1.1\r\nHost: corral-egress\r\n\r\n")
        assert done.startswith(b"HTTP/1.1 200 ")
        # After it: a connection opened before gets 403, a new CONNECT is refused.
        assert b" 403 " in _ask(opened_before, git)
        opened_before.close()
        assert b" 403 " in proxy.once(f"CONNECT {proxy.host} HTTP/1.1\r\n\r\n")
    assert [(s.path, s.headers.get("Authorization")) for s in proxy.seen] == [
        ("/o/r.git/info/refs?service=git-upload-pack", "Basic c2VjcmV0")
    ]


@pytest.mark.parametrize("method", ["TRACE", "TRACK", "trace"])
def test_a_request_that_the_destination_echoes_back_gets_no_value(
    tmp_path: Path, method: str
) -> None:
    # A destination that answers TRACE (Apache httpd does by default) echoes the request's
    # head, the value put in included, back to the work.
    traced = f"{method} /echo HTTP/1.1\r\nAuthorization: Bearer corral-secret-binding:TOKEN"
    with running_proxy(tmp_path) as proxy, proxy.tls() as inner:
        answer = _ask(inner, f"{traced}\r\n\r\n".encode())
        assert b" 403 " in answer and SECRET.encode() not in answer
    assert not proxy.seen


def test_a_plain_http_request_that_the_destination_echoes_back_gets_no_value(
    tmp_path: Path,
) -> None:
    with recording_server() as (port, seen):
        host = f"127.0.0.1:{port}"
        bound = SecretBinding(host=host, value=SECRET, header="Authorization")
        egress = Egress(allow_network=True, allowed_hosts=(host,), secret_bindings={"T": bound})
        plan = plan_proxy(egress, log_path=None, exit_after_s=None, valid_s=600)
        plan.config["open_networks"] = [{"host": "127.0.0.1", "port": port}]
        server = Server(str(tmp_path / "p.sock"), Policy(plan.config))
        threading.Thread(target=server.serve_forever, daemon=True).start()
        try:
            with socket.socket(socket.AF_UNIX) as plain:
                plain.settimeout(10)
                plain.connect(str(tmp_path / "p.sock"))
                traced = (
                    f"TRACE http://{host}/echo HTTP/1.1\r\nAuthorization: corral-secret-binding:T"
                )
                answer = _ask(plain, f"{traced}\r\n\r\n".encode())
        finally:
            server.shutdown()
            server.server_close()
    assert b" 403 " in answer and SECRET.encode() not in answer
    assert not seen
