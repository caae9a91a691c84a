"""`corral dispatch`'s own POST /v1/dispatch (corral.cli.api_post) against a real HTTP server
that fails: a 503 is sent again with the same Idempotency-Key, a connection dropped after the
request says it may have been stored, nothing listening says it was not."""

from __future__ import annotations

import json
import socket
import threading
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from corral.cli import api_post
from corral.cli.api_post import NoAnswerError, post_dispatch

MESSAGE = {"org": "acme", "project": "web", "work": {"kind": "shell", "command": "true"}}
Reply = Callable[[BaseHTTPRequestHandler, int], None]
Start = Callable[[Reply], tuple[str, list[dict[str, str]]]]


@pytest.fixture(autouse=True)
def _no_pauses(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(api_post, "PAUSES_S", (0.0, 0.0))


@pytest.fixture
def server() -> Iterator[Start]:
    """An api on loopback whose n-th request is answered by ``reply(handler, n)``; the
    headers of the requests it read."""
    started: list[ThreadingHTTPServer] = []

    def start(reply: Reply) -> tuple[str, list[dict[str, str]]]:
        seen: list[dict[str, str]] = []

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                self.rfile.read(int(self.headers["Content-Length"]))
                seen.append(dict(self.headers))
                reply(self, len(seen))

            def log_message(self, *args: object) -> None:
                pass

        httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=httpd.serve_forever, daemon=True).start()
        started.append(httpd)
        return f"http://127.0.0.1:{httpd.server_address[1]}", seen

    yield start
    for httpd in started:
        httpd.shutdown()
        httpd.server_close()


def _answer(handler: BaseHTTPRequestHandler, status: int, body: bytes) -> None:
    handler.send_response(status)
    handler.send_header("Content-Length", str(len(body)))
    handler.end_headers()
    handler.wfile.write(body)


def test_a_503_is_sent_again_with_the_same_key(server: Start) -> None:
    def reply(handler: BaseHTTPRequestHandler, n: int) -> None:
        if n == 1:
            _answer(handler, 503, b'{"detail": "busy"}')
        else:
            _answer(handler, 202, json.dumps({"id": "wi-1", "state": "received"}).encode())

    url, seen = server(reply)
    answer = post_dispatch(url, "tok", MESSAGE, "key-1")
    assert (answer.status, answer.body["id"]) == (202, "wi-1")
    assert [h["Idempotency-Key"] for h in seen] == ["key-1", "key-1"]


def test_a_request_whose_answer_is_lost_may_have_been_stored(server: Start) -> None:
    def drop(handler: BaseHTTPRequestHandler, n: int) -> None:
        handler.close_connection = True  # read, then closed without a word

    url, seen = server(drop)
    with pytest.raises(NoAnswerError) as raised:
        post_dispatch(url, "tok", MESSAGE, "key-2")
    assert raised.value.reached
    assert len(seen) == 3


def test_nothing_listening_was_not_sent() -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]  # closed again: nothing listens there
    with pytest.raises(NoAnswerError) as raised:
        post_dispatch(f"http://127.0.0.1:{port}", "tok", MESSAGE, "key-3")
    assert not raised.value.reached


def test_an_answer_that_is_not_json_has_no_body(server: Start) -> None:
    url, _ = server(lambda handler, n: _answer(handler, 502, b"<html>bad gateway</html>"))
    answer = post_dispatch(url, "tok", MESSAGE, "key-4")
    assert (answer.status, answer.body) == (502, None)


def test_a_url_of_another_scheme_is_refused() -> None:
    with pytest.raises(ValueError, match="not an http:// or unix:// URL"):
        post_dispatch("ftp://example.com", "tok", MESSAGE, "key-5")
