"""corral's egress proxy for one sandbox. Standard library only; run as a script:

    python -I -S proxy.py      (its configuration, JSON, on stdin)

It listens on a Unix socket, the sandbox's only way out: the sandbox has no network of its
own (bubblewrap ``--unshare-net``, Docker ``network_mode=none``) and reaches the socket
through a mount (the runner forwards ``127.0.0.1:<port>`` in the sandbox to it, so ordinary
tools work with ``HTTP_PROXY=http://127.0.0.1:<port>``). It takes HTTP requests in absolute
form (``GET http://host/path``) and ``CONNECT host:port``, only to the allowed hosts (the rule
``*`` allows any); any other destination or request gets ``403`` and a line in its log
(method, host and port, never headers).

Closed addresses: whatever the allowed hosts say, the proxy resolves the destination itself
and connects only to an address that is open: never loopback, unspecified, private (RFC 1918,
ULA), shared (CGNAT), link-local, multicast, reserved or documentation addresses, nor any of
them embedded in an IPv6 address (IPv4-mapped, NAT64, 6to4, Teredo), unless the deployment
opened it (``open_networks``, a deployment setting, never a message field). The check is on
the address it connects to, so neither a name that resolves to the control plane nor
``0.0.0.0/0`` in the allowed hosts reaches the host's services.

Bounds: at most ``max_connections`` connections at once (the next ones get ``503``), the
request head within ``HEADER_TIMEOUT_S`` of its first byte, and a tunnel that moves no byte
for ``idle_timeout_s`` is closed. Thread stacks are small. The provider runs it as the
sandbox's user, inside the sandbox's memory limits, and it makes itself non-dumpable (its
configuration holds the bindings' values and the bound hosts' keys).

Secret bindings: the sandbox's environment holds a placeholder; in a request to a binding's
host the proxy replaces the placeholder in the request's headers (only the binding's header,
when it names one) with the real value, which never enters the sandbox. Plain HTTP as it
comes; HTTPS by terminating the bound host's TLS (:mod:`.tls`): on ``CONNECT`` to it the
proxy reaches the host over TLS it verifies, answers 200, shows the sandbox a certificate
of a CA made for this sandbox alone, and relays HTTP/1.1 requests one by one
(:mod:`.http1`), each with the values put in. Other hosts are tunnelled untouched.

A checkout binding (``checkout_requests``: a private git input's credential) applies inside
TLS alone, to those requests alone, and only until ``POST /corral/checkout-done`` (the
runner's, once it has fetched): a latch nothing turns back. Its host, if not allowed, is
reached for those requests alone and until then.

Configuration (stdin): ``socket`` (a path, relative to the working directory: Unix socket
paths are short), ``rules`` (``[{"host", "port"}]``: a name, an address or a CIDR network;
port null for any), ``bindings`` (``[{"host", "port", "placeholder", "value", "header",
"checkout_requests"}]``), ``tls`` (``{"leaves": [{"host", "cert", "key"}], "upstream_ca_pem"}``:
the bound hosts' certificates and the deployment's CA bundle for destinations),
``open_networks`` (``[{"host", "port"}]``: networks the deployment opened), ``log_path``
(null: its stderr), ``max_connections``, ``idle_timeout_s``, and ``exit_after_s`` (an upper
bound on its life; null for none). Once it listens it writes ``ready`` on stdout.
"""

from __future__ import annotations

import contextlib
import ctypes
import ipaddress
import json
import os
import re
import select
import socket
import socketserver
import ssl
import sys
import threading
import time
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

if TYPE_CHECKING or __package__:  # corral's own module (its tests, the webhook transport)
    from corral.providers.egress import http1, tls
else:  # the script, under -I -S: its modules of its own lie beside it
    sys.path.append(os.path.dirname(os.path.realpath(__file__)))
    import http1
    import tls

