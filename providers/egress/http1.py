"""HTTP/1.1 as corral's egress proxy reads it: request and response heads within bounds,
bodies by their framing, and the exchanges of one connection whose TLS the proxy
terminated (a secret binding's host). Standard library only: the proxy (:mod:`.proxy`),
run as ``python -I -S``, imports this module from beside it.

Every read has a bound: a head must arrive whole within ``HEADER_TIMEOUT_S`` of its first
byte and be at most ``MAX_HEAD`` bytes; a request body is at most ``MAX_REQUEST_BODY``; no
read waits longer than the connection's idle time. A body is framed by ``Content-Length``
or ``chunked`` alone (both, another transfer coding, or conflicting lengths: ``400``), and
passed on re-framed: chunk sizes as the proxy writes them, extensions and trailers
dropped. What the client sends cannot start a second request the destination would see.
"""

from __future__ import annotations

import contextlib
import re
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass

MAX_HEAD = 65_536
HEADER_TIMEOUT_S = 15.0
MAX_REQUEST_BODY = 100 * 1024 * 1024
MAX_REQUESTS = 1000  # on one connection; the last one's answer closes it
MAX_CHUNK_LINE = 4096  # a chunk's size line, its extensions included
MAX_TRAILERS = 16_384  # the trailer lines of a chunked body, dropped
MAX_INTERIM = 8  # 1xx answers before the final one
CHUNKED = -1  # a body framing: chunked
UNTIL_CLOSE = -2  # a body framing: until the sender closes (responses only)
_HEAD_END = b"\r\n\r\n"
# A head may hold CRLF line ends and tabs; any other control character, a CR without its LF
# or an LF without its CR, is refused.
_UNSAFE_HEAD = re.compile(rb"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f]|\r(?!\n)|(?<!\r)\n")
TOKEN = re.compile(r"^[!#$%&'*+.^_`|~0-9A-Za-z-]+$")
_HEX = re.compile(rb"^[0-9A-Fa-f]{1,15}$")
_DIGITS = re.compile(r"^[0-9]{1,18}$")
_STATUS = re.compile(r"^HTTP/1\.[01] [1-5][0-9][0-9]( .*)?$")
# Never passed on by the proxy inside an intercepted connection: hop-by-hop headers, and the
# framing the proxy writes itself.
HOP_BY_HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-connection",
        "proxy-authorization",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
    }
)
WORDS = {
    200: "OK",
    400: "Bad Request",
    403: "Forbidden",
    408: "Request Timeout",
    413: "Content Too Large",
    417: "Expectation Failed",
    431: "Request Header Fields Too Large",
    501: "Not Implemented",
    502: "Bad Gateway",
    503: "Service Unavailable",
    505: "HTTP Version Not Supported",
}


class RefusedError(Exception):
    """The request is not let through; ``status`` and the reason go back to the client."""

    def __init__(self, status: int, reason: str) -> None:
        super().__init__(reason)
        self.status = status


def answer(client: socket.socket, status: int, reason: str) -> None:
    """A short plain-text answer that closes the connection; a client that reads nothing
    holds the sending thread one second at most."""
    body = f"corral egress proxy: {reason}\n".encode()
    head = (
        f"HTTP/1.1 {status} {WORDS.get(status, 'Error')}\r\nContent-Type: text/plain\r\n"
        f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    )
    with contextlib.suppress(OSError, ValueError):
        client.settimeout(1.0)
        client.sendall(head.encode() + body)


@dataclass
class Head:
    """A message's first line, in its words, and its headers in order."""

    words: list[str]
    headers: list[tuple[str, str]]

    def values(self, name: str) -> list[str]:
        """The values of every ``name`` header, stripped, in order."""
        return [value.strip() for key, value in self.headers if key.strip().lower() == name]

    def tokens(self, name: str) -> list[str]:
        """The comma-separated tokens of every ``name`` header, lower case."""
        return [
            token.strip().lower()
            for value in self.values(name)
            for token in value.split(",")
            if token.strip()
        ]


