"""Tells the control plane the runner is alive, and hears from it when to cancel the work."""

from __future__ import annotations

import threading

from .control import ControlClient
from .diagnostics import logger
from .errors import RunnerError, UnauthorizedError
from .steps import Cancellation

CANCELLED_BY_CONTROL_PLANE = "cancelled by the control plane"


class Heartbeat:
    """Posts a heartbeat every ``interval_s`` from a background thread until stopped.

    A failed heartbeat is only noted: the control plane may be restarting, and the work
    should not die of it. A refused one (401: session expired or revoked) cancels the work,
    since nothing the runner reports from then on would be accepted.
    """

    def __init__(
        self, client: ControlClient, *, interval_s: float, cancellation: Cancellation
    ) -> None:
        self._client = client
        self._interval_s = interval_s
        self._cancellation = cancellation
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name="corral-heartbeat", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stopped.set()
        if self._thread.is_alive():
            self._thread.join()

    def _run(self) -> None:
        while not self._stopped.wait(self._interval_s):
            self.beat()

    def beat(self) -> None:
        """Send one heartbeat and act on the answer."""
        try:
            cancel = self._client.heartbeat()
        except UnauthorizedError:
            logger.warning("heartbeat refused: the session expired or was revoked; cancelling")
            cancel = True
        except RunnerError as error:
            logger.warning("heartbeat failed: %s", error)
            return
        if cancel and self._cancellation.reason is None:
            logger.warning("the control plane cancelled the work")
            self._cancellation.cancel(CANCELLED_BY_CONTROL_PLANE)
