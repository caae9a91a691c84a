"""The sandbox's end of corral's egress proxy, and its CA bundle. Standard library only.

When a sandbox's only way out is corral's egress proxy (allowed_hosts on the local and
docker providers), the proxy's Unix socket is mounted into the sandbox and named by
``CORRAL_EGRESS_PROXY_SOCKET``. Ordinary tools speak TCP to a proxy, so the runner listens
on ``127.0.0.1:$CORRAL_EGRESS_PROXY_PORT`` (what ``HTTP_PROXY`` and ``HTTPS_PROXY`` name)
and forwards each connection to the socket, byte for byte: the proxy decides.

``CORRAL_CA_CERT_PEM``, when set, is written to a file, and ``SSL_CERT_FILE``,
``REQUESTS_CA_BUNDLE`` and ``NODE_EXTRA_CA_CERTS`` point at it for the work's commands.
"""

from __future__ import annotations

import contextlib
import logging
import os
import select
import socket
import tempfile
import threading
from collections.abc import MutableMapping

logger = logging.getLogger(__name__)

SOCKET_VARIABLE = "CORRAL_EGRESS_PROXY_SOCKET"
PORT_VARIABLE = "CORRAL_EGRESS_PROXY_PORT"
CA_CERT_VARIABLE = "CORRAL_CA_CERT_PEM"
CA_FILE_VARIABLES = ("SSL_CERT_FILE", "REQUESTS_CA_BUNDLE", "NODE_EXTRA_CA_CERTS")


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
    """Write ``CORRAL_CA_CERT_PEM`` to a file and point the CA variables at it (the PEM
    itself leaves the environment); the file's path, or None without one."""
    pem = environ.pop(CA_CERT_VARIABLE, None)
    if not pem:
        return None
    directory = tempfile.mkdtemp(prefix="corral-ca-")
    path = os.path.join(directory, "ca-bundle.pem")
    with open(path, "w", encoding="ascii", errors="replace") as handle:
        handle.write(pem)
    for name in CA_FILE_VARIABLES:
        environ[name] = path
    return path