def parse_head(raw: bytes, *, response: bool = False) -> Head:
    """The head of a request (``METHOD TARGET VERSION``) or a response (``VERSION STATUS
    REASON``).

    Raises:
        RefusedError: 400, a control character or bare CR or LF, a first line of another
            shape, or a header name that is not a token.
    """
    if _UNSAFE_HEAD.search(raw):
        # A bare CR or LF would start a line of the sender's own past the checks.
        raise RefusedError(400, "control characters or a bare CR or LF in the head")
    lines = raw.decode("latin-1").split("\r\n")
    if response:
        if not _STATUS.match(lines[0]):
            raise RefusedError(400, "not an HTTP/1 status line")
        words = lines[0].split(" ", 2)
    else:
        words = lines[0].split(" ")
        if len(words) != 3 or not words[2].startswith("HTTP/") or not TOKEN.match(words[0]):
            raise RefusedError(400, "not an HTTP request")
    headers = [(key, value) for key, _, value in (line.partition(":") for line in lines[1:])]
    if not all(TOKEN.match(name) for name, _ in headers):
        raise RefusedError(400, "a header's name is not an HTTP token")
    return Head(words, headers)


def request_framing(head: Head) -> int:
    """The length of a request's body, or CHUNKED.

    Raises:
        RefusedError: 400 for both framings, a bad or conflicting length; 501 for a
            transfer coding other than chunked alone; 413 past MAX_REQUEST_BODY.
    """
    lengths = {part.strip() for value in head.values("content-length") for part in value.split(",")}
    if head.values("transfer-encoding"):
        if lengths:
            raise RefusedError(400, "both Content-Length and Transfer-Encoding")
        if head.tokens("transfer-encoding") != ["chunked"]:
            raise RefusedError(501, "a request body is framed by chunked alone")
        return CHUNKED
    if not lengths:
        return 0
    if len(lengths) != 1 or not _DIGITS.match(next(iter(lengths))):
        raise RefusedError(400, "a bad Content-Length")
    length = int(next(iter(lengths)))
    if length > MAX_REQUEST_BODY:
        raise RefusedError(413, f"a request body is at most {MAX_REQUEST_BODY} bytes")
    return length


def response_framing(method: str, status: int, head: Head) -> int:
    """The length of a response's body, CHUNKED or UNTIL_CLOSE.

    Raises:
        RefusedError: 502, a bad or conflicting length.
    """
    if method == "HEAD" or status in (204, 304) or status < 200:
        return 0
    codings = head.tokens("transfer-encoding")
    if codings:
        return CHUNKED if codings[-1] == "chunked" else UNTIL_CLOSE
    lengths = {part.strip() for value in head.values("content-length") for part in value.split(",")}
    if not lengths:
        return UNTIL_CLOSE
    if len(lengths) != 1 or not _DIGITS.match(next(iter(lengths))):
        raise RefusedError(502, "the destination's answer has a bad Content-Length")
    return int(next(iter(lengths)))


