"""Group commit: many threads' requests, run as one batch by one of them.

A thread that submits a request while no batch runs leads: it runs a batch of what waits
(its own request first) and hands the lead to the oldest request still waiting, whose
thread runs the next batch. Threads that submit while a batch runs wait for their result.
So there is no thread of its own to start or stop, a lone request runs at once (a batch of
one), and under load each batch takes what piled up while the last one ran: the cost of a
transaction is shared by every request in it. Used by the provision path
(:mod:`corral.worker.claims`), where hundreds of threads each claim a sandbox and record a handle.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Generic, TypeVar

Request = TypeVar("Request")
Result = TypeVar("Result")


class _Pending(Generic[Request, Result]):
    __slots__ = ("error", "finished", "request", "result", "wake")

    def __init__(self, request: Request) -> None:
        self.request = request
        self.result: Result | None = None
        self.error: BaseException | None = None
        self.finished = False
        self.wake = threading.Event()  # set with a result, or to hand this thread the lead


class GroupCommit(Generic[Request, Result]):
    """Runs ``run`` on batches of up to ``max_batch`` submitted requests.

    ``run`` returns one result per request, in order. When it raises, every request of that
    batch raises the same exception (e.g. the database is down: each task retries).

    With ``gather_s``, a leader whose previous batch held more than one request (requests
    arrive faster than batches run) waits up to that long for the batch to fill before it
    runs it: bigger batches, for a little latency, and only under load (a lone request
    still runs at once).
    """

    def __init__(
        self,
        run: Callable[[Sequence[Request]], Sequence[Result]],
        *,
        max_batch: int = 100,
        gather_s: float = 0.0,
    ) -> None:
        if max_batch < 1 or gather_s < 0:
            raise ValueError("max_batch must be at least 1 and gather_s not negative")
        self._run = run
        self._max_batch = max_batch
        self._gather_s = gather_s
        self._last_size = 0
        self._lock = threading.Lock()
        self._full = threading.Condition(self._lock)  # max_batch requests wait
        self._waiting: deque[_Pending[Request, Result]] = deque()
        self._leading = False  # a thread is running a batch (or about to)
        self.batches = 0  # batches run so far, for tests and benchmarks

    @property
    def queued(self) -> int:
        """Requests waiting for a batch (not those of the batch that runs)."""
        with self._lock:
            return len(self._waiting)

    def submit(self, request: Request) -> Result:
        """``request``'s result, once a batch with it has run (in this thread or another).

        Raises:
            Whatever ``run`` raised for the batch this request was in.
        """
        pending: _Pending[Request, Result] = _Pending(request)
        with self._lock:
            self._waiting.append(pending)
            leads = not self._leading
            self._leading = True
            if len(self._waiting) == self._max_batch:
                self._full.notify()
        if not leads:
            pending.wake.wait()
        if not pending.finished:  # this thread leads: its request is the oldest waiting
            self._lead()
        if pending.error is not None:
            raise pending.error
        return pending.result  # type: ignore[return-value]  # finished: set by the batch

    def _take_batch(self) -> list[_Pending[Request, Result]]:
        with self._lock:
            if self._gather_s and self._last_size > 1:
                # Busy: the last batch was shared. Let the next one fill for a moment.
                deadline = time.monotonic() + self._gather_s
                while len(self._waiting) < self._max_batch:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        break
                    self._full.wait(left)
            count = min(self._max_batch, len(self._waiting))
            self._last_size = count
            return [self._waiting.popleft() for _ in range(count)]

    def _lead(self) -> None:
        batch = self._take_batch()
        try:
            results = self._run([pending.request for pending in batch])
            if len(results) != len(batch):
                raise RuntimeError(f"a batch of {len(batch)} gave {len(results)} results")
        except BaseException as exc:  # every request of the batch hears of it
            for pending in batch:
                pending.error = exc
        else:
            for pending, result in zip(batch, results, strict=True):
                pending.result = result
        finally:
            self.batches += 1
            for pending in batch:
                pending.finished = True
                pending.wake.set()
            self._hand_over()

    def _hand_over(self) -> None:
        with self._lock:
            if self._waiting:
                self._waiting[0].wake.set()  # its thread leads the next batch
            else:
                self._leading = False
