"""One webhook POST, to an address checked as sandbox egress is, within a deadline.

The target's host is resolved here and each address checked before it is tried, with the
egress proxy's rules (corral.providers.egress.proxy): only a global unicast address that is
not this host's own, unless the deployment opened it (``CORRAL_WEBHOOK_OPEN_NETWORKS``). The
connection goes to the address that was checked (the name is not resolved again, so a name
that changes its answer between the check and the connect reaches nothing closed), and the
peer is checked again once connected. TLS verifies the URL's host name.

Bounds: ``CONNECT_TIMEOUT_S`` to connect, ``TOTAL_TIMEOUT_S`` for the whole exchange (the
socket is shut when it passes), redirects are not followed, and at most ``MAX_ANSWER_BYTES``
of the answer's body are read. No error message quotes the URL (it may hold a token).
"""

from __future__ import annotations

import contextlib
import http.client
import socket
import ssl
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from corral.providers.egress.proxy import forbidden_destination, host_addresses, rule_matches
from corral.providers.egress.rules import HostRule
from corral.worker.outcome_sinks.base import OutcomeDeliveryError

CONNECT_TIMEOUT_S = 5.0
TOTAL_TIMEOUT_S = 10.0
MAX_ANSWER_BYTES = 4096


class WebhookAddressRefusedError(OutcomeDeliveryError):
    """the webhook's host leads only to addresses closed to webhooks"""

    code = "webhook_address_refused"


@dataclass(frozen=True)
class Answer:
    """What the endpoint answered: its status and the first bytes of its body."""

    status: int
    body: bytes


def is_open(address: str, port: int, openings: Sequence[HostRule]) -> bool:
    """Whether a webhook may connect to ``address``: a global unicast one that is not this
    host's own, or one ``openings`` (the deployment's) opened."""
    plain = address.split("%", maxsplit=1)[0]
    if not forbidden_destination(plain) and plain not in host_addresses():
        return True
    return opened(plain, port, openings)


def opened(address: str, port: int, openings: Sequence[HostRule]) -> bool:
    plain = address.split("%", maxsplit=1)[0]
    return any(rule_matches(rule.as_json(), plain, port) for rule in openings)


def open_addresses(
    host: str, port: int, openings: Sequence[HostRule]
) -> list[tuple[int, tuple[Any, ...]]]:
    """The addresses of ``host`` a webhook may connect to: ``(family, socket address)``.

    Raises:
        OutcomeDeliveryError: the host could not be resolved.
        WebhookAddressRefusedError: it leads only to closed addresses.
    """
    try:
        found = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except OSError as exc:
        raise OutcomeDeliveryError("the webhook's host could not be resolved") from exc
    candidates: list[tuple[int, tuple[Any, ...]]] = [
        (int(info[0]), tuple(info[4])) for info in found if is_open(str(info[4][0]), port, openings)
    ]
    if not candidates:
        raise WebhookAddressRefusedError(
            "the webhook's host leads only to addresses this deployment keeps closed "
            "(loopback, private, link-local, its own; CORRAL_WEBHOOK_OPEN_NETWORKS opens them)"
        )
    return candidates


def _connected(
    candidates: Sequence[tuple[int, tuple[Any, ...]]], port: int, openings: Sequence[HostRule]
) -> socket.socket:
    """A socket connected to the first candidate that answers and is still open once
    connected (the kernel answers a connection to this host's own address from it).

    Raises:
        OutcomeDeliveryError: none could be reached.
    """
    for family, address in candidates:
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.settimeout(CONNECT_TIMEOUT_S)
        try:
            sock.connect(address)
        except OSError:
            sock.close()
            continue
        peer = sock.getpeername()[0]
        itself = sock.getsockname()[0] == peer
        if is_open(peer, port, openings) and not (itself and not opened(peer, port, openings)):
            return sock
        sock.close()
    raise OutcomeDeliveryError("the webhook's host could not be reached")


class _PinnedConnection(http.client.HTTPConnection):
    """An HTTP connection over a socket already connected (to a checked address)."""

    def __init__(self, host: str, port: int, sock: socket.socket) -> None:
        super().__init__(host, port, timeout=TOTAL_TIMEOUT_S)
        self._pinned = sock

    def connect(self) -> None:
        self.sock = self._pinned


def post(url: str, headers: Mapping[str, str], body: bytes, openings: Sequence[HostRule]) -> Answer:
    """POST ``body`` to ``url`` with ``headers``, at a checked address, within the bounds.

    Raises:
        OutcomeDeliveryError: it could not be resolved or reached, or the exchange failed
            or passed its deadline.
        WebhookAddressRefusedError: the host leads only to closed addresses.
    """
    started = time.monotonic()
    parts = urlsplit(url)
    host = parts.hostname or ""
    tls = parts.scheme == "https"
    port = parts.port or (443 if tls else 80)
    sock = _connected(open_addresses(host, port, openings), port, openings)
    held = [sock]  # the socket the deadline shuts: TLS wraps (and detaches) the plain one
    deadline = threading.Timer(TOTAL_TIMEOUT_S - (time.monotonic() - started), _shut, [held])
    deadline.start()
    try:
        if tls:
            sock = held[0] = ssl.create_default_context().wrap_socket(sock, server_hostname=host)
        path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        connection = _PinnedConnection(host, port, sock)
        connection.request("POST", path, body=body, headers=dict(headers))
        response = connection.getresponse()
        answer = Answer(response.status, response.read(MAX_ANSWER_BYTES))
        connection.close()
        return answer
    except (OSError, http.client.HTTPException) as exc:
        late = time.monotonic() - started >= TOTAL_TIMEOUT_S
        reason = f"passed its {TOTAL_TIMEOUT_S:.0f} s deadline" if late else type(exc).__name__
        raise OutcomeDeliveryError(f"the webhook POST failed: {reason}") from exc
    finally:
        deadline.cancel()
        sock.close()


def _shut(held: list[socket.socket]) -> None:
    with contextlib.suppress(OSError):  # closed already: the exchange ended in time
        held[0].shutdown(socket.SHUT_RDWR)
