"""The HTTP plumbing the HTTP stand-ins share: a socket bound before the server starts, the
request body read (and handed on to the app), JSON answers, and pauses cut short on stop."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from collections.abc import Mapping
from typing import Any


def listen(host: str) -> socket.socket:
    """A bound socket on a free port, so the port is known before uvicorn starts."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind((host, 0))
    return sock


async def read_body(receive: Any) -> bytes:
    chunks: list[bytes] = []
    while True:
        message = await receive()
        if message["type"] != "http.request":
            break
        chunks.append(message.get("body", b""))
        if not message.get("more_body", False):
            break
    return b"".join(chunks)


def replay(body: bytes, receive: Any) -> Any:
    """Hand the already-read body to the app, then fall through to the real channel."""
    sent = False

    async def replayed() -> dict[str, Any]:
        nonlocal sent
        if sent:
            return dict(await receive())
        sent = True
        return {"type": "http.request", "body": body, "more_body": False}

    return replayed


async def send_json(
    send: Any, status: int, body: Any, headers: Mapping[str, str] | None = None
) -> None:
    payload = json.dumps(body).encode()
    raw = [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(payload))]
    raw += [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()]
    await send({"type": "http.response.start", "status": status, "headers": raw})
    await send({"type": "http.response.body", "body": payload})


async def pause_for(seconds: float, stopping: threading.Event) -> None:
    """Sleep ``seconds`` on the event loop, cut short when the stand-in stops."""
    deadline = time.monotonic() + seconds
    while not stopping.is_set() and time.monotonic() < deadline:
        await asyncio.sleep(min(0.05, max(0.0, deadline - time.monotonic())))
