"""Serving the api with uvicorn on TCP and, when configured, on a Unix socket.

Sandboxes without network reach the api through the Unix socket mounted into them, so both
listeners serve the same application in one process. Metrics have a third listener of their
own, never reachable through the other two.
"""

from __future__ import annotations

import contextlib
import os
import socket
from pathlib import Path

import uvicorn

from corral.scheduler.api import create_app
from corral.scheduler.metrics import start_metrics_server
from corral.shared.settings import CoreSettings


def bind_sockets(settings: CoreSettings, *, unix: bool = True) -> list[socket.socket]:
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


def make_server(*, log_level: str = "info") -> uvicorn.Server:
    # log_config=None: uvicorn's loggers go through the process's (JSON, redacting) handler
    # instead of handlers of their own that would bypass it.
    config = uvicorn.Config(
        create_app(),
        log_level=log_level,
        access_log=False,
        lifespan="off",
        timeout_keep_alive=30,
        log_config=None,
    )
    return uvicorn.Server(config)


def serve(settings: CoreSettings, *, unix: bool = True) -> None:
    """Serve until interrupted; metrics on their own listener when ``api_metrics_port`` is
    set."""
    sockets = bind_sockets(settings, unix=unix)
    metrics = None
    if settings.api_metrics_port is not None:
        metrics = start_metrics_server(settings.api_metrics_host, settings.api_metrics_port)
    try:
        make_server().run(sockets=sockets)
    finally:
        if metrics is not None:
            metrics.shutdown()
            metrics.server_close()
        for sock in sockets:
            sock.close()
        if unix:
            with contextlib.suppress(FileNotFoundError):
                settings.resolved_api_socket().unlink()
