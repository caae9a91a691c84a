"""The TLS of corral's egress proxy (:mod:`.proxy`) where it terminates a bound host's:
the certificates it shows the sandbox, and how it checks the destination's. Standard
library only: the proxy imports this module from beside it.

The certificates are made for one sandbox by the provider worker
(:mod:`corral.providers.egress.certificates`): a certificate and key per bound host, signed
by a CA made for that sandbox alone, whose key is discarded once they are signed. They come
on the proxy's stdin; ``ssl`` loads a certificate from a path only, so each is put in a
memory file of the proxy's own (``memfd``), which no other process can open (the proxy is
not dumpable), and closed once loaded.
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import socket
import ssl
import tempfile
from collections.abc import Iterator
from typing import Any

HANDSHAKE_TIMEOUT_S = 15.0


class Tls:
    """The certificates the proxy terminates a bound host's TLS with (one per host, made
    for this sandbox alone), and the trust it checks destinations against: the system's
    store and the deployment's CA bundle (``upstream_ca_pem``)."""

    def __init__(self, config: dict[str, Any] | None) -> None:
        config = config or {}
        self._leaves = {
            _canonical(leaf["host"]): _server_context(leaf["cert"], leaf["key"])
            for leaf in config.get("leaves", [])
        }
        self._upstream: ssl.SSLContext | None = None
        if self._leaves:  # the system's store is read only by a proxy that will need it
            self._upstream = ssl.create_default_context()
            if config.get("upstream_ca_pem"):
                self._upstream.load_verify_locations(cadata=config["upstream_ca_pem"])
            self._upstream.set_alpn_protocols(["http/1.1"])

    def terminates(self, host: str) -> bool:
        return _canonical(host) in self._leaves

    def to_destination(self, sock: socket.socket, host: str) -> ssl.SSLSocket:
        """``sock`` to ``host`` over TLS, its certificate and name verified.

        Raises:
            ssl.SSLCertVerificationError: they are not; OSError: no handshake in time.
        """
        assert self._upstream is not None
        sock.settimeout(HANDSHAKE_TIMEOUT_S)
        return self._upstream.wrap_socket(sock, server_hostname=host)

    def from_client(self, sock: socket.socket, host: str) -> ssl.SSLSocket:
        """The client's ``sock`` over TLS, the proxy showing ``host``'s certificate; HTTP/1.1
        alone is offered (ALPN).

        Raises:
            OSError: no handshake within HANDSHAKE_TIMEOUT_S, or a failed one.
        """
        sock.settimeout(HANDSHAKE_TIMEOUT_S)
        return self._leaves[_canonical(host)].wrap_socket(sock, server_side=True)


def _canonical(host: str) -> str:
    """A host as the certificates are keyed: an address in its one written form."""
    try:
        return str(ipaddress.ip_address(host))
    except ValueError:
        return host


def _server_context(cert_pem: str, key_pem: str) -> ssl.SSLContext:
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.set_alpn_protocols(["http/1.1"])
    with _pem_file(cert_pem + "\n" + key_pem) as path:
        context.load_cert_chain(path)
    return context


@contextlib.contextmanager
def _pem_file(pem: str) -> Iterator[str]:
    """A path to ``pem`` that no other process can open, for as long as it is loaded: a
    memory file of this (non-dumpable) process; else a file in a private directory,
    removed at once."""
    try:
        fd = os.memfd_create("corral-egress-pem")
    except (AttributeError, OSError):
        fd = -1
    if fd >= 0 and os.path.isdir("/proc/self/fd"):
        try:
            os.write(fd, pem.encode())
            yield f"/proc/self/fd/{fd}"
        finally:
            os.close(fd)
        return
    if fd >= 0:
        os.close(fd)
    with tempfile.TemporaryDirectory(prefix="corral-egress-") as directory:
        path = os.path.join(directory, "leaf.pem")
        with open(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "w") as handle:
            handle.write(pem)
        yield path
