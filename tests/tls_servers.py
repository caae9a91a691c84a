"""Loopback TLS servers for the egress tests: a CA of the test's own, servers with its
certificates (an API that records what reaches it, and a private git repository behind HTTP
Basic auth, served by git http-backend), and the scan a sandbox makes for a secret."""

from __future__ import annotations

import base64
import http.server
import ipaddress
import os
import shutil
import ssl
import subprocess
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from corral.providers.base import SandboxProvider, SandboxSpec
from tests.conftest import SpecFactory
from tests.egress_probe import FETCH

GIT_HTTP_BACKEND = "/usr/lib/git-core/git-http-backend"


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


@dataclass
class LoopbackCa:
    """A CA made by the test: its certificate in ``ca_file``; it signs servers' certificates."""

    directory: Path
    common_name: str = "corral test CA"
    _key: ec.EllipticCurvePrivateKey = field(init=False, repr=False)
    _cert: x509.Certificate = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self._key = ec.generate_private_key(ec.SECP256R1())
        now = datetime.now(UTC)
        self._cert = (
            x509.CertificateBuilder()
            .subject_name(_name(self.common_name))
            .issuer_name(_name(self.common_name))
            .public_key(self._key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - timedelta(hours=1))
            .not_valid_after(now + timedelta(hours=2))
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .add_extension(
                x509.SubjectKeyIdentifier.from_public_key(self._key.public_key()), critical=False
            )
            .sign(self._key, hashes.SHA256())
        )
        self.directory.mkdir(parents=True, exist_ok=True)
        self.ca_file.write_bytes(self.pem)

    @property
    def ca_file(self) -> Path:
        return self.directory / f"{self.common_name.replace(' ', '-')}.pem"

    @property
    def pem(self) -> bytes:
        return self._cert.public_bytes(serialization.Encoding.PEM)

    def server_context(self, host: str = "127.0.0.1") -> ssl.SSLContext:
        """A server context with a certificate for ``host`` signed by this CA."""
        key = ec.generate_private_key(ec.SECP256R1())
        now = datetime.now(UTC)
        cert = (
            x509.CertificateBuilder()
            .subject_name(_name(f"{self.common_name} server"))
            .issuer_name(_name(self.common_name))
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - timedelta(hours=1))
            .not_valid_after(now + timedelta(hours=2))
            .add_extension(
                x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address(host))]),
                critical=False,
            )
            .add_extension(
                x509.AuthorityKeyIdentifier.from_issuer_public_key(self._key.public_key()),
                critical=False,
            )
            .sign(self._key, hashes.SHA256())
        )
        path = self.directory / f"server-{x509.random_serial_number()}.pem"
        path.write_bytes(
            cert.public_bytes(serialization.Encoding.PEM)
            + key.private_bytes(
                serialization.Encoding.PEM,
                serialization.PrivateFormat.PKCS8,
                serialization.NoEncryption(),
            )
        )
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.load_cert_chain(path)
        path.unlink()
        return context


@dataclass(frozen=True)
class Seen:
    method: str
    path: str
    headers: dict[str, str]
    body: bytes


