"""Ships log lines to the control plane in batches, from a background thread.

Steps produce output faster than one request per line could carry, and a slow or failing
control plane must never block or fail the work: lines are buffered, posted every
``interval_s`` or once ``batch_size`` are waiting, retried once, then dropped with a note
on stderr. A throttled post (429) waits as the control plane says, inside ``send``. Once
the control plane answers that it dropped lines (the work item's log budget is spent),
nothing more is sent: it would be dropped too.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable

from .diagnostics import logger

TYPE_CHECKING = False  # not typing's: see corral.runner.records
if TYPE_CHECKING:
    from typing import Any

MAX_LINE_BYTES = 8 * 1024
# The most text of log lines the completion report carries (its body also holds the result,
# up to 1,000,000 bytes, within the api's limit of 2 MiB): more goes as a /logs call first.
FINAL_LINES_MAX_BYTES = 64 * 1024
_TRUNCATED = " [truncated]"


def truncate(line: str, limit: int = MAX_LINE_BYTES) -> str:
    """``line`` cut to at most ``limit`` UTF-8 bytes, marked when cut."""
    encoded = line.encode("utf-8", errors="replace")
    if len(encoded) <= limit:
        return line
    kept = encoded[: limit - len(_TRUNCATED)].decode("utf-8", errors="ignore")
    return kept + _TRUNCATED


class LogShipper:
    """Buffers lines from any thread and posts them in order through ``send``."""

    def __init__(
        self,
        send: Callable[[list[dict[str, Any]]], Any],
        *,
        interval_s: float = 0.5,
        batch_size: int = 200,
        max_buffered: int = 50_000,
    ) -> None:
        self._send = send
        self._interval_s = interval_s
        self._batch_size = batch_size
        self._max_buffered = max_buffered
        self._buffer: list[dict[str, Any]] = []
        self._dropped = 0
        self._budget_spent = False
        self._stopping = False
        self._condition = threading.Condition()
        # Held while posting, so that a flush from the work thread and one from the
        # background thread never send batches out of order.
        self._send_lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="corral-log-shipper", daemon=True)
        self._thread.start()

    def emit(self, stream: str, line: str) -> None:
        """Queue one line; ``stream`` is ``stdout``, ``stderr`` or ``system``."""
        entry = {"stream": stream, "line": truncate(line), "ts": time.time()}
        with self._condition:
            if self._budget_spent:
                return
            # Bounded: a control plane that cannot keep up must not exhaust memory.
            if len(self._buffer) >= self._max_buffered:
                self._dropped += 1
                return
            self._buffer.append(entry)
            if len(self._buffer) >= self._batch_size:
                self._condition.notify()

    def flush(self) -> None:
        """Post everything buffered so far; returns once it was sent or dropped."""
        with self._send_lock:
            batch = self._take()
            for start in range(0, len(batch), self._batch_size):
                self._post(batch[start : start + self._batch_size])

    def take_final(self, max_bytes: int = FINAL_LINES_MAX_BYTES) -> list[dict[str, Any]]:
        """Everything buffered so far, for the completion report to carry: the batches
        before the last are posted now, in order, and the last (at most one batch, of at
        most ``max_bytes`` of text: the report's body also holds the result) is returned;
        none once the item's log budget is spent."""
        with self._send_lock:
            batch = self._take()
            while len(batch) > self._batch_size:
                self._post(batch[: self._batch_size])
                batch = batch[self._batch_size :]
            if len(json.dumps(batch)) > max_bytes:  # the text it adds to the report's body
                self._post(batch)  # too much to ride with the report
                batch = []
            return [] if self._budget_spent else batch

    def _take(self) -> list[dict[str, Any]]:
        """The buffered lines, and a line saying how many were dropped, if any."""
        with self._condition:
            batch, self._buffer = self._buffer, []
            dropped, self._dropped = self._dropped, 0
        if dropped:
            note = f"{dropped} log lines dropped: the control plane did not keep up"
            batch.append({"stream": "system", "line": note, "ts": time.time()})
        return batch

    def close(self) -> None:
        """Stop the background thread and flush what is left."""
        with self._condition:
            self._stopping = True
            self._condition.notify()
        if self._thread is not None:
            self._thread.join()
        self.flush()

    def _run(self) -> None:
        while True:
            with self._condition:
                self._condition.wait_for(
                    lambda: self._stopping or len(self._buffer) >= self._batch_size,
                    timeout=self._interval_s,
                )
                if self._stopping:
                    return
            self.flush()

    def _post(self, lines: list[dict[str, Any]]) -> None:
        if self._budget_spent:
            return
        # Any failure, not only RunnerError: shipping logs must never fail the work.
        try:
            answer = self._send(lines)
        except Exception:
            try:
                answer = self._send(lines)
            except Exception as error:
                logger.warning("dropped %d log lines: %s", len(lines), error)
                return
        dropped = answer.get("dropped") if isinstance(answer, dict) else None
        if isinstance(dropped, int) and dropped > 0:
            with self._condition:
                self._budget_spent = True
                self._buffer.clear()
            logger.warning(
                "the control plane's log budget for this work item is spent; "
                "later output is not sent"
            )
