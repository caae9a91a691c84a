"""The runner's HTTP exchange (runner/wire.py), and what a runner's start leaves unloaded.

The exchange is read against answers written byte by byte on a socket pair; the start is
the runner's entry imported as the local provider starts it (``python -S``, package
``runner``), and its modules listed.
"""

from __future__ import annotations

import io
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from corral.runner.wire import MalformedResponseError, Response, exchange

REPO_ROOT = Path(__file__).resolve().parents[2]
HEADERS = {"Host": "localhost", "Content-Length": "2"}


@pytest.fixture
def server() -> Iterator[tuple[socket.socket, socket.socket]]:
    """The client's end and the server's end of a connected pair."""
    client, peer = socket.socketpair()
    client.settimeout(5)
    peer.settimeout(5)
    yield client, peer
    client.close()
    peer.close()


def answer_with(peer: socket.socket, raw: bytes) -> threading.Thread:
    """Read the request's head and two-byte body on ``peer``, answer ``raw``, then close
    the writing side; the thread doing it (its request is in ``thread.request``)."""

    def serve() -> None:
        received = b""
        while b"\r\n\r\n" not in received or len(received.split(b"\r\n\r\n", 1)[1]) < 2:
            chunk = peer.recv(4096)
            if not chunk:
                break
            received += chunk
        thread.request = received  # type: ignore[attr-defined]
        peer.sendall(raw)
        peer.shutdown(socket.SHUT_WR)

    thread = threading.Thread(target=serve)
    thread.start()
    return thread


def run(server: tuple[socket.socket, socket.socket], raw: bytes) -> tuple[Response, bytes]:
    client, peer = server
    thread = answer_with(peer, raw)
    try:
        response = exchange(client, "POST", "/v1/runner/claim", HEADERS, b"{}")
    finally:
        thread.join()
    return response, thread.request  # type: ignore[attr-defined]


def test_sends_the_request_and_reads_a_sized_answer(server: tuple[socket.socket, ...]) -> None:
    raw = b'HTTP/1.1 200 OK\r\nContent-Length: 11\r\nX-Thing:  a b \r\n\r\n{"ok": true}extra'
    response, request = run(server, raw)  # type: ignore[arg-type]
    assert request == (
        b"POST /v1/runner/claim HTTP/1.1\r\nHost: localhost\r\nContent-Length: 2\r\n"
        b"Connection: close\r\n\r\n{}"
    )
    assert response == Response(200, {"content-length": "11", "x-thing": "a b"}, b'{"ok": true')


def test_reads_a_chunked_answer_after_an_interim_one(server: tuple[socket.socket, ...]) -> None:
    raw = (
        b"HTTP/1.1 100 Continue\r\n\r\n"
        b"HTTP/1.1 429 Too Many Requests\r\nTransfer-Encoding: chunked\r\nRetry-After: 2\r\n\r\n"
        b"4;ext=1\r\nabcd\r\n3\r\nefg\r\n0\r\nTrailer: x\r\n\r\n"
    )
    response, _ = run(server, raw)  # type: ignore[arg-type]
    assert (response.status, response.body) == (429, b"abcdefg")
    assert response.headers["retry-after"] == "2"


def test_reads_to_the_end_without_a_length(server: tuple[socket.socket, ...]) -> None:
    response, _ = run(server, b"HTTP/1.0 500 Oops\r\n\r\nall of it")  # type: ignore[arg-type]
    assert (response.status, response.body) == (500, b"all of it")


@pytest.mark.parametrize(
    "raw",
    [
        b"",  # closed at once
        b"SSH-2.0-OpenSSH\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nshort",
        b"HTTP/1.1 200 OK\r\nContent-Length: -1\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nno colon here\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",
        b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n",  # the head never ends
        b"HTTP/1.1 200 OK\r\n" + b"X: " + b"a" * 70_000 + b"\r\n\r\n",
    ],
)
def test_refuses_what_is_not_an_http_answer(server: tuple[socket.socket, ...], raw: bytes) -> None:
    with pytest.raises(MalformedResponseError):
        run(server, raw)  # type: ignore[arg-type]


def test_streams_a_file_body(server: tuple[socket.socket, socket.socket]) -> None:
    client, peer = server
    thread = answer_with(peer, b"HTTP/1.1 204 No Content\r\n\r\n")
    try:
        response = exchange(client, "PUT", "/b", HEADERS, io.BytesIO(b"xy"))
    finally:
        thread.join()
    assert thread.request.endswith(b"\r\n\r\nxy")  # type: ignore[attr-defined]
    assert (response.status, response.body) == (204, b"")


# A runner of a shell item loads none of these at its start: http.client (with the email
# package and ssl), and what only bundles, git inputs, code work or a CA need.
NOT_LOADED = (
    "http.client",
    "email",
    "ssl",
    "tarfile",
    "hashlib",
    "shutil",
    "tempfile",
    "difflib",
    "runner.bundle",
    "runner.snapshot",
    "runner.python_code",
)


def test_the_runner_starts_without_what_a_shell_item_does_not_use(tmp_path: Path) -> None:
    (tmp_path / "runner").symlink_to(REPO_ROOT / "runner")
    probe = "import sys, runner.main; print(' '.join(sorted(sys.modules)))"
    done = subprocess.run(
        [sys.executable, "-S", "-c", probe],
        cwd=tmp_path,
        env={"PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    )
    loaded = set(done.stdout.split())
    assert "runner.control" in loaded  # the probe did import the runner
    assert sorted(loaded.intersection(NOT_LOADED)) == []