RefusedError = http1.RefusedError
CONNECT_TIMEOUT_S = 30.0
MAX_CONNECTIONS = 256
IDLE_TIMEOUT_S = 300.0
THREAD_STACK_BYTES = 256 * 1024
ANY_HOST = "*"  # the rule that allows every destination (still only open addresses)
_NAT64 = ipaddress.ip_network("64:ff9b::/96")
_GLOBAL_UNICAST_V6 = ipaddress.ip_network("2000::/3")
LOG_FIELD_MAX = 255  # characters of a logged field (a host) at most
LOG_LINES_PER_S = 20  # lines of one event a second at most; the rest are counted
LOG_MAX_BYTES = 8 * 1024 * 1024  # what one proxy writes to its log at most
HOST_ADDRESSES_TTL_S = 5.0
# Hop-by-hop and proxy headers: never passed on to the destination.
# The client's Host goes too: the destination gets the checked URL's authority instead, so
# that a request to an allowed host cannot name another site behind the same server.
_DROPPED = frozenset(
    {"proxy-authorization", "proxy-connection", "connection", "keep-alive", "host"}
)
# Inside an intercepted connection the proxy frames each body itself and answers
# ``Expect: 100-continue`` itself.
_DROPPED_INSIDE = _DROPPED | http1.HOP_BY_HOP | {"content-length", "expect"}
# The one request the proxy answers itself: the runner's, once the checkout is done. After
# it no checkout binding applies (a latch: nothing turns it back).
CHECKOUT_DONE = b"POST /corral/checkout-done HTTP/1.1"
# Methods a destination answers by echoing the request (TRACE; TRACK, IIS's): never sent with
# a binding's value in it, which the answer would carry back to the sandbox.
ECHOED_METHODS = frozenset({"TRACE", "TRACK"})


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
    if rule["host"] in (host, ANY_HOST):
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
        port = default_port if parts.port is None else parts.port
    except ValueError as exc:
        raise RefusedError(400, "bad port") from exc
    if port == 0:
        raise RefusedError(400, "bad port")
    if not parts.hostname:
        raise RefusedError(400, "no host")
    return parts.hostname.lower().rstrip("."), port


class Request:
    """The head of one client request: where it goes and what to send there."""

    def __init__(self, head: bytes) -> None:
        parsed = http1.parse_head(head)
        self.method, target, self.version = parsed.words
        self.headers = parsed.headers
        self.inside = False  # a request inside a connection whose TLS the proxy terminated
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

    @classmethod
    def within(cls, parsed: http1.Head, host: str, port: int) -> Request:
        """A request inside an intercepted connection to ``host:port``: in origin form.

        Raises:
            RefusedError: 400, not in origin form (``/path``).
        """
        request = cls.__new__(cls)
        request.method, request.path, request.version = parsed.words
        if not request.path.startswith("/") or request.method == "CONNECT":
            raise RefusedError(400, "a request inside the TLS connection names its path alone")
        request.headers, request.inside = parsed.headers, True
        request.host, request.port = host, port
        return request

    def origin_form(self, bindings: list[dict[str, Any]], framing: int | None = None) -> bytes:
        """The request for the destination: origin form, no proxy or hop-by-hop headers,
        and the bindings' values in place of their placeholders. One request per
        connection, except inside an intercepted one, where ``framing`` (from
        :func:`.http1.request_framing`) says how the proxy sends its body on."""
        default = self.port == (443 if self.inside else 80)
        host = f"[{self.host}]" if ":" in self.host else self.host
        lines = [f"{self.method} {self.path} {self.version}"]
        lines.append(f"Host: {host}" if default else f"Host: {host}:{self.port}")
        dropped = _DROPPED_INSIDE if self.inside else _DROPPED
        for name, value in self.headers:
            if name.strip().lower() in dropped:
                continue
            lines.append(f"{name}:{_substituted(name, value, bindings)}")
        if not self.inside:
            lines.append("Connection: close")
        elif framing or any(name.strip().lower() == "content-length" for name, _ in self.headers):
            lines += http1.framing_line(framing)  # a body, or an empty one said so
        return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")


