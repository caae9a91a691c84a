"""Serving the api with uvicorn on TCP and, when configured, on a Unix socket.

Sandboxes without network reach the api through the Unix socket mounted into them, so both
listeners serve the same application in one process. Metrics have a third listener of their
own, never reachable through the other two. A call on the Unix socket carries its caller's
key (``scheduler/api/peers.py``) in the ``corral.peer`` scope extension, for the rate limits.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import socket
from pathlib import Path
from types import FrameType

import uvicorn
from starlette.types import ASGIApp, Receive, Scope, Send
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from corral.scheduler.api.app import create_app
from corral.scheduler.api.metrics import start_metrics_server
from corral.scheduler.api.peers import PEER_EXTENSION, peer_key
from corral.scheduler.api.processes import ApiProcesses, new_metrics_dir, remove_metrics_dir
from corral.scheduler.end_batches import END_BATCHES
from corral.shared.errors import ConfigurationError
from corral.shared.settings import ApiSettings

log = logging.getLogger("corral.api")


def bind_sockets(settings: ApiSettings, *, unix: bool = True) -> list[socket.socket]:
    """The listening sockets: TCP ``api_host:api_port``, and the api's Unix socket."""
    tcp = socket.create_server((settings.api_host, settings.api_port), reuse_port=False)
    sockets = [tcp]
    if unix:
        sockets.append(bind_unix(settings.resolved_api_socket()))
    return sockets


def bind_unix(path: Path) -> socket.socket:
    path.parent.mkdir(parents=True, exist_ok=True)
    with contextlib.suppress(FileNotFoundError):
        path.unlink()  # a stale socket from a process that did not clean up
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(str(path))
    # Sandboxes may run under another uid; the tokens, not the file mode, guard the api.
    os.chmod(path, 0o666)  # noqa: S103
    server.listen(128)
    return server


class PeerKeyedProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol, telling the app who connected over a Unix socket.

    The key is worked out once, when the connection is made (the peer is who connected),
    and rides on each of its calls' scopes as ``extensions["corral.peer"]["key"]``.
    httptools (C) rather than h11 (pure Python): with h11 the server's own parsing and
    writing took a third of the api's event loop on the dispatch route.
    """

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        """Take the connection, and the peer's key when it came over a Unix socket."""
        super().connection_made(transport)
        sock = transport.get_extra_info("socket")
        if sock is None or sock.family != socket.AF_UNIX:
            return
        # None for a peer not told apart: the rate limits give those one shared bucket.
        self.app = _with_peer_key(self.app, peer_key(sock))


def _with_peer_key(app: ASGIApp, key: str | None) -> ASGIApp:
    """``app`` with ``key`` in the scope of every call. Set even when None: it marks a call
    that came over the Unix socket, whatever client a forwarded-for header made up."""

    async def keyed(scope: Scope, receive: Receive, send: Send) -> None:
        extensions = dict(scope.get("extensions") or {})
        extensions[PEER_EXTENSION] = {"key": key}
        await app({**scope, "extensions": extensions}, receive, send)

    return keyed


def run_server(server: uvicorn.Server, sockets: list[socket.socket]) -> None:
    """``server.run`` until SIGTERM or SIGINT, after which it exits 0: uvicorn, once it has
    shut down gracefully, raises the signal again for the handler it found, which here ends
    the process as a stop asked for (the default would end it by the signal)."""
    for number in (signal.SIGTERM, signal.SIGINT):
        signal.signal(number, _stopped)
    try:
        server.run(sockets=sockets)
    finally:
        END_BATCHES.flush()  # the sandbox ends this process holds, sent before it goes


def _stopped(_number: int, _frame: FrameType | None) -> None:
    raise SystemExit(0)


def make_server(*, log_level: str = "info") -> uvicorn.Server:
    # log_config=None: uvicorn's loggers go through the process's (JSON, redacting) handler
    # instead of handlers of their own that would bypass it.
    config = uvicorn.Config(
        create_app(),
        http=PeerKeyedProtocol,
        log_level=log_level,
        access_log=False,
        lifespan="off",
        timeout_keep_alive=30,
        log_config=None,
    )
    return uvicorn.Server(config)


def serve(settings: ApiSettings, *, unix: bool = True) -> None:
    """Serve until interrupted, in this process or in ``api_processes`` children
    (``scheduler/api/processes.py``); metrics on their own listener when
    ``api_metrics_port`` is set.

    Raises:
        ConfigurationError: several processes asked for on the embedded SQLite database.
        ApiProcessesFailedError: the children kept dying at their start.
    """
    processes = settings.api_processes
    if processes > 1 and settings.resolved_database_url().startswith("sqlite"):
        raise ConfigurationError(
            f"CORRAL_API_PROCESSES={processes} needs a shared database: the embedded SQLite "
            "one is a single process's; set CORRAL_DATABASE_URL to PostgreSQL, or "
            "CORRAL_API_PROCESSES=1"
        )
    sockets = bind_sockets(settings, unix=unix)
    metrics_dir = new_metrics_dir(settings.state_dir) if processes > 1 else None
    metrics = None
    if settings.api_metrics_port is not None:
        metrics = start_metrics_server(
            settings.api_metrics_host, settings.api_metrics_port, multiprocess_dir=metrics_dir
        )
    log.info(
        "api listening on http://%s:%d%s, %d process%s; metrics %s",
        settings.api_host,
        sockets[0].getsockname()[1],
        f" and {settings.resolved_api_socket()}" if unix else "",
        processes,
        "es" if processes > 1 else "",
        f"on {settings.api_metrics_host}:{metrics.server_port}" if metrics else "off",
    )
    try:
        if metrics_dir is None:
            run_server(make_server(), sockets)
        else:
            ApiProcesses(processes, sockets, metrics_dir).run()
    finally:
        if metrics is not None:
            metrics.shutdown()
            metrics.server_close()
        if metrics_dir is not None:
            remove_metrics_dir(metrics_dir)
        for sock in sockets:
            sock.close()
        if unix:
            with contextlib.suppress(FileNotFoundError):
                settings.resolved_api_socket().unlink()