class Stream:
    """One end of a connection, read through a buffer: each wait for bytes at most the
    idle time, a head within HEADER_TIMEOUT_S of its first byte."""

    def __init__(self, sock: socket.socket, idle_s: float) -> None:
        self.sock = sock
        self.idle_s = idle_s
        self._buffer = b""

    def take(self) -> bytes:
        """What was read past the last head (and is not read from here any more)."""
        data, self._buffer = self._buffer, b""
        return data

    def _fill(self, deadline: float | None = None) -> bool:
        """Read more into the buffer; False at the end of the stream.

        Raises:
            TimeoutError: nothing came within the idle time (or by ``deadline``).
        """
        wait = self.idle_s if deadline is None else min(self.idle_s, deadline - time.monotonic())
        if wait <= 0:
            raise TimeoutError("the peer is too slow")
        self.sock.settimeout(wait)
        chunk = self.sock.recv(65_536)
        self._buffer += chunk
        return bool(chunk)

    def head(self, *, wait_s: float, too_large: int = 431) -> bytes | None:
        """The next head, without its blank line; None when the peer closed (or sent
        nothing within ``wait_s``) before its first byte.

        Raises:
            RefusedError: 408 when it is not whole within HEADER_TIMEOUT_S of its first
                byte, 400 when the stream ends inside it, ``too_large`` past MAX_HEAD.
        """
        if not self._buffer:
            try:
                self.sock.settimeout(wait_s)
                self._buffer = self.sock.recv(65_536)
            except TimeoutError:
                return None
            if not self._buffer:
                return None
        deadline = time.monotonic() + HEADER_TIMEOUT_S
        while _HEAD_END not in self._buffer[: MAX_HEAD + len(_HEAD_END)]:
            if len(self._buffer) > MAX_HEAD:
                raise RefusedError(too_large, "headers too large")
            try:
                if not self._fill(deadline):
                    raise RefusedError(400, "the stream ended inside a head")
            except TimeoutError as exc:
                raise RefusedError(408, "the headers took too long") from exc
        head, self._buffer = self._buffer.split(_HEAD_END, 1)
        return head

    def line(self, limit: int) -> bytes:
        """The next line, without its CRLF.

        Raises:
            RefusedError: 400, longer than ``limit`` or cut off.
            TimeoutError: nothing came within the idle time.
        """
        while b"\r\n" not in self._buffer[: limit + 2]:
            if len(self._buffer) > limit or not self._fill():
                raise RefusedError(400, "a bad chunked body")
        line, self._buffer = self._buffer.split(b"\r\n", 1)
        return line

    def copy(self, size: int, target: socket.socket) -> None:
        """Pass the next ``size`` bytes to ``target``.

        Raises:
            RefusedError: 400, the stream ended first.
            TimeoutError: nothing came within the idle time.
        """
        while size > 0:
            if not self._buffer and not self._fill():
                raise RefusedError(400, "the body ended early")
            part, self._buffer = self._buffer[:size], self._buffer[size:]
            target.sendall(part)
            size -= len(part)

    def copy_to_end(self, target: socket.socket) -> None:
        """Pass everything up to the end of the stream to ``target``."""
        while self._buffer or self._fill():
            target.sendall(self._buffer)
            self._buffer = b""

    def expect(self, data: bytes) -> None:
        """Read ``data`` next.

        Raises:
            RefusedError: 400, something else came.
        """
        while len(self._buffer) < len(data):
            if not self._fill():
                break
        if not self._buffer.startswith(data):
            raise RefusedError(400, "a bad chunked body")
        self._buffer = self._buffer[len(data) :]


def copy_body(source: Stream, target: socket.socket, framing: int, limit: int | None) -> None:
    """Pass one body of ``framing`` from ``source`` to ``target``, chunked re-framed.

    Raises:
        RefusedError: 400 for a bad chunked body, 413 for one past ``limit``.
        TimeoutError, OSError: a side was too slow or went away.
    """
    if framing == UNTIL_CLOSE:
        source.copy_to_end(target)
        return
    if framing != CHUNKED:
        source.copy(framing, target)
        return
    total = 0
    while True:
        size_text = source.line(MAX_CHUNK_LINE).split(b";", 1)[0].strip(b" \t")
        if not _HEX.match(size_text):
            raise RefusedError(400, "a bad chunk size")
        size = int(size_text, 16)
        if size == 0:
            break
        total += size
        if limit is not None and total > limit:
            raise RefusedError(413, f"a request body is at most {limit} bytes")
        target.sendall(b"%x\r\n" % size)
        source.copy(size, target)
        source.expect(b"\r\n")
        target.sendall(b"\r\n")
    trailers = 0
    while line := source.line(MAX_CHUNK_LINE):  # trailers: read, bounded and dropped
        trailers += len(line) + 2
        if trailers > MAX_TRAILERS:
            raise RefusedError(400, "too many trailers")
    target.sendall(b"0\r\n\r\n")


def serialize(head: Head, *, close: bool = False, framing: int | None = None) -> bytes:
    """An answer's ``head`` as passed back: its first line and its headers but the hop-by-hop
    ones, framed by ``framing`` as the proxy relays its body (None: an answer without a
    body keeps its own Content-Length), with ``Connection: close`` when ``close``."""
    dropped = set(HOP_BY_HOP)
    if framing == UNTIL_CLOSE:
        dropped.discard("transfer-encoding")  # a coding the proxy does not undo
    elif framing is not None:
        dropped.add("content-length")
    lines = [" ".join(head.words)]
    lines += [f"{k}:{v}" for k, v in head.headers if k.strip().lower() not in dropped]
    if framing == CHUNKED:
        # Re-chunked as it passes; the codings under the chunks (gzip, say) stay said.
        lines.append(f"Transfer-Encoding: {', '.join(head.tokens('transfer-encoding'))}")
    else:
        lines += framing_line(framing)
    if close:
        lines.append("Connection: close")
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")