def _substituted(name: str, value: str, bindings: list[dict[str, Any]]) -> str:
    """A header's value with each binding's placeholder replaced by its value (only in the
    binding's header, when it names one): the one place a binding's value is put in. In one
    pass, the longest placeholder first: one that begins another (``TOK``, ``TOK_RO``) is
    never replaced inside it, and a value is never searched again."""
    values = {
        b["placeholder"]: b["value"]
        for b in bindings
        if b.get("header") is None or b["header"].lower() == name.strip().lower()
    }
    if not values:
        return value
    found = "|".join(re.escape(p) for p in sorted(values, key=len, reverse=True))
    return re.sub(found, lambda match: values[match.group(0)], value)


def relay(one: socket.socket, other: socket.socket, idle_s: float = IDLE_TIMEOUT_S) -> None:
    """Pass bytes both ways until both sides have finished sending, or none moved for
    ``idle_s``. poll, not select: a proxy with many connections has descriptors past 1024."""
    open_ends = {one.fileno(): (one, other), other.fileno(): (other, one)}
    for end in (one, other):  # a peer that reads nothing holds a send no longer than that
        end.settimeout(idle_s)
    poller = select.poll()
    for fd in open_ends:
        poller.register(fd, select.POLLIN)
    while open_ends:
        events = poller.poll(idle_s * 1000)
        if not events:
            return  # idle: both are closed by the caller
        for fd, _ in events:
            source, target = open_ends[fd]
            try:
                chunk = source.recv(65_536)
            except OSError:
                chunk = b""
            if chunk:
                try:
                    target.sendall(chunk)
                    continue
                except OSError:
                    return
            poller.unregister(fd)
            del open_ends[fd]
            with contextlib.suppress(OSError):
                target.shutdown(socket.SHUT_WR)


Address = ipaddress.IPv4Address | ipaddress.IPv6Address


def _embedded(ip: Address) -> list[Address]:
    """``ip`` and every IPv4 address an IPv6 one carries (mapped, NAT64, 6to4, Teredo)."""
    found: list[Address] = [ip]
    if isinstance(ip, ipaddress.IPv6Address):
        if ip.ipv4_mapped is not None:
            found.append(ip.ipv4_mapped)
        if ip in _NAT64:
            found.append(ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF))
        if ip.sixtofour is not None:
            found.append(ip.sixtofour)
        if ip.teredo is not None:
            found.extend(ip.teredo)
    return found


def forbidden_destination(address: str) -> bool:
    """Whether ``address`` is closed unless the deployment opened it: anything but a global
    unicast address (loopback, unspecified, private, shared, link-local, multicast,
    reserved, documentation), in any form an IPv6 address can carry an IPv4 one."""
    ip = ipaddress.ip_address(address.split("%", maxsplit=1)[0])
    # Outside global unicast, IPv6 carries IPv4 in more forms than can be listed
    # (IPv4-compatible, SIIT, local-use NAT64): none of it is open.
    v6 = isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is None
    if v6 and ip not in _GLOBAL_UNICAST_V6:
        return True
    return any(not one.is_global or one.is_multicast for one in _embedded(ip))


_host_cache: tuple[float, frozenset[str]] = (0.0, frozenset())


def host_addresses() -> frozenset[str]:
    """This host's own addresses (its local routes, IPv4 and IPv6), read from /proc/net at
    most every HOST_ADDRESSES_TTL_S: global ones among them lead to the host's services."""
    global _host_cache  # noqa: PLW0603 - a cache of one process's view of its host
    read_at, found = _host_cache
    if time.monotonic() - read_at < HOST_ADDRESSES_TTL_S:
        return found
    addresses: set[str] = set()
    with contextlib.suppress(OSError), open("/proc/net/fib_trie", encoding="ascii") as trie:
        last = ""
        for line in trie:
            if "|--" in line:
                last = line.split("|--", 1)[1].strip()
            elif "/32 host LOCAL" in line and last:
                addresses.add(last)
    with contextlib.suppress(OSError), open("/proc/net/if_inet6", encoding="ascii") as table:
        for line in table:
            digits = line.split()[0] if line.strip() else ""
            if len(digits) == 32:
                addresses.add(str(ipaddress.IPv6Address(int(digits, 16))))
    _host_cache = (time.monotonic(), frozenset(addresses))
    return _host_cache[1]