class _Recording(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, as an API is

    def _record(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(length) if length else b""
        seen = Seen(self.command, self.path, dict(self.headers.items()), body)
        self.server.seen.append(seen)  # type: ignore[attr-defined]
        answer = b"hello over tls"
        self.send_response(200)
        self.send_header("Content-Length", str(len(answer)))
        self.end_headers()
        self.wfile.write(answer)

    def do_GET(self) -> None:
        self._record()

    def do_POST(self) -> None:
        self._record()

    def do_TRACE(self) -> None:
        # As Apache httpd answers by default (TraceEnable On): the request's head, echoed.
        echo = f"{self.requestline}\r\n{self.headers}".encode("latin-1")
        self.send_response(200)
        self.send_header("Content-Type", "message/http")
        self.send_header("Content-Length", str(len(echo)))
        self.end_headers()
        self.wfile.write(echo)

    def log_message(self, format: str, *args: object) -> None:
        return


@contextmanager
def _serving(
    handler: type[http.server.BaseHTTPRequestHandler],
    context: ssl.SSLContext,
    host: str = "127.0.0.1",
    **state: object,
) -> Iterator[http.server.ThreadingHTTPServer]:
    server = http.server.ThreadingHTTPServer((host, 0), handler)
    server.daemon_threads = True
    server.socket = context.wrap_socket(server.socket, server_side=True)
    for name, value in state.items():
        setattr(server, name, value)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


@contextmanager
def recording_https_server(ca: LoopbackCa) -> Iterator[tuple[int, list[Seen]]]:
    """An HTTPS server on loopback with a certificate of ``ca``: its port and each request."""
    seen: list[Seen] = []
    with _serving(_Recording, ca.server_context(), seen=seen) as server:
        yield server.server_address[1], seen


class _GitBackend(http.server.BaseHTTPRequestHandler):
    """git http-backend behind HTTP Basic auth: 401 without the expected credential."""

    protocol_version = "HTTP/1.1"

    def _serve(self) -> None:
        server = self.server
        authorization = self.headers.get("Authorization", "")
        server.seen.append((self.command, self.path, authorization))  # type: ignore[attr-defined]
        if authorization != server.expected:  # type: ignore[attr-defined]
            self.send_response(401)
            self.send_header("WWW-Authenticate", 'Basic realm="git"')
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        path, _, query = self.path.partition("?")
        length = int(self.headers.get("Content-Length") or 0)
        environ = {
            "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
            "GIT_PROJECT_ROOT": str(server.root),  # type: ignore[attr-defined]
            "GIT_HTTP_EXPORT_ALL": "1",
            "REQUEST_METHOD": self.command,
            "PATH_INFO": path,
            "QUERY_STRING": query,
            "CONTENT_TYPE": self.headers.get("Content-Type", ""),
            "CONTENT_LENGTH": str(length),
            "HTTP_CONTENT_ENCODING": self.headers.get("Content-Encoding", ""),
            "HTTP_GIT_PROTOCOL": self.headers.get("Git-Protocol", ""),
            "REMOTE_USER": "tester",
            "REMOTE_ADDR": "127.0.0.1",
        }
        body = self.rfile.read(length) if length else b""
        done = subprocess.run(
            [GIT_HTTP_BACKEND], input=body, env=environ, capture_output=True, check=False
        )
        head, _, content = done.stdout.partition(b"\r\n\r\n")
        status = 200
        headers = []
        for line in head.decode("latin-1").split("\r\n"):
            name, _, value = line.partition(":")
            if name.lower() == "status":
                status = int(value.split()[0])
            elif name:
                headers.append((name, value.strip()))
        self.send_response(status)
        for name, value in headers:
            self.send_header(name, value)
        self.send_header("Content-Length", str(len(content)))
        self.end_headers()
        self.wfile.write(content)

    def do_GET(self) -> None:
        self._serve()

    def do_POST(self) -> None:
        self._serve()

    def log_message(self, format: str, *args: object) -> None:
        return


@contextmanager
def private_git_server(
    ca: LoopbackCa, root: Path, secret: str, host: str = "127.0.0.1"
) -> Iterator[tuple[int, list[tuple[str, str, str]]]]:
    """The repositories under ``root`` over HTTPS on ``host`` (a loopback address; a
    certificate of ``ca``), answering only ``Authorization: Basic
    base64("x-access-token:<secret>")``: its port, and each request's method, target and
    Authorization header."""
    if not Path(GIT_HTTP_BACKEND).exists() or shutil.which("git") is None:
        raise RuntimeError("git and its http-backend are needed")
    expected = "Basic " + base64.b64encode(f"x-access-token:{secret}".encode()).decode()
    seen: list[tuple[str, str, str]] = []
    context = ca.server_context(host)
    with _serving(_GitBackend, context, host, seen=seen, root=root, expected=expected) as server:
        yield server.server_address[1], seen


# Run inside the sandbox with python3 (appended to a probe of its own; its arguments that
# start with "scan=" name what it looks for, in hex, so that no command line holds it): every
# file it can open (but the host's read-only system directories, bound as they are on the
# host), its whole environment, /proc/self and what it can read of every process (environ,
# cmdline), searched for each; prints each place one is found, then how many files it read.
SECRET_SCAN = r"""
import os, sys
wanted = [bytes.fromhex(a[5:]) for a in sys.argv[1:] if a.startswith("scan=")]
SYSTEM = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/sys", "/proc", "/dev")
found, read = [], 0
def look(path, data):
    for one in wanted:
        if one in data:
            found.append(path)
def read_file(path):
    global read
    try:
        with open(path, "rb") as handle:
            data = handle.read(64 * 1024 * 1024)
    except OSError:
        return
    read += 1
    look(path, data)
for folder, dirs, names in os.walk("/"):
    if folder == "/":
        dirs[:] = [d for d in dirs if "/" + d not in SYSTEM]
    for name in names:
        path = os.path.join(folder, name)
        if os.path.isfile(path):
            read_file(path)
for folder, dirs, names in os.walk("/proc/self", followlinks=False):
    dirs[:] = [d for d in dirs if d not in ("task", "net", "fd", "map_files", "fdinfo")]
    for name in names:
        if name not in ("pagemap", "mem", "kcore", "clear_refs"):
            read_file(os.path.join(folder, name))
for pid in os.listdir("/proc"):
    if pid.isdigit():
        for part in ("environ", "cmdline"):
            read_file(f"/proc/{pid}/{part}")
look("os.environ", repr(dict(os.environ)).encode())
for path in found:
    print("found=" + path, flush=True)
print(f"scanned={read}", flush=True)
"""


SECRET = "sk-bound-https-never-in-the-sandbox"

# Run inside the sandbox with python3: starts the runner's forwarder and writes its CA
# bundle (as the runner does), asks for each name=URL argument with the bound token's
# placeholder, says which CA issued what each host=HOST:PORT argument is shown.
PROBE = (
    FETCH
    + r"""
import socket, ssl, sys
from runner.egress import install_ca_bundle, start_forwarder
start_forwarder(os.environ)
install_ca_bundle(os.environ)
def issuer(where):
    host, port = where.rsplit(":", 1)
    proxy = socket.create_connection(("127.0.0.1", int(os.environ["CORRAL_EGRESS_PROXY_PORT"])))
    proxy.sendall(f"CONNECT {where} HTTP/1.1\r\n\r\n".encode())
    proxy.recv(4096)
    context = ssl.create_default_context(cafile=os.environ["SSL_CERT_FILE"])
    with context.wrap_socket(proxy, server_hostname=host) as tls:
        return dict(part[0] for part in tls.getpeercert()["issuer"])["commonName"]
for argument in sys.argv[1:]:
    kind, _, rest = argument.partition("=")
    if kind == "issuer":
        print(f"issuer {rest}={issuer(rest)}", flush=True)
    elif kind != "scan":
        print(f"{kind}={get(rest)}", flush=True)
print("ssl_cert_file=" + os.environ.get("SSL_CERT_FILE", ""), flush=True)
print("git_ssl_cainfo=" + os.environ.get("GIT_SSL_CAINFO", ""), flush=True)
"""
)


@dataclass(frozen=True)
class HttpsServers:
    """The three servers of the HTTPS probe: ``bound`` (a binding's, certificate of the
    deployment's CA), ``unbound`` (allowed, not bound) and ``forged`` (bound, certificate of
    a CA nobody trusts), as 127.0.0.1:<port>, and what each saw."""

    bound: str
    unbound: str
    forged: str
    seen: tuple[list[Seen], list[Seen], list[Seen]]


@contextmanager
def https_servers(ca: LoopbackCa, directory: Path) -> Iterator[HttpsServers]:
    rogue = LoopbackCa(directory, "rogue CA")
    with (
        recording_https_server(ca) as (port_a, seen_a),
        recording_https_server(ca) as (port_b, seen_b),
        recording_https_server(rogue) as (port_c, seen_c),
    ):
        hosts = (f"127.0.0.1:{port}" for port in (port_a, port_b, port_c))
        yield HttpsServers(*hosts, seen=(seen_a, seen_b, seen_c))


def probing_spec(
    provider: SandboxProvider, make_spec: SpecFactory, ca: LoopbackCa, servers: HttpsServers
) -> SandboxSpec:
    """A sandbox that runs PROBE and SECRET_SCAN against ``servers`` (looking for SECRET),
    API_TOKEN bound to the bound server, OTHER_TOKEN to the forged one; the item trusts the
    test's CA itself, to reach the one that is not bound. ``provider``'s deployment opens
    the servers (loopback is closed to sandboxes) and trusts ``ca`` for destinations."""
    provider.use_egress_upstream_ca(ca.ca_file)
    provider.use_egress_openings((servers.bound, servers.unbound, servers.forged))
    binding = {"value": SECRET, "header": "Authorization"}
    command = [
        "python3",
        "-c",
        PROBE + SECRET_SCAN,
        f"a=https://{servers.bound}/a",
        f"b=https://{servers.unbound}/b",
        f"c=https://{servers.forged}/c",
        f"issuer={servers.bound}",
        f"issuer={servers.unbound}",
        f"scan={SECRET.encode().hex()}",
    ]
    return make_spec(
        provider_options={"command": command},
        egress={
            "allow_network": True,
            "allowed_hosts": [servers.bound, servers.unbound, servers.forged],
            "ca_cert_pem": ca.pem.decode(),
            "secret_bindings": {
                "API_TOKEN": {"host": servers.bound, **binding},
                "OTHER_TOKEN": {"host": servers.forged, **binding},
            },
        },
    )


def assert_https_outcome(output: str, log: str, servers: HttpsServers) -> None:
    """What the probe and the servers saw: the value at the bound host alone, the unbound
    one tunnelled, the forged one refused, and nothing of the value in the sandbox."""
    seen_a, seen_b, seen_c = servers.seen
    bound, unbound = servers.bound, servers.unbound
    assert "a=200 hello over tls" in output, output
    assert [seen.headers["Authorization"] for seen in seen_a] == [f"Bearer {SECRET}"]
    # Not bound: tunnelled, its own certificate shown, the placeholder left as it was.
    assert "b=200 hello over tls" in output, output
    placeholder = "corral-secret-binding:API_TOKEN"
    assert [seen.headers["Authorization"] for seen in seen_b] == [f"Bearer {placeholder}"]
    assert f"issuer {unbound}=corral test CA" in output, output
    assert f"issuer {bound}=corral egress proxy, one sandbox" in output, output
    # A bound host whose certificate the deployment does not trust: refused, never reached
    # with the value.
    assert "c=error <urlopen error Tunnel connection failed: 502" in output, output
    assert seen_c == []
    assert '"error": "certificate not verified"' in log, log
    # Every tool's CA variable names the bundle.
    assert "ssl_cert_file=/tmp/corral-ca-" in output and "git_ssl_cainfo=/tmp/corral-ca-" in output
    assert "found=" not in output, output
    assert int(output.split("scanned=")[1].split(maxsplit=1)[0]) > 50, output
    assert SECRET not in output and SECRET not in log
