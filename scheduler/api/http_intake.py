"""The api's dispatch intake: HTTP requests share the broker intake's batch path.

Each api process has one writer thread per database. A request hands its validated
message to it and waits; the writer takes every request waiting at that moment (up to
``intake_batch``), accepts and routes them in one transaction (:func:`accept_batch`) and
publishes their provision tasks in one transport batch after the commit. Nothing waits for
a batch to fill: a lone request is written at once, and under load the requests that arrive
while one batch commits form the next one (a group commit), so a request waits at most
about one transaction.

A batch that fails for anything but a database outage is taken again one request at a
time, so one request that cannot be stored fails alone (e.g. another api replica wrote the
same idempotency key a moment earlier: the one-by-one path answers with that item). When
the publish fails after the commit the items are safe: the maintenance re-drive sends a
routed item's provision task again once its lease time has passed.
"""

from __future__ import annotations

import logging
import queue
import threading
from concurrent.futures import Future
from dataclasses import dataclass

from corral.scheduler.api.http_errors import ServiceUnavailable
from corral.scheduler.batch import accept_batch, owed
from corral.scheduler.consumer import is_transient
from corral.scheduler.intake import Accepted, RouteOutcome, take_one
from corral.scheduler.publish import ask_for_waiting, enqueue_all
from corral.shared.messages import DispatchRequest
from corral.shared.settings import IntakeSettings
from corral.shared.store.db import Database
from corral.shared.store.models import ItemState

log = logging.getLogger(__name__)


def not_stored() -> ServiceUnavailable:
    """What a request hears when its batch failed in a way nothing foresaw: a 503, so the
    client sends it again (with its Idempotency-Key a stored item is found, not made twice)."""
    return ServiceUnavailable(
        "dispatch_unavailable",
        "the dispatch could not be stored; send it again with the same Idempotency-Key",
    )


@dataclass(frozen=True)
class Written(Accepted):
    """A request's item, and the state this write left it in (None: an earlier dispatch's
    item, whose state the writer did not read)."""

    state: ItemState | None = None


@dataclass(frozen=True)
class _Pending:
    request: DispatchRequest
    answer: Future[Written]


class DispatchWriter:
    """The writer thread of one database: :meth:`submit` a request, wait on its answer."""

    def __init__(
        self, db: Database, settings: IntakeSettings, *, max_batch: int, actor: str
    ) -> None:
        self._db = db
        self._settings = settings
        self._max_batch = max_batch
        self._actor = actor
        self._waiting: queue.SimpleQueue[_Pending] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="dispatch-writer", daemon=True)
        self._thread.start()

    def submit(self, request: DispatchRequest) -> Future[Written]:
        """The request's item once its batch has committed (its exception if it failed)."""
        pending = _Pending(request, Future())
        self._waiting.put(pending)
        return pending.answer

    def _run(self) -> None:
        while True:
            batch = [self._waiting.get()]
            while len(batch) < self._max_batch:
                try:
                    batch.append(self._waiting.get_nowait())
                except queue.Empty:
                    break
            try:
                self._write(batch)
            except Exception:  # never leave a request waiting for ever
                log.exception("dispatch writer: a batch failed unexpectedly")
                for pending in batch:
                    if not pending.answer.done():
                        pending.answer.set_exception(not_stored())

    def _write(self, batch: list[_Pending]) -> None:
        try:
            requests = [p.request for p in batch]
            taken = accept_batch(self._db, requests, actor=self._actor, settings=self._settings)
            outcomes = owed(self._db, taken, actor=self._actor, settings=self._settings)
        except Exception as exc:
            if is_transient(exc):  # the database is down: every request answers 503
                for pending in batch:
                    pending.answer.set_exception(exc)
                return
            log.warning(
                "dispatch writer: a batch failed (%s); one by one instead",
                type(exc).__name__,
                exc_info=True,
            )
            self._one_by_one(batch)
            return
        self._publish(outcomes)
        for pending, one in zip(batch, taken, strict=True):
            state = one.outcome.state if one.created else None
            pending.answer.set_result(Written(one.item_id, one.created, state))

    def _one_by_one(self, batch: list[_Pending]) -> None:
        for pending in batch:
            try:
                accepted, outcome = take_one(
                    self._db, pending.request, actor=self._actor, settings=self._settings
                )
            except Exception as exc:
                pending.answer.set_exception(exc)
                continue
            self._publish([outcome])
            state = outcome.state if accepted.created else None
            pending.answer.set_result(Written(accepted.item_id, accepted.created, state))

    def _publish(self, outcomes: list[RouteOutcome]) -> None:
        try:
            enqueue_all(outcomes)
            ask_for_waiting(outcomes)
        except Exception:  # stored and routed: the re-drive sends the provision tasks again
            log.warning(
                "dispatch writer: provision tasks not published; the re-drive will", exc_info=True
            )


_writers: dict[Database, DispatchWriter] = {}
_writers_lock = threading.Lock()


def writer_for(db: Database, settings: IntakeSettings, *, actor: str) -> DispatchWriter:
    """This process's writer for ``db``, started on first use."""
    with _writers_lock:
        found = _writers.get(db)
        if found is None:
            max_batch = settings.intake_batch
            found = _writers[db] = DispatchWriter(db, settings, max_batch=max_batch, actor=actor)
        return found
