"""A loopback TCP proxy in front of PostgreSQL that can lose the answer to one COMMIT, or to
one statement that commits on its own.

It forwards both ways, reading the client's side as PostgreSQL protocol messages. Once
armed (:meth:`PostgresProxy.lose_next_commit_answer`), the next ``COMMIT`` a client sends
goes to the server, the proxy reads the server's answer up to its ``CommandComplete`` (the
commit is durable then), and closes the connection without passing the answer on: the
client sees its connection lost mid-commit, the database has committed. This is what a
network cut or a failover at that instant does, reached for certain.

:meth:`PostgresProxy.lose_next_answer_to` does the same to the next statement whose SQL
holds a marker, sent by the extended protocol (as psycopg sends a statement with
parameters, prepared or not) outside a transaction block: the server runs and commits it
before its ``ReadyForQuery``, which the proxy reads and does not pass on.

Clients must not ask for TLS or GSS encryption (the URL from :meth:`PostgresProxy.url`
says so), so every message after the startup packet is framed.
"""

from __future__ import annotations

import contextlib
import socket
import struct
import threading
from collections.abc import Callable

from sqlalchemy.engine import make_url

QUERY = b"Q"
COMMAND_COMPLETE = b"C"
PARSE = b"P"
BIND = b"B"
READY = b"Z"


def _exactly(sock: socket.socket, count: int) -> bytes:
    data = b""
    while len(data) < count:
        chunk = sock.recv(count - len(data))
        if not chunk:
            raise ConnectionError("closed")
        data += chunk
    return data


class _Link:
    """One client connection and its connection to the server."""

    def __init__(self, proxy: PostgresProxy, client: socket.socket) -> None:
        self.proxy = proxy
        self.client = client
        self.server = socket.create_connection(proxy.upstream)
        self.losing = threading.Event()  # the answer to what was just sent is to be lost
        self.until = COMMAND_COMPLETE  # the last message of that answer
        self.statements: dict[bytes, bytes] = {}  # the SQL of each statement parsed, by name

    def start(self) -> None:
        for pump in (self._from_client, self._from_server):
            threading.Thread(target=self._guarded, args=(pump,), daemon=True).start()

    def _guarded(self, pump: Callable[[], None]) -> None:
        try:
            pump()
        except OSError:
            pass
        finally:
            self.close()

    def close(self) -> None:
        for sock in (self.client, self.server):
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()

    def _from_client(self) -> None:
        (length,) = struct.unpack("!i", _exactly(self.client, 4))  # the startup packet
        self.server.sendall(struct.pack("!i", length) + _exactly(self.client, length - 4))
        while True:
            kind = _exactly(self.client, 1)
            (length,) = struct.unpack("!i", _exactly(self.client, 4))
            body = _exactly(self.client, length - 4)
            if kind == QUERY and body.upper().startswith(b"COMMIT") and self.proxy.take_arm():
                self.losing.set()  # before the server can answer
            elif kind in (PARSE, BIND):
                self._watch_statement(kind, body)
            self.server.sendall(kind + struct.pack("!i", length) + body)

    def _watch_statement(self, kind: bytes, body: bytes) -> None:
        """Note each statement's SQL (Parse: name, SQL, ...), and arm the loss at the Bind
        of one that holds the marker (Bind: portal, statement, ...). The server answers an
        extended-protocol exchange only at its Sync, after the Bind: all of it is lost."""
        name, _, rest = body.partition(b"\0")
        if kind == PARSE:
            self.statements[name] = rest.partition(b"\0")[0]
        elif self.proxy.take_statement_arm(self.statements.get(rest.partition(b"\0")[0], b"")):
            self.until = READY
            self.losing.set()

    def _from_server(self) -> None:
        while True:
            chunk = self.server.recv(65536)
            if not chunk:
                return
            # The client sends COMMIT only once it has read every earlier answer, and the
            # flag is set before the COMMIT goes on: what comes after it is its answer.
            if self.losing.is_set():
                self._swallow_commit_answer(chunk)
                return
            self.client.sendall(chunk)

    def _swallow_commit_answer(self, received: bytes) -> None:
        """Read the server's messages up to the COMMIT's CommandComplete (or the statement's
        ReadyForQuery), pass none on."""
        while True:
            while len(received) >= 5:
                kind = received[:1]
                (length,) = struct.unpack("!i", received[1:5])
                if len(received) < 1 + length:
                    break
                body, received = received[5 : 1 + length], received[1 + length :]
                if kind == self.until and (kind == READY or body.startswith(b"COMMIT")):
                    self.proxy.lost.set()
                    return
            chunk = self.server.recv(65536)
            if not chunk:
                return
            received += chunk


class PostgresProxy:
    """Listens on 127.0.0.1 (a port of its own) and forwards to ``upstream``."""

    def __init__(self, upstream_host: str = "127.0.0.1", upstream_port: int = 5432) -> None:
        self.upstream = (upstream_host, upstream_port)
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port: int = self._listener.getsockname()[1]
        self._armed = False
        self.marker: bytes | None = None  # of the statement whose answer is to be lost
        self._lock = threading.Lock()
        self.lost = threading.Event()  # a COMMIT's answer was lost
        self._links: list[_Link] = []
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()

    def url(self, database_url: str) -> str:
        """``database_url`` through this proxy, without TLS or GSS encryption."""
        upstream = make_url(database_url)
        through = upstream.set(host="127.0.0.1", port=self.port).update_query_dict(
            {"sslmode": "disable", "gssencmode": "disable"}
        )
        return through.render_as_string(hide_password=False)

    def lose_next_commit_answer(self) -> None:
        with self._lock:
            self._armed = True

    def lose_next_answer_to(self, marker: bytes) -> None:
        with self._lock:
            self.marker = marker

    def take_statement_arm(self, sql: bytes) -> bool:
        with self._lock:
            if self.marker is None or self.marker not in sql:
                return False
            self.marker = None
        return True

    def take_arm(self) -> bool:
        with self._lock:
            armed, self._armed = self._armed, False
        return armed

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            link = _Link(self, client)
            self._links.append(link)
            link.start()

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)  # wakes the accepting thread
        self._listener.close()
        self._thread.join(5)
        for link in self._links:
            link.close()
