"""Handing freed slots on: the waiting items that can take a slot now, routed in fair order.

One definition, two callers:

- the maintenance worker's re-drive (``corral.redrive``: beat's sweep, and the hand-ons other
  processes ask for when they free a slot), :func:`corral.worker.maintenance.redrive`;
- the api, in the process whose runner report freed the slot (:class:`HandOns`, once the
  report is answered): the next item is routed as soon as the report is committed, without
  a message to the maintenance worker and the wait for it.

A hand-on that is lost (its process died after the slot was freed) is the periodic
re-drive's: beat's sweep routes whatever waits for a free slot, every
``CORRAL_REDRIVE_INTERVAL_S``.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from datetime import datetime

from sqlalchemy.orm import Session

from corral.scheduler.admission import next_waiting
from corral.scheduler.intake import RouteOutcome, route_item
from corral.scheduler.publish import enqueue_all
from corral.shared.runtime import Runtime
from corral.shared.store import shares
from corral.shared.store.db import utcnow

log = logging.getLogger(__name__)


def hand_on(
    rt: Runtime, *, actor: str, also: Callable[[Session, datetime], list[str]] | None = None
) -> list[RouteOutcome]:
    """Divide the shared capacities' free slots among their orgs by weight
    (:func:`corral.shared.store.shares.allocate`), then route the waiting items that can
    take a slot now, in admission order (:func:`corral.scheduler.admission.next_waiting`:
    per org with room, its first waiting items that wait for a pool with a free slot, as
    many as there are). ``also``: called in the same read's session, the ids of further
    items to route after those (the re-drive's sweep). The routing outcomes, not yet sent.

    Every query reads an index's range, so a freed slot costs one hand-on whatever waits
    behind it.
    """
    settings = rt.settings
    now = utcnow()
    with rt.db.session() as session:  # committed first: routers see the new shares
        shares.allocate(session)
    with rt.db.session() as session:
        waiting = next_waiting(session, settings, limit=settings.redrive_batch, now=now)
        if also is not None:
            waiting += also(session, now)
    routed = []
    for item_id in waiting:
        try:
            routed.append(route_item(rt.db, item_id, actor=actor, settings=settings))
        except Exception:  # one bad item must not hold up the rest
            log.exception("a hand-on could not route an item", extra={"work_item_id": item_id})
    return routed


class Coalesced:
    """One run at a time in this process: a run asked for while another runs makes that
    one go round once more (what it is about may have changed after that one read), so
    runs never pile up and none is lost. ``step`` is the caller's; its exceptions are."""

    def __init__(self) -> None:
        self._running = threading.Lock()
        self._again = threading.Event()

    def run(self, step: Callable[[], None]) -> None:
        self._again.set()
        while self._again.is_set() and self._running.acquire(blocking=False):
            try:
                while self._again.is_set():
                    self._again.clear()
                    step()
            finally:
                self._running.release()


class HandOns:
    """The hand-ons of one process (:class:`Coalesced`): a hand-on asked for while another
    runs here makes that one go round once more instead of running beside it."""

    def __init__(self, *, actor: str) -> None:
        self._actor = actor
        self._coalesced = Coalesced()

    def run(self, rt: Runtime) -> None:
        """Hand the free slots on now, or have the hand-on running here go round again;
        never raises (what a failure leaves, beat's periodic re-drive routes)."""

        def step() -> None:
            enqueue_all(hand_on(rt, actor=self._actor))

        try:
            self._coalesced.run(step)
        except Exception:  # the database or the broker
            log.exception("a hand-on failed; the periodic re-drive routes what it left")
