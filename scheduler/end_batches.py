"""The sandboxes whose work finished, sent to the maintenance worker to end in batches.

A runner's report ends its item in the api; its sandbox should go next. One message per
sandbox cost the maintenance worker several times what ending the sandbox costs (a task
received, traced and acknowledged, a transaction to read its row and one to record its
end), and grew with every item run. The api gathers the sandboxes its reports finished for
up to ``CORRAL_END_BATCH_S`` (or :data:`MAX_BATCH` of them) and sends them in one
``corral.terminate_many``, which ends them as one batch (:func:`corral.worker.termination.
end_sandboxes`: a few statements whatever their number).

Nothing is lost with a batch that is: each of its sandboxes was marked in its report's
transaction (``end_requested_at``), and the reaper's ``finished`` rule ends what is still
marked ``CORRAL_FINISH_GRACE_S`` later. A process that stops sends what it holds first.
"""

from __future__ import annotations

import logging
import threading

from corral.shared.broker.celery_app import app
from corral.shared.store.models import TerminationReason

log = logging.getLogger(__name__)

TASK = "corral.terminate_many"
MAX_BATCH = 200  # sandboxes a message carries; the worker ends them in one batch


def send_ends(sandbox_ids: list[str], reason: TerminationReason) -> None:
    """Ask the maintenance worker to end ``sandbox_ids`` for ``reason``, as one batch."""
    app.send_task(TASK, args=[sandbox_ids, reason.value])


class EndBatches:
    """The finished sandboxes of one process not sent yet, sent ``window_s`` after the first
    of them (at once when that is 0, or when :data:`MAX_BATCH` wait)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pending: list[str] = []
        self._timer: threading.Timer | None = None

    def add(self, sandbox_id: str, *, window_s: float) -> None:
        """Have ``sandbox_id`` ended (its work finished) with the next batch; never raises
        (a batch not sent is the reaper's)."""
        with self._lock:
            self._pending.append(sandbox_id)
            full = window_s <= 0 or len(self._pending) >= MAX_BATCH
            if not full and self._timer is None:
                timer = threading.Timer(window_s, lambda: self._due(timer))
                timer.daemon = True
                self._timer = timer
                timer.start()
        if full:
            self.flush()

    def _due(self, timer: threading.Timer) -> None:
        """A batch's window is over: send it, unless it was sent already (a flush or a full
        batch) and this timer, too late to be cancelled, would send the next one early."""
        with self._lock:
            if self._timer is not timer:
                return
        self.flush()

    def flush(self) -> None:
        """Send what waits now; never raises."""
        with self._lock:
            batch, self._pending = self._pending, []
            if self._timer is not None:
                self._timer.cancel()  # nothing when it is the timer that flushes
                self._timer = None
        for start in range(0, len(batch), MAX_BATCH):
            try:
                send_ends(batch[start : start + MAX_BATCH], TerminationReason.FINISHED)
            except Exception:  # the broker: the reaper's finished rule ends them
                log.warning(
                    "could not send a batch of sandbox ends; the reaper ends them",
                    exc_info=True,
                    extra={"sandboxes": len(batch[start : start + MAX_BATCH])},
                )


# The api's: the sandboxes its runners' reports finished.
END_BATCHES = EndBatches()
