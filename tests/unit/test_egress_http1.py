"""The HTTP/1.1 corral's egress proxy reads inside a TLS connection it terminates, given
hostile input: every bad head or body is answered and the connection closed, within its
bounds, and the destination never sees a request the proxy did not frame itself."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from corral.providers.egress import http1
from corral.providers.egress.http1 import Head, Stream, converse, request_framing


def _rewrite(head: Head, framing: int) -> bytes:
    """As the proxy does, less the bindings: origin form, its own framing."""
    lines = [" ".join(head.words)]
    lines += [
        f"{name}:{value}"
        for name, value in head.headers
        if name.lower() not in http1.HOP_BY_HOP | {"content-length", "expect"}
    ]
    lines += http1.framing_line(framing) if framing else ()
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")


@dataclass
class Conversation:
    client: socket.socket  # the sandbox's end
    upstream: socket.socket  # the destination's end
    thread: threading.Thread

    def received(self, limit_s: float = 10.0) -> bytes:
        """Everything the client gets until the proxy closes its end."""
        self.client.settimeout(limit_s)
        data = b""
        with contextlib.suppress(TimeoutError):
            while chunk := self.client.recv(65_536):
                data += chunk
        return data

    def sent_on(self) -> bytes:
        """What reached the destination before the proxy closed its end."""
        self.thread.join(timeout=10)
        assert not self.thread.is_alive(), "the conversation did not end"
        self.upstream.settimeout(1)
        data = b""
        with contextlib.suppress(TimeoutError, OSError):
            while chunk := self.upstream.recv(65_536):
                data += chunk
        return data


@contextlib.contextmanager
def conversation(idle_s: float = 5.0) -> Iterator[Conversation]:
    client, proxy_side = socket.socketpair()
    proxy_upstream, upstream = socket.socketpair()

    def run() -> None:
        with proxy_side, proxy_upstream, contextlib.suppress(OSError):
            converse(Stream(proxy_side, idle_s), Stream(proxy_upstream, idle_s), _rewrite)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    try:
        yield Conversation(client, upstream, thread)
    finally:
        client.close()
        upstream.close()
        thread.join(timeout=10)


def _status(answer: bytes) -> int:
    return int(answer.split(b" ", 2)[1])


@pytest.mark.parametrize(
    ("request_bytes", "status"),
    [
        (b"GET / HTTP/1.1\r\nX-Big: " + b"a" * 70_000 + b"\r\n\r\n", 431),
        (b"GET / HTTP/1.1\r\nX: 1\nHost: smuggled\r\n\r\n", 400),  # a bare LF
        (b"GET / HTTP/1.1\r\nBad Name: 1\r\n\r\n", 400),
        (b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n", 505),  # HTTP/2's preface
        (b"POST / HTTP/1.1\r\nContent-Length: 3\r\nTransfer-Encoding: chunked\r\n\r\n", 400),
        (b"POST / HTTP/1.1\r\nContent-Length: 3\r\nContent-Length: 4\r\n\r\nabcd", 400),
        (b"POST / HTTP/1.1\r\nContent-Length: -3\r\n\r\n", 400),
        (b"POST / HTTP/1.1\r\nContent-Length: 99999999999999999999\r\n\r\n", 400),
        (b"POST / HTTP/1.1\r\nTransfer-Encoding: gzip, chunked\r\n\r\n", 501),
        (b"POST / HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n", 400),
        (b"POST / HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n-1\r\n", 400),
        (b"POST / HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n0x10\r\n", 400),
        (b"POST / HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\nfffffffffffffffff\r\n", 400),
        (b"POST / HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n" + b"1" * 5000, 400),
        (b"POST / HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabcXY", 400),
        (b"POST / HTTP/1.1\r\nExpect: something-else\r\nContent-Length: 1\r\n\r\nx", 417),
    ],
)
def test_a_bad_request_is_answered_and_its_connection_closed(
    request_bytes: bytes, status: int
) -> None:
    with conversation() as talk:
        talk.client.sendall(request_bytes)
        answer = talk.received()
        talk.client.shutdown(socket.SHUT_WR)
        forwarded = talk.sent_on()
    assert _status(answer) == status, answer[:200]
    assert answer.endswith(b"\n") and b"Connection: close" in answer
    # Nothing past a bad head reaches the destination; a bad body reaches it cut short, never
    # as a second request.
    assert forwarded.count(b"HTTP/1.1\r\n") <= 1


def test_a_head_sent_a_byte_at_a_time_is_cut_off_at_the_header_time(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(http1, "HEADER_TIMEOUT_S", 0.5)
    started = time.monotonic()
    with conversation() as talk:
        with contextlib.suppress(OSError):
            for byte in b"GET / HTTP/1.1\r\nX-Slow: " + b"a" * 200:
                talk.client.send(bytes([byte]))
                time.sleep(0.05)  # the attack: a trickle, each byte inside the idle time
                if not talk.thread.is_alive():
                    break
        answer = talk.received()
    assert _status(answer) == 408, answer
    assert time.monotonic() - started < 8


def test_a_request_body_past_the_limit_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(http1, "MAX_REQUEST_BODY", 10)
    with conversation() as talk:
        talk.client.sendall(b"POST / HTTP/1.1\r\nContent-Length: 11\r\n\r\n")
        assert _status(talk.received()) == 413
    with conversation() as talk:
        talk.client.sendall(
            b"POST / HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n8\r\n12345678\r\n8\r\n"
        )
        assert _status(talk.received()) == 413


def _serve_one(upstream: socket.socket, answer: bytes) -> bytes:
    """Read one request (head, and a body by its Content-Length or chunks) and answer it."""
    data = b""
    while b"\r\n\r\n" not in data:
        data += upstream.recv(65_536)
    head, _, body = data.partition(b"\r\n\r\n")
    if b"Transfer-Encoding: chunked" in head:
        while not body.endswith(b"0\r\n\r\n"):
            body += upstream.recv(65_536)
    elif b"Content-Length: " in head:
        length = int(head.split(b"Content-Length: ")[1].split(b"\r\n")[0])
        while len(body) < length:
            body += upstream.recv(65_536)
    upstream.sendall(answer)
    return data.partition(b"\r\n\r\n")[0] + b"\r\n\r\n" + body


def test_chunked_bodies_are_reframed_and_trailers_dropped() -> None:
    with conversation() as talk:
        talk.client.sendall(
            b"POST /x HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n"
            b"3;ext=1\r\nabc\r\n0\r\nX-Trailer: GET /smuggled HTTP/1.1\r\n\r\n"
        )
        seen = _serve_one(talk.upstream, b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
        talk.client.shutdown(socket.SHUT_WR)
        answer = talk.received()
    assert seen.endswith(b"\r\n\r\n3\r\nabc\r\n0\r\n\r\n"), seen
    assert b"ext=1" not in seen and b"smuggled" not in seen
    assert answer.endswith(b"ok") and b" 200 " in answer


def test_a_pipelined_request_stays_a_request_of_its_own() -> None:
    with conversation() as talk:
        # The first body's length covers what looks like a second request: it is body.
        talk.client.sendall(
            b"POST /a HTTP/1.1\r\nContent-Length: 24\r\n\r\nGET /hidden HTTP/1.1\r\n\r\n"
            b"GET /b HTTP/1.1\r\n\r\n"
        )
        first = _serve_one(talk.upstream, b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n")
        second = _serve_one(talk.upstream, b"HTTP/1.1 204 No Content\r\n\r\n")
        talk.client.shutdown(socket.SHUT_WR)
        answers = talk.received()
    assert first.startswith(b"POST /a ") and first.endswith(b"GET /hidden HTTP/1.1\r\n\r\n")
    assert second.startswith(b"GET /b ")
    assert answers.count(b"HTTP/1.1 2") == 2


def test_the_requests_of_one_connection_are_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(http1, "MAX_REQUESTS", 2)
    with conversation() as talk:
        for _ in range(2):
            talk.client.sendall(b"GET / HTTP/1.1\r\n\r\n")
            _serve_one(talk.upstream, b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n")
        answers = talk.received()  # the proxy closes after the second
    assert answers.count(b"HTTP/1.1 200") == 2
    assert answers.endswith(b"Connection: close\r\n\r\n")


@pytest.mark.parametrize(
    "answer",
    [
        b"garbage\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\n",
        b"HTTP/1.1 101 Switching Protocols\r\n\r\n",
        b"HTTP/1.1 100 Continue\r\n\r\n" * 20,
    ],
)
def test_a_bad_answer_from_the_destination_is_a_502(answer: bytes) -> None:
    with conversation() as talk:
        talk.client.sendall(b"GET / HTTP/1.1\r\n\r\n")
        _serve_one(talk.upstream, answer)
        received = talk.received()
    # Interim answers are passed on; the last word is the proxy's.
    assert received.rsplit(b"HTTP/1.1 ", 1)[1].startswith(b"502 "), received


def test_an_answer_without_length_is_passed_on_until_the_destination_closes() -> None:
    with conversation() as talk:
        talk.client.sendall(b"GET / HTTP/1.1\r\n\r\n")
        _serve_one(talk.upstream, b"HTTP/1.1 200 OK\r\n\r\nuntil the end")
        talk.upstream.shutdown(socket.SHUT_WR)
        answer = talk.received()
    assert answer.endswith(b"Connection: close\r\n\r\nuntil the end")


def test_a_content_length_and_chunked_are_the_only_framings() -> None:
    def head(*headers: str) -> Head:
        return http1.parse_head("\r\n".join(["POST / HTTP/1.1", *headers]).encode())

    assert request_framing(head()) == 0
    assert request_framing(head("Content-Length: 5, 5")) == 5
    assert request_framing(head("Transfer-Encoding: Chunked")) == http1.CHUNKED
    with pytest.raises(http1.RefusedError):
        request_framing(head("Transfer-Encoding: chunked", "Transfer-Encoding: chunked"))


def test_an_answers_transfer_codings_before_chunked_are_kept() -> None:
    # The body is re-chunked as it passes; the gzip under the chunks is the destination's and
    # stays said (the client got a gzip body it was told was plain).
    with conversation() as talk:
        talk.client.sendall(b"GET / HTTP/1.1\r\n\r\n")
        coded = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip, chunked\r\n\r\n4\r\nGZIP\r\n0\r\n\r\n"
        _serve_one(talk.upstream, coded)
        talk.upstream.shutdown(socket.SHUT_WR)
        answer = talk.received()
    head, _, body = answer.partition(b"\r\n\r\n")
    assert b"Transfer-Encoding: gzip, chunked" in head.split(b"\r\n"), answer
    assert body == b"4\r\nGZIP\r\n0\r\n\r\n"