class Policy:
    """What the proxy lets through, and its log."""

    def __init__(self, config: dict[str, Any]) -> None:
        self.rules: list[dict[str, Any]] = config["rules"]
        self.tls = tls.Tls(config.get("tls"))
        self.bindings: list[dict[str, Any]] = config.get("bindings", [])
        self.open_networks: list[dict[str, Any]] = config.get("open_networks", [])
        self.idle_s = float(config.get("idle_timeout_s") or IDLE_TIMEOUT_S)
        self._log_path: str | None = config.get("log_path")
        self._lock = threading.Lock()
        self._rates: dict[str, tuple[int, int, int]] = {}  # event: second, lines, dropped
        self._written = 0
        self._checkout_done = False

    def allows(self, host: str, port: int) -> bool:
        return any(rule_matches(rule, host, port) for rule in self.rules)

    def finish_checkout(self) -> None:
        """From now on no checkout binding applies, on connections open or to come."""
        self._checkout_done = True

    def is_open(self, address: str, port: int) -> bool:
        """Whether the proxy may connect to ``address``: a global one that is not this
        host's own (its services listen there too), or one the deployment opened."""
        plain = address.split("%", maxsplit=1)[0]
        if not forbidden_destination(plain) and plain not in host_addresses():
            return True
        return self.opened(plain, port)

    def opened(self, address: str, port: int) -> bool:
        """Whether the deployment opened ``address``."""
        plain = address.split("%", maxsplit=1)[0]
        return any(rule_matches(rule, plain, port) for rule in self.open_networks)

    def bindings_for(self, host: str, port: int, request: Request) -> list[dict[str, Any]]:
        """The bindings whose values go into ``request``: its host's. A checkout binding
        only until the checkout is done, inside TLS and in one of its requests alone.

        Raises:
            RefusedError: 403, a method whose answer echoes the request, to a bound host.
        """
        found = self._bindings_for(host, port, request)
        if found and request.method.upper() in ECHOED_METHODS:
            self.log("egress_refused", reason="echoing method", host=host, port=port)
            raise RefusedError(403, f"{request.method} to a bound host would echo its secret")
        return found

    def _bindings_for(self, host: str, port: int, request: Request) -> list[dict[str, Any]]:
        return [
            b
            for b in self.bindings
            if rule_matches(b, host, port)
            and (
                not b.get("checkout_requests")
                or (
                    request.inside
                    and not self._checkout_done
                    and [request.method, request.path] in b["checkout_requests"]
                )
            )
        ]

    def intercepts(self, host: str, port: int) -> bool:
        """Whether the proxy terminates TLS to ``host:port``: a binding of its applies
        (a checkout binding until the checkout is done)."""
        return any(
            rule_matches(b, host, port) and not (b.get("checkout_requests") and self._checkout_done)
            for b in self.bindings
        )

    def log(self, event: str, **fields: Any) -> None:
        """One JSON line, bounded: each field cut to LOG_FIELD_MAX characters, at most
        LOG_LINES_PER_S lines of an event a second (the rest counted in the next one), and
        LOG_MAX_BYTES in all, whatever the sandbox makes the proxy refuse."""
        with self._lock:
            second = int(time.monotonic())
            count, dropped = self._rates.get(event, (second, 0, 0))[1:]
            if self._rates.get(event, (second,))[0] != second:
                count = 0
            if count >= LOG_LINES_PER_S or self._written >= LOG_MAX_BYTES:
                self._rates[event] = (second, count, dropped + 1)
                return
            self._rates[event] = (second, count + 1, 0)
            cut = {k: v[:LOG_FIELD_MAX] if isinstance(v, str) else v for k, v in fields.items()}
            if dropped:
                cut["dropped_before"] = dropped
            line = json.dumps({"time": time.time(), "event": event, **cut}) + "\n"
            self._written += len(line)
            if self._written >= LOG_MAX_BYTES:
                line += json.dumps({"time": time.time(), "event": "log_full"}) + "\n"
            self._write(line)

    def _write(self, line: str) -> None:
        if self._log_path is None:
            sys.stderr.write(line)
            sys.stderr.flush()
            return
        with open(self._log_path, "a", encoding="utf-8") as handle:
            handle.write(line)


