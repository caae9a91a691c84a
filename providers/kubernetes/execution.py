"""A pod exec's WebSocket read frame by frame, stdout and stderr bounded as they come.

The client's ``WSClient`` keeps every frame it reads: each channel's data until it is read,
and a copy of all stdout and stderr besides (``capture_all``, which ``stream()`` always
asks for); and while frames keep arriving, one ``update()`` keeps reading. A command that
prints without end would fill this process. Here each frame goes to its channel's bounded
buffer at once; the status (channel 3) is small, and bounded too.
"""

from __future__ import annotations

import select
import ssl
import time
from typing import Any

from kubernetes.stream.ws_client import ERROR_CHANNEL, STDERR_CHANNEL, STDOUT_CHANNEL
from websocket import ABNF, WebSocketConnectionClosedException

from corral.providers.size_limits import ExecOutput, OutputBuffer

STATUS_MAX_BYTES = 64 * 1024  # a Status object: a few hundred bytes


def read_exec(ws: Any, output: ExecOutput, deadline: float | None) -> str | None:
    """Read the exec stream into ``output`` until the API server closes it, and answer the
    command's status (the error channel's text); None when ``deadline`` passed first."""
    status = OutputBuffer(STATUS_MAX_BYTES)
    channels = {STDOUT_CHANNEL: output.stdout, STDERR_CHANNEL: output.stderr, ERROR_CHANNEL: status}
    connection = ws.sock
    while connection.connected:
        remaining = None if deadline is None else deadline - time.monotonic()
        if remaining is not None and remaining <= 0:
            return None
        if not _readable(connection.sock, remaining):
            continue
        try:
            opcode, frame = connection.recv_data_frame(True)
        except WebSocketConnectionClosedException:
            break
        if opcode == ABNF.OPCODE_CLOSE:
            break
        if opcode in (ABNF.OPCODE_BINARY, ABNF.OPCODE_TEXT) and frame.data:
            data = frame.data if isinstance(frame.data, bytes) else frame.data.encode()
            buffer = channels.get(data[0])  # v5's close-channel frames (255) go nowhere
            if buffer is not None:
                buffer.add(data[1:])
    return status.text()[0]


def _readable(sock: Any, timeout: float | None) -> bool:
    """Whether a frame can be read now, waiting up to ``timeout`` seconds (None: for ever).
    A TLS socket may hold decrypted bytes that the socket itself no longer shows."""
    if isinstance(sock, ssl.SSLSocket) and sock.pending():
        return True
    poll = select.poll()
    poll.register(sock, select.POLLIN)
    return bool(poll.poll(None if timeout is None else timeout * 1000))