def framing_line(framing: int | None) -> tuple[str, ...]:
    """The header that frames a body as the proxy sends it on."""
    if framing == CHUNKED:
        return ("Transfer-Encoding: chunked",)
    if framing is None or framing == UNTIL_CLOSE:
        return ()
    return (f"Content-Length: {framing}",)


# What the proxy makes of one request inside an intercepted connection: the head to send
# on (its Host, bindings and framing), or RefusedError.
Rewrite = Callable[[Head, int], bytes]


def converse(client: Stream, upstream: Stream, rewrite: Rewrite) -> None:
    """Relay request after request from ``client`` to ``upstream`` and their answers back,
    until either side closes or asks to, a limit is reached, or a request is refused (its
    answer sent, then the connection closed). The caller closes both sockets."""
    for number in range(1, MAX_REQUESTS + 1):
        wait_s = HEADER_TIMEOUT_S if number == 1 else client.idle_s
        try:
            raw = client.head(wait_s=wait_s)
            if raw is None:
                return
            keep = _exchange(
                client, upstream, parse_head(raw), rewrite, last=number == MAX_REQUESTS
            )
        except RefusedError as refusal:
            answer(client.sock, refusal.status, str(refusal))
            return
        if not keep:
            return


def _exchange(
    client: Stream, upstream: Stream, head: Head, rewrite: Rewrite, *, last: bool
) -> bool:
    """One request and its answer; whether the connection may carry another.

    Raises:
        RefusedError: the request is refused (nothing of it was sent on), its body is bad,
            or the destination's answer cannot be read (nothing of it was passed back).
    """
    method, _, version = head.words
    if version not in ("HTTP/1.1", "HTTP/1.0"):
        raise RefusedError(505, "HTTP/1.1 or HTTP/1.0 only")
    framing = request_framing(head)
    expects = head.tokens("expect")
    if expects and expects != ["100-continue"]:
        raise RefusedError(417, "only Expect: 100-continue is understood")
    sent = rewrite(head, framing)
    if expects and framing:
        client.sock.sendall(b"HTTP/1.1 100 Continue\r\n\r\n")
    upstream.sock.sendall(sent)
    copy_body(client, upstream.sock, framing, MAX_REQUEST_BODY)
    wanted_close = last or version == "HTTP/1.0" or "close" in head.tokens("connection")
    return _relay_answer(upstream, client.sock, method, close=wanted_close)


def _relay_answer(upstream: Stream, client: socket.socket, method: str, *, close: bool) -> bool:
    """Pass the destination's answer (its interim 1xx answers first) to ``client``;
    whether the connection may carry another request.

    Raises:
        RefusedError: 502, the answer's head is missing or bad (nothing was passed back).
    """
    for _ in range(MAX_INTERIM + 1):
        raw = upstream.head(wait_s=upstream.idle_s, too_large=502)
        if raw is None:
            raise RefusedError(502, "the destination closed without an answer")
        try:
            head = parse_head(raw, response=True)
        except RefusedError as exc:
            raise RefusedError(502, "the destination's answer is not HTTP/1") from exc
        status = int(head.words[1])
        if status == 101:
            raise RefusedError(502, "the destination switched protocols unasked")
        if status < 200:
            client.sendall(serialize(head))
            continue
        framing = response_framing(method, status, head)
        closing = (
            close
            or framing == UNTIL_CLOSE
            or head.words[0] == "HTTP/1.0"
            or "close" in head.tokens("connection")
        )
        bodiless = method == "HEAD" or status in (204, 304)
        client.sendall(serialize(head, close=closing, framing=None if bodiless else framing))
        try:
            copy_body(upstream, client, framing, None)
        except RefusedError as exc:  # part of the answer is passed back: only closing is left
            raise ConnectionAbortedError(str(exc)) from exc
        return not closing
    raise RefusedError(502, "too many interim answers")
