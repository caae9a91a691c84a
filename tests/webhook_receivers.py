"""A webhook receiver on loopback, as an org would run one: it records each delivery and
checks it as docs/webhooks.md tells a receiver to (the signature over the timestamp and the
raw body, the timestamp within the replay window, the event id the header names)."""

from __future__ import annotations

import hashlib
import hmac
import json
import ssl
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

TOLERANCE_S = 5 * 60  # the documented snippet's replay window


class InvalidWebhookError(Exception):
    """A delivery the documented check refuses."""


def verify(secret: str, headers: dict[str, str], body: bytes) -> dict[str, Any]:
    """The event of one delivery, checked as the documented snippet checks it.

    Raises:
        InvalidWebhookError: a bad signature, an old timestamp, or a body whose id is not
            the header's.
    """
    timestamp = headers["Corral-Webhook-Timestamp"]
    signed = timestamp.encode() + b"." + body
    expected = "v1=" + hmac.new(secret.encode(), signed, hashlib.sha256).hexdigest()
    if not hmac.compare_digest(expected, headers["Corral-Webhook-Signature"]):
        raise InvalidWebhookError("bad signature")
    if abs(time.time() - int(timestamp)) > TOLERANCE_S:
        raise InvalidWebhookError("timestamp outside the replay window")
    event: dict[str, Any] = json.loads(body)
    if event["id"] != headers["Corral-Webhook-Id"]:
        raise InvalidWebhookError("the body's id is not the header's")
    return event


class Receiver:
    """A loopback HTTP (or, with ``tls``, HTTPS) server that answers the statuses it is
    given (then 200), recording each request's headers and body. It can be stopped and
    started again on the same port (a receiver that is down for a while)."""

    def __init__(self, *, tls: ssl.SSLContext | None = None, port: int = 0) -> None:
        self.statuses: list[int] = []
        self.received: list[tuple[dict[str, str], bytes]] = []
        self._lock = threading.Lock()
        self._tls = tls
        self._server = self._serve(port)
        self.port = self._server.server_address[1]
        scheme = "https" if tls is not None else "http"
        self.url = f"{scheme}://127.0.0.1:{self.port}/hooks"

    def _serve(self, port: int) -> ThreadingHTTPServer:
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["Content-Length"]))
                with receiver._lock:
                    receiver.received.append((dict(self.headers), body))
                    status = receiver.statuses.pop(0) if receiver.statuses else 200
                self.send_response(status)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
        if self._tls is not None:
            server.socket = self._tls.wrap_socket(server.socket, server_side=True)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        return server

    def stop(self) -> None:
        """Stop answering: connections to its port are refused until :meth:`start`."""
        self._server.shutdown()
        self._server.server_close()

    def start(self) -> None:
        """Answer again, on the same port."""
        self._server = self._serve(self.port)

    def deliveries(self) -> list[tuple[dict[str, str], bytes]]:
        with self._lock:
            return list(self.received)

    def verified(self, secret: str) -> list[dict[str, Any]]:
        """The events received, each checked (:func:`verify`), duplicates included."""
        return [verify(secret, headers, body) for headers, body in self.deliveries()]
