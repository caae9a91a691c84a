"""A Daytona session command's logs, followed over the toolbox's WebSocket into bounded
stdout and stderr, until the command ends or a deadline passes.

The SDK's own follow (``get_session_command_logs_async``) cannot be given up: it waits for
each message without a timeout in a thread that closing the socket does not wake, so a
command that leaves its output open (a daemon it started) would hold the caller for as long
as the sandbox lives. This reader asks the same URL with the same headers (the SDK's request
builder, its HTTP client) and waits with a deadline; past it, the socket is closed.

The daemon marks each piece of output with the stream it came from (``STDOUT_PREFIX``,
``STDERR_PREFIX``, three bytes each), a marker possibly split across messages.
"""

from __future__ import annotations

import queue
import re
import time
from typing import Any

import httpx
import httpx_ws
import wsproto.events
from daytona.common.process import STDERR_PREFIX, STDOUT_PREFIX

from corral.providers.errors import ProviderUnavailableError
from corral.providers.size_limits import ExecOutput, OutputBuffer

# Messages the WebSocket client queues ahead of this reader; past them it stops reading the
# socket, so the daemon waits (TCP's own flow control).
QUEUED_MESSAGES = 16


def follow_command_logs(
    process: Any, session: str, command_id: str, output: ExecOutput, deadline: float | None
) -> bool:
    """Follow the command's logs into ``output`` until the daemon closes them (the command
    ended): True; or until ``deadline`` (monotonic) passes: False, the stream given up.

    Raises:
        ProviderUnavailableError: the stream could not be opened, or broke.
    """
    _, url, headers, *_ = process._api_client._get_session_command_logs_serialize(
        session_id=session,
        command_id=command_id,
        follow=True,
        _request_auth=None,
        _content_type=None,
        _headers=None,
        _host_index=None,
    )
    demux = Demux(output)
    ws: httpx_ws.WebSocketSession
    try:
        with httpx_ws.connect_ws(
            re.sub(r"^http", "ws", url),
            process._http_client,
            headers=headers,
            queue_size=QUEUED_MESSAGES,
        ) as ws:
            ended = _read(ws, demux, deadline)
    except (httpx_ws.HTTPXWSException, httpx.HTTPError) as exc:
        raise ProviderUnavailableError(
            f"the command's logs could not be followed: {type(exc).__name__} {exc}"
        ) from exc
    demux.finish()
    return ended


def _read(ws: httpx_ws.WebSocketSession, demux: Demux, deadline: float | None) -> bool:
    while True:
        remaining = None if deadline is None else deadline - time.monotonic()
        if remaining is not None and remaining <= 0:
            return False
        try:
            event = ws.receive(timeout=remaining)
        except queue.Empty:
            return False
        except httpx_ws.WebSocketDisconnect as closed:
            if closed.code in (None, 1000):
                return True
            raise
        if isinstance(event, wsproto.events.BytesMessage):
            demux.feed(bytes(event.data))
        elif isinstance(event, wsproto.events.TextMessage):
            demux.feed(event.data.encode())


_MARKERS = (STDOUT_PREFIX, STDERR_PREFIX)


class Demux:
    """The daemon's marked log, split into ``output``'s stdout and stderr as it comes.
    Bytes before the first marker belong to no stream and are dropped, as the SDK does."""

    def __init__(self, output: ExecOutput) -> None:
        self._streams = {STDOUT_PREFIX: output.stdout, STDERR_PREFIX: output.stderr}
        self._current: OutputBuffer | None = None
        self._held = b""  # the start of a marker the next message may complete

    def feed(self, data: bytes) -> None:
        data = self._held + data
        start = 0
        while True:
            found = [(at, m) for m in _MARKERS if (at := data.find(m, start)) >= 0]
            if not found:
                break
            at, marker = min(found)
            self._emit(data[start:at])
            self._current = self._streams[marker]
            start = at + len(marker)
        rest = data[start:]
        held = _marker_start(rest)
        self._held = rest[len(rest) - held :] if held else b""
        self._emit(rest[: len(rest) - held])

    def finish(self) -> None:
        """The stream ended: what was held back was output after all."""
        self._emit(self._held)
        self._held = b""

    def _emit(self, data: bytes) -> None:
        if data and self._current is not None:
            self._current.add(data)


def _marker_start(data: bytes) -> int:
    """How many bytes at the end of ``data`` could begin a marker (0, 1 or 2)."""
    for length in (2, 1):
        tail = data[-length:]
        if len(data) >= length and any(m.startswith(tail) for m in _MARKERS):
            return length
    return 0