class Handler(socketserver.BaseRequestHandler):
    server: Server

    def handle(self) -> None:
        client: socket.socket = self.request
        policy = self.server.policy
        stream = http1.Stream(client, policy.idle_s)
        try:
            head = stream.head(wait_s=http1.HEADER_TIMEOUT_S)
            if head is None:
                return
            if head.split(b"\r\n", 1)[0] == CHECKOUT_DONE:
                policy.finish_checkout()
                policy.log("egress_checkout_done")
                http1.answer(client, 200, "the checkout's credential applies no more")
                return
            request = Request(head)
            where = {"method": request.method, "host": request.host, "port": request.port}
            intercept = request.method == "CONNECT" and policy.intercepts(
                request.host, request.port
            )
            if not (policy.allows(request.host, request.port) or intercept):
                policy.log("egress_refused", reason="not in allowed_hosts", **where)
                raise RefusedError(403, f"{request.host}:{request.port} is not in allowed_hosts")
            if intercept and not policy.tls.terminates(request.host):
                # Never a tunnel that would carry the placeholder where the value was meant.
                policy.log("egress_refused", reason="no certificate for a bound host", **where)
                raise RefusedError(
                    403,
                    f"{request.host} is bound by a secret binding to a network, whose TLS the "
                    "proxy cannot terminate: bind the host's name or address",
                )
            tunnel = request.method == "CONNECT"
            bindings = [] if tunnel else policy.bindings_for(request.host, request.port, request)
            upstream = _connect(policy, request.host, request.port, where)
        except RefusedError as refusal:
            http1.answer(client, refusal.status, str(refusal))
            return
        except OSError:
            return  # the client went away
        with upstream:
            policy.log("egress_allowed", **where, **({"tls": "terminated"} if intercept else {}))
            if intercept:
                _intercept(policy, stream, upstream, request)
                return
            if request.method == "CONNECT":
                client.sendall(b"HTTP/1.1 200 Connection established\r\n\r\n")
            else:
                upstream.sendall(request.origin_form(bindings))
            rest = stream.take()
            if rest:
                upstream.sendall(rest)
            relay(client, upstream, policy.idle_s)


def _intercept(
    policy: Policy, stream: http1.Stream, upstream: socket.socket, connect: Request
) -> None:
    """Terminate the client's TLS with the host's certificate, reach the destination over
    TLS checked against the trust store, and relay the requests between them with the
    bindings' values put in."""
    client, host, port = stream.sock, connect.host, connect.port
    where = {"method": "CONNECT", "host": host, "port": port}
    if stream.take():  # TLS sent before the CONNECT was answered: nothing to terminate it with
        http1.answer(client, 400, "data before the CONNECT's answer")
        return
    try:
        secured = policy.tls.to_destination(upstream, host)
    except ssl.SSLCertVerificationError:
        policy.log("egress_unreachable", error="certificate not verified", **where)
        http1.answer(client, 502, f"the certificate of {host}:{port} could not be verified")
        return
    except OSError:
        policy.log("egress_unreachable", error="tls", **where)
        http1.answer(client, 502, f"no TLS connection to {host}:{port}")
        return
    with secured:
        client.sendall(b"HTTP/1.1 200 Connection established\r\n\r\n")
        try:
            inner = policy.tls.from_client(client, host)
        except OSError:
            policy.log("egress_refused", reason="tls handshake with the sandbox", **where)
            return
        with inner:

            def rewrite(head: http1.Head, framing: int) -> bytes:
                request = Request.within(head, host, port)
                bindings = policy.bindings_for(host, port, request)
                # Not allowed itself: a checkout binding's host, for its requests alone and
                # only until the checkout is done (on connections opened before too).
                if not bindings and not policy.allows(host, port):
                    policy.log("egress_refused", reason="not the checkout's", **where)
                    raise RefusedError(403, f"{host}:{port} is reached for the checkout alone")
                return request.origin_form(bindings, framing)

            with contextlib.suppress(OSError):  # a side went away or was too slow
                http1.converse(
                    http1.Stream(inner, policy.idle_s),
                    http1.Stream(secured, policy.idle_s),
                    rewrite,
                )


