"""One HTTP/1.1 request and its answer over a connected socket, with the standard library.

The runner's calls are few, small and one per connection (``Connection: close``), so this
is all of HTTP they need. ``http.client`` would do the same, but it loads the ``email``
package and ``ssl`` on import: about a fifth of the CPU a runner spends on a short item.
"""

from __future__ import annotations

import socket

from .records import record

TYPE_CHECKING = False  # not typing's: see corral.runner.records
if TYPE_CHECKING:
    from typing import BinaryIO

MAX_LINE_BYTES = 65_536  # a status or header line; http.client's limit too
MAX_HEADERS = 100
_CHUNK = 64 * 1024


class MalformedResponseError(Exception):
    """The answer is not an HTTP/1.x response this client can read."""


@record
class Response:
    """A status, the headers (names in lower case) and the whole body."""

    status: int
    headers: dict[str, str]
    body: bytes

    def header(self, name: str) -> str | None:
        """The value of header ``name`` (any case), or None."""
        return self.headers.get(name.lower())


def exchange(
    sock: socket.socket,
    method: str,
    target: str,
    headers: dict[str, str],
    body: bytes | BinaryIO,
) -> Response:
    """Send the request (``headers`` must name the Host and the Content-Length) and read
    the answer to its end; the connection is not reused.

    Raises:
        OSError: the socket failed or timed out.
        MalformedResponseError: the answer is not HTTP/1.x.
    """
    head = f"{method} {target} HTTP/1.1\r\n"
    head += "".join(f"{name}: {value}\r\n" for name, value in headers.items())
    sock.sendall((head + "Connection: close\r\n\r\n").encode("latin-1"))
    if isinstance(body, bytes):
        sock.sendall(body)
    else:
        while chunk := body.read(_CHUNK):
            sock.sendall(chunk)
    with sock.makefile("rb") as stream:
        while True:
            status, answer_headers = _read_head(stream)
            if status >= 200:  # 1xx answers are interim (none is asked for): skipped
                return Response(status, answer_headers, _read_body(stream, answer_headers))


def _read_head(stream: BinaryIO) -> tuple[int, dict[str, str]]:
    parts = _line(stream).split(None, 2)
    if len(parts) < 2 or not parts[0].startswith(b"HTTP/1.") or not parts[1].isdigit():
        raise MalformedResponseError(f"not an HTTP status line: {parts[:2]!r}")
    headers: dict[str, str] = {}
    while line := _line(stream):
        if len(headers) >= MAX_HEADERS:
            raise MalformedResponseError(f"more than {MAX_HEADERS} headers")
        name, colon, value = line.decode("latin-1").partition(":")
        if not colon:
            raise MalformedResponseError(f"not a header line: {line[:80]!r}")
        headers[name.strip().lower()] = value.strip()
    return int(parts[1]), headers


def _read_body(stream: BinaryIO, headers: dict[str, str]) -> bytes:
    if "chunked" in headers.get("transfer-encoding", "").lower():
        return _read_chunked(stream)
    length = headers.get("content-length")
    if length is None:
        return stream.read()  # to the end: the server closes the connection
    if not length.isdigit():
        raise MalformedResponseError(f"invalid Content-Length {length!r}")
    return _read_exactly(stream, int(length))


def _read_chunked(stream: BinaryIO) -> bytes:
    body = bytearray()
    while True:
        size_field = _line(stream).split(b";", 1)[0].strip()
        try:
            size = int(size_field, 16)
        except ValueError:
            raise MalformedResponseError(f"invalid chunk size {size_field[:20]!r}") from None
        if size == 0:
            while _line(stream):  # trailers, up to the blank line
                pass
            return bytes(body)
        body += _read_exactly(stream, size)
        _line(stream)  # the chunk's CRLF


def _read_exactly(stream: BinaryIO, size: int) -> bytes:
    data = stream.read(size)
    if len(data) < size:
        raise MalformedResponseError(f"the answer ended after {len(data)} of {size} bytes")
    return data


def _line(stream: BinaryIO) -> bytes:
    """One line without its CRLF."""
    line = stream.readline(MAX_LINE_BYTES + 1)
    if len(line) > MAX_LINE_BYTES:
        raise MalformedResponseError("a line of the answer is too long")
    if not line.endswith(b"\n"):
        raise MalformedResponseError("the answer ended before its head did")
    return line.rstrip(b"\r\n")
