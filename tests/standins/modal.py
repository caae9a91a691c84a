"""A protocol-level stand-in for Modal, for testing corral's modal provider on loopback.

Modal's servers are unreachable from here, and the provider talks to them only through the
official ``modal`` SDK, which speaks gRPC (grpclib) with the service definitions it ships in
``modal_proto``. This serves those same generated services, subclassed, on one free
127.0.0.1 port of a grpclib server in a thread of its own:

* ``modal.client.ModalClient`` (``modal_api``): client hello, app and environment
  get-or-create, image get-or-create (answered as already built), secrets from a dict,
  sandbox create, task id, wait/poll, terminate, list by tags, get by name, tags, and the
  command router's address; token id and secret are checked on every call;
* ``modal.task_command_router.TaskCommandRouter`` (``modal_router``): exec start, stdout and
  stderr from an offset, poll and wait, behind the JWT the control plane handed out.

Point the SDK at it with ``modal.Client(standin.server_url, CLIENT_TYPE_CLIENT,
(token_id, token_secret))`` — or the provider's ``server_url`` setting. A sandbox's
entrypoint really runs, as a local process with the environment of its secrets in a
directory of its own (``base_env`` adds what a container image would provide, e.g.
``PYTHONPATH``); exec'd commands run beside it.

Tests inject gRPC statuses and delays (``fail``/``delay``), read back sandboxes, with the
GPU each was created with, and every request (``sandboxes``/``requests``)."""

from __future__ import annotations

import asyncio
import os
import secrets
import shutil
import socket
import tempfile
import threading
from collections.abc import Mapping
from pathlib import Path
from types import TracebackType
from typing import Any, Self

from grpclib import Status
from grpclib.protocol import H2Protocol
from grpclib.server import Server

from tests.standins.modal_api import Gate, ModalApi
from tests.standins.modal_router import TaskRouter
from tests.standins.modal_state import (
    ExecRun,
    Fault,
    ModalState,
    RecordedRequest,
    StandinSandbox,
    new_id,
)

__all__ = ["ExecRun", "Fault", "ModalStandin", "RecordedRequest", "StandinSandbox"]

START_TIMEOUT_S = 10.0


class _Server(Server):
    """A grpclib server that also closes the connections clients left open when it stops
    (grpclib's own leaves them to the clients), so that none outlives the stand-in."""

    def __init__(self, handlers: list[Any]) -> None:
        super().__init__(handlers)
        self.transports: set[asyncio.BaseTransport] = set()

    def _protocol_factory(self) -> H2Protocol:
        protocol = super()._protocol_factory()
        made = protocol.connection_made

        def connection_made(transport: asyncio.BaseTransport) -> None:
            self.transports.add(transport)
            made(transport)

        protocol.connection_made = connection_made  # type: ignore[method-assign]
        return protocol

    async def stop(self) -> None:
        self.close()
        for transport in self.transports:
            transport.close()
        await self.wait_closed()
        await asyncio.sleep(0)  # let the closed transports' callbacks run


class ModalStandin:
    """Modal's control plane and command router on one loopback port, from a thread."""

    def __init__(self, *, base_env: Mapping[str, str] | None = None) -> None:
        self.token_id = new_id("ak")
        self.token_secret = new_id("as")
        self._root = Path(tempfile.mkdtemp(prefix="modal-standin-"))
        self.state = ModalState(self._root, base_env or {"PATH": os.environ["PATH"]})
        self._socket = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._socket.bind(("127.0.0.1", 0))
        self.port: int = self._socket.getsockname()[1]
        gate = Gate(self.state, lambda: (self.token_id, self.token_secret))
        self._handlers = [ModalApi(gate, lambda: self.server_url), TaskRouter(gate)]
        self._loop = asyncio.new_event_loop()
        self._server: _Server | None = None
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="modal-standin", daemon=True)

    @property
    def server_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def api_key(self) -> str:
        """The credential as corral stores it: ``token_id:token_secret``."""
        return f"{self.token_id}:{self.token_secret}"

    # -- lifecycle ------------------------------------------------------------------------

    def __enter__(self) -> Self:
        self._thread.start()
        if not self._ready.wait(START_TIMEOUT_S):
            raise RuntimeError("the Modal stand-in did not start")
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.state.stop_all()
        if self._server is not None:
            asyncio.run_coroutine_threadsafe(self._server.stop(), self._loop).result(timeout=10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
        shutil.rmtree(self._root, ignore_errors=True)

    def _serve(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._server = _Server(self._handlers)
        self._loop.run_until_complete(self._server.start(sock=self._socket))
        self._ready.set()
        self._loop.run_forever()  # until stop(): then the loop is stopped and closed
        self._loop.close()

    # -- what a test reads ----------------------------------------------------------------

    def sandboxes(self) -> dict[str, StandinSandbox]:
        """Every sandbox ever created, by Modal id, with its state brought up to date."""
        with self.state.lock:
            for sandbox in self.state.sandboxes.values():
                self.state.refresh(sandbox)
            return dict(self.state.sandboxes)

    def sandbox(self, sandbox_id: str) -> StandinSandbox:
        return self.sandboxes()[sandbox_id]

    def live(self) -> list[StandinSandbox]:
        return self.state.live()

    def requests(self, method: str | None = None) -> list[RecordedRequest]:
        with self.state.lock:
            return [r for r in self.state.requests if method is None or r.method == method]

    def requests_carrying(self, text: str) -> list[RecordedRequest]:
        return [r for r in self.requests() if r.carries(text)]

    def secret(self, secret_id: str) -> dict[str, str]:
        with self.state.lock:
            return dict(self.state.secrets[secret_id])

    def app_id(self, name: str, environment: str = "") -> str | None:
        with self.state.lock:
            return self.state.apps.get(f"{environment}/{name}")

    # -- what a test changes --------------------------------------------------------------

    def fail(
        self, method: str, status: Status, *, times: int | None = 1, message: str = ""
    ) -> Fault:
        """Answer ``method`` (or "*": every RPC) with ``status``, ``times`` times (None: until
        cleared)."""
        fault = Fault(method, status=status, message=message, times=times)
        with self.state.lock:
            self.state.faults.append(fault)
        return fault

    def delay(self, method: str, seconds: float, *, times: int | None = 1) -> Fault:
        """Hold ``method``'s answer for ``seconds`` before serving it."""
        fault = Fault(method, delay_s=seconds, times=times)
        with self.state.lock:
            self.state.faults.append(fault)
        return fault

    def clear_faults(self) -> None:
        with self.state.lock:
            self.state.faults.clear()

    def rotate_token(self) -> None:
        """Issue a new token: the old one is answered UNAUTHENTICATED from now on."""
        self.token_id, self.token_secret = new_id("ak"), secrets.token_urlsafe(16)