def _connect(policy: Policy, host: str, port: int, where: dict[str, Any]) -> socket.socket:
    """A connection to an open address of ``host``: resolved here, each address checked
    before it is tried, and the peer checked again once connected.

    Raises:
        RefusedError: 403 when every address is closed, 502 when none could be reached.
    """
    try:
        found = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except OSError as exc:
        policy.log("egress_unreachable", error="unresolved", **where)
        raise RefusedError(502, f"{host}:{port} could not be resolved") from exc
    candidates = [info for info in found if policy.is_open(str(info[4][0]), port)]
    if not candidates:
        policy.log("egress_refused", reason="closed address", **where)
        raise RefusedError(
            403,
            f"{host}:{port} leads only to addresses this deployment keeps closed (loopback, "
            "private, link-local and the like)",
        )
    for family, kind, protocol, _, address in candidates:
        upstream = socket.socket(family, kind, protocol)
        upstream.settimeout(CONNECT_TIMEOUT_S)
        try:
            upstream.connect(address)
        except OSError:
            upstream.close()
            continue
        peer = upstream.getpeername()[0]
        # The kernel answers a connection to one of this host's addresses from that same
        # address: the host itself, whatever the address looked like.
        itself = upstream.getsockname()[0] == peer
        if policy.is_open(peer, port) and not (itself and not policy.opened(peer, port)):
            upstream.settimeout(None)
            return upstream
        upstream.close()
    policy.log("egress_unreachable", error="connect", **where)
    raise RefusedError(502, f"{host}:{port} could not be reached")


class Server(socketserver.ThreadingMixIn, socketserver.UnixStreamServer):
    daemon_threads = True
    block_on_close = False

    def __init__(self, path: str, policy: Policy, max_connections: int = MAX_CONNECTIONS) -> None:
        self.policy = policy
        self._slots = threading.BoundedSemaphore(max_connections)
        self._refusal_logged = 0.0
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        super().__init__(path, Handler)
        # The sandbox may run as another user (Docker images do); only its mount reaches here.
        os.chmod(path, 0o666)  # noqa: S103

    def process_request(self, request: Any, client_address: Any) -> None:
        """Serve the connection on a thread of its own, or answer 503 at once past the cap:
        no thread, no read."""
        if not self._slots.acquire(blocking=False):
            if time.monotonic() - self._refusal_logged > 1.0:  # a flood writes one a second
                self._refusal_logged = time.monotonic()
                self.policy.log("egress_refused", reason="too many connections")
            http1.answer(request, 503, "too many connections at once")
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except (RuntimeError, MemoryError):  # no thread to be had: this one is refused
            self._slots.release()
            self.policy.log("egress_refused", reason="no thread for the connection")
            http1.answer(request, 503, "too many connections at once")
            self.shutdown_request(request)
        except BaseException:
            self._slots.release()
            raise

    def handle_error(self, request: Any, client_address: Any) -> None:
        """One line, never a traceback: the proxy serves on whatever one connection did."""
        self.policy.log("egress_error", error=type(sys.exc_info()[1]).__name__)

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()


def _undumpable() -> None:
    """No process of the same user may read this one's memory (the bindings' values)."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(4, 0, 0, 0, 0)  # PR_SET_DUMPABLE


def main() -> None:
    _undumpable()
    threading.stack_size(THREAD_STACK_BYTES)
    config = json.load(sys.stdin)
    limit = int(config.get("max_connections") or MAX_CONNECTIONS)
    server = Server(config["socket"], Policy(config), limit)
    exit_after = config.get("exit_after_s")
    if exit_after:  # never outlive the sandbox it serves, even if nobody ends it
        timer = threading.Timer(float(exit_after), lambda: os._exit(0))
        timer.daemon = True
        timer.start()
    print("ready", flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main()
