"""The request ``corral dispatch`` makes before its item exists: ``POST /v1/dispatch`` over
plain http or the api's Unix socket, with the standard library alone.

It is written apart from :mod:`corral.client` (httpx and the api's answer models) because
this request decides how soon the work starts: the command reaches it in about half the
time without them. It keeps the client's promise: sent again with the same
``Idempotency-Key`` after no answer or a 503, so a retry finds the item the first send made
rather than making a second. An ``https://`` api goes through :mod:`corral.client` (its
trust store).
"""

from __future__ import annotations

import http.client
import json
import socket
import time
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

PATH = "/v1/dispatch"
PAUSES_S = (0.5, 1.0)  # before the second and the third send
TIMEOUT_S = 30.0


class NoAnswerError(ConnectionError):
    """the api did not answer"""

    def __init__(self, message: str, *, reached: bool) -> None:
        super().__init__(message)
        self.reached = reached  # a send got through: the api may have stored it


@dataclass(frozen=True)
class Answer:
    """The api's answer: its status and its JSON (None when the body is not JSON)."""

    status: int
    body: Any


class _UnixConnection(http.client.HTTPConnection):
    """An HTTP connection over the api's Unix socket."""

    def __init__(self, path: str, timeout: float) -> None:
        super().__init__("corral", timeout=timeout)  # the api reads no Host
        self.socket_path = path

    def connect(self) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(self.timeout)
        self.sock.connect(self.socket_path)


def _connection(url: str, timeout_s: float) -> tuple[http.client.HTTPConnection, str]:
    """A connection to the api at ``url`` (``http://`` or ``unix://``) and the request path."""
    parts = urlsplit(url)
    if parts.scheme == "unix":
        return _UnixConnection(parts.path, timeout_s), PATH
    if parts.scheme != "http" or not parts.hostname:
        raise ValueError(f"{url}: not an http:// or unix:// URL")
    connection = http.client.HTTPConnection(parts.hostname, parts.port, timeout=timeout_s)
    return connection, parts.path.rstrip("/") + PATH


def post_dispatch(
    url: str, token: str, message: dict[str, Any], key: str, *, timeout_s: float = TIMEOUT_S
) -> Answer:
    """Send ``message`` with ``key``; the api's answer (any status but a last 503's retry).

    Raises:
        NoAnswerError: no answer after the last send.
        ValueError: ``url`` is neither ``http://`` nor ``unix://``.
    """
    body = json.dumps(message).encode()
    headers = {
        "Authorization": f"Bearer {token}",
        "Content-Type": "application/json",
        "Idempotency-Key": key,
    }
    why, reached = "no answer", False
    for sent, pause in enumerate((0.0, *PAUSES_S), start=1):
        time.sleep(pause)
        connection, path = _connection(url, timeout_s)
        try:
            connection.connect()
        except OSError as exc:  # nothing was sent
            why = f"{type(exc).__name__}: {exc}"
            connection.close()
            continue
        try:
            connection.request("POST", path, body, headers)
            response = connection.getresponse()
            data = response.read()
        except (OSError, http.client.HTTPException) as exc:
            why, reached = f"{type(exc).__name__}: {exc}", True
            continue
        finally:
            connection.close()
        if response.status == 503 and sent <= len(PAUSES_S):
            why = "503 Service Unavailable"
            continue
        try:
            return Answer(response.status, json.loads(data))
        except ValueError:
            return Answer(response.status, None)
    raise NoAnswerError(f"POST {PATH}: {why}", reached=reached)


def refusal(answer: Answer) -> str:
    """What the api said when it refused a dispatch: each field and why, else its detail."""
    body = answer.body if isinstance(answer.body, dict) else {}
    detail = body.get("detail")
    if isinstance(detail, list):
        fields = "; ".join(
            f"{entry.get('field', '')}: {entry.get('message', '')}"
            for entry in detail
            if isinstance(entry, dict)
        )
        return f"invalid dispatch: {fields}" if answer.status == 422 else fields
    code = body.get("error") or f"HTTP {answer.status}"
    return f"{code}: {detail}" if detail else str(code)
