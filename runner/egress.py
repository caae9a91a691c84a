"""The sandbox's end of corral's egress proxy, and its CA bundle. Standard library only.

When a sandbox's only way out is corral's egress proxy (allowed_hosts on the local and
docker providers), the proxy's Unix socket is mounted into the sandbox and named by
``CORRAL_EGRESS_PROXY_SOCKET``. Ordinary tools speak TCP to a proxy, so the runner listens
on ``127.0.0.1:$CORRAL_EGRESS_PROXY_PORT`` (what ``HTTP_PROXY`` and ``HTTPS_PROXY`` name)
and forwards each connection to the socket, byte for byte: the proxy decides.

The sandbox's CA bundle: the item's own CA (``CORRAL_CA_CERT_PEM``) and the CA corral made
for this sandbox (``CORRAL_EGRESS_CA_PEM``: the proxy terminates a bound host's TLS with its
certificates), after the system's store (``SSL_CERT_FILE`` replaces OpenSSL's default
store, so the bundle must hold it too), written to a file; ``SSL_CERT_FILE``,
``REQUESTS_CA_BUNDLE``, ``NODE_EXTRA_CA_CERTS``, ``GIT_SSL_CAINFO`` and ``CURL_CA_BUNDLE``
point at it for the work's commands.

A git input with a named secret: git names the credential's placeholder in an
``Authorization`` header (:data:`GIT_CREDENTIAL_PLACEHOLDER`), the proxy puts the value in
for the checkout's requests alone, and the runner withdraws it once the checkout has
fetched (:func:`finish_checkout`): after that, nothing in the sandbox can use it.
"""

from __future__ import annotations

import contextlib
import os
import select
import socket
import threading
from collections.abc import Mapping, MutableMapping

from .diagnostics import logger

SOCKET_VARIABLE = "CORRAL_EGRESS_PROXY_SOCKET"
PORT_VARIABLE = "CORRAL_EGRESS_PROXY_PORT"
CA_CERT_VARIABLE = "CORRAL_CA_CERT_PEM"
EGRESS_CA_VARIABLE = "CORRAL_EGRESS_CA_PEM"
CA_FILE_VARIABLES = (
    "SSL_CERT_FILE",
    "REQUESTS_CA_BUNDLE",
    "NODE_EXTRA_CA_CERTS",
    "GIT_SSL_CAINFO",
    "CURL_CA_BUNDLE",
)
# Where a system keeps its CA store, when OpenSSL's own default names none that is there.
SYSTEM_CA_FILES = (
    "/etc/ssl/certs/ca-certificates.crt",
    "/etc/pki/tls/certs/ca-bundle.crt",
    "/etc/ssl/ca-bundle.pem",
    "/etc/ssl/cert.pem",
)
GIT_CREDENTIAL_PLACEHOLDER = "corral-secret-binding:inputs.git"
# The proxy's own request: no checkout binding applies after it (providers/egress/proxy.py).
CHECKOUT_DONE = b"POST /corral/checkout-done HTTP/1.1\r\nHost: corral-egress\r\n\r\n"
CHECKOUT_DONE_TIMEOUT_S = 30.0
_CA_SOURCES = (CA_CERT_VARIABLE, EGRESS_CA_VARIABLE)  # what the bundle adds, in order


def _pipe(one: socket.socket, other: socket.socket) -> None:
    """Pass bytes both ways until both sides have finished sending, then close both."""
    open_ends = {one: other, other: one}
    with one, other:
        while open_ends:
            readable, _, _ = select.select(list(open_ends), [], [])
            for source in readable:
                try:
                    chunk = source.recv(65_536)
                    if chunk:
                        open_ends[source].sendall(chunk)
                        continue
                except OSError:
                    return
                with contextlib.suppress(OSError):
                    open_ends.pop(source).shutdown(socket.SHUT_WR)


def _forward(client: socket.socket, path: str) -> None:
    upstream = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        upstream.connect(path)
    except OSError as error:
        logger.warning("the egress proxy is not reachable: %s", error)
        upstream.close()
        client.close()
        return
    _pipe(client, upstream)


def _serve(listener: socket.socket, path: str) -> None:
    while True:
        client, _ = listener.accept()
        threading.Thread(target=_forward, args=(client, path), daemon=True).start()


def start_forwarder(environ: MutableMapping[str, str]) -> socket.socket | None:
    """Listen on 127.0.0.1:<port> and forward to the egress proxy's socket, when the
    environment names one; the listening socket (already bound), or None.

    Raises:
        OSError: the port could not be bound.
    """
    path = environ.get(SOCKET_VARIABLE)
    if not path:
        return None
    port = int(environ.get(PORT_VARIABLE) or "3128")
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind(("127.0.0.1", port))
    listener.listen(64)
    threading.Thread(
        target=_serve, args=(listener, path), name="egress-forwarder", daemon=True
    ).start()
    return listener


def install_ca_bundle(environ: MutableMapping[str, str]) -> str | None:
    """Write the sandbox's CA bundle and point the CA variables at it: the store the
    sandbox trusted until now (an ``SSL_CERT_FILE`` already set, else the system's), then
    ``CORRAL_CA_CERT_PEM`` and ``CORRAL_EGRESS_CA_PEM`` (both leave the environment). The
    file's path, or None when neither is set."""
    added = [pem for pem in (environ.pop(name, None) for name in _CA_SOURCES) if pem]
    if not added:
        return None
    import tempfile  # noqa: PLC0415 - with shutil and random: not for a runner without a CA

    directory = tempfile.mkdtemp(prefix="corral-ca-")
    path = os.path.join(directory, "ca-bundle.pem")
    with open(path, "w", encoding="ascii", errors="replace") as handle:
        for pem in (_trusted_store(environ), *added):
            handle.write(pem.strip() + "\n" if pem.strip() else "")
    for name in CA_FILE_VARIABLES:
        environ[name] = path
    return path


def _trusted_store(environ: MutableMapping[str, str]) -> str:
    """The certificates the sandbox trusts without corral: the file ``SSL_CERT_FILE``
    names, else OpenSSL's default file, else a system's usual one; empty without any."""
    candidates = [environ.get("SSL_CERT_FILE") or ""]
    with contextlib.suppress(ImportError):
        import ssl  # noqa: PLC0415 - an interpreter without it still gets the rest

        candidates.append(ssl.get_default_verify_paths().openssl_cafile)
    for candidate in (*candidates, *SYSTEM_CA_FILES):
        if not candidate:
            continue
        try:
            with open(candidate, encoding="ascii", errors="replace") as handle:
                text = handle.read()
        except OSError:
            continue
        if "-----BEGIN CERTIFICATE-----" in text:
            return text
    return ""


def finish_checkout(environ: Mapping[str, str]) -> None:
    """Tell corral's egress proxy that the checkout is done: from then on the git input's
    credential applies to no request, whoever sends it (the proxy cannot be told
    otherwise).

    Raises:
        OSError: the proxy is not reachable or did not confirm it.
    """
    path = environ.get(SOCKET_VARIABLE)
    if not path:
        raise OSError("no egress proxy in this sandbox (CORRAL_EGRESS_PROXY_SOCKET)")
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as proxy:
        proxy.settimeout(CHECKOUT_DONE_TIMEOUT_S)
        proxy.connect(path)
        proxy.sendall(CHECKOUT_DONE)
        answer = b""
        while b"\r\n" not in answer and len(answer) < 4096:
            chunk = proxy.recv(4096)
            if not chunk:
                break
            answer += chunk
    if not answer.startswith(b"HTTP/1.1 200 "):
        raise OSError("the egress proxy did not confirm that the checkout is done")
