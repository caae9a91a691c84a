"""Publishing the provision task a routing decision asks for, always after its commit."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from corral.shared.broker.celery_app import app
from corral.shared.store.models import ItemState

if TYPE_CHECKING:
    from kombu import Producer

    from corral.scheduler.intake import RouteOutcome

log = logging.getLogger(__name__)


def enqueue(outcome: RouteOutcome) -> None:
    """Send the provision task a routing decision asks for (after its commit); for an item
    that waits, ask for a re-drive (:func:`ask_for_waiting`)."""
    ask_for_waiting([outcome])
    if outcome.queue is None:
        return
    send_provision(outcome.item_id, outcome.queue)
    log.info("routed", extra={"work_item_id": outcome.item_id, "queue": outcome.queue})


def ask_for_waiting(outcomes: Sequence[RouteOutcome]) -> None:
    """Ask for a re-drive when an item of ``outcomes`` waits: the pool it waits for may be
    closed to fresh arrivals while it has room (``corral.shared.store.slots.close``), or on
    a shared capacity whose division has not yet counted its org; only the re-drive hands
    such slots on. At most one request per process per :data:`REDRIVE_GAP_S`."""
    if any(outcome.state == ItemState.WAITING_CAPACITY for outcome in outcomes):
        request_redrive()


def enqueue_all(outcomes: Sequence[RouteOutcome]) -> int:
    """Send the provision tasks a batch of routing decisions asks for, as one transport
    batch (one pipelined round trip on Redis, where kombu supports it), then their
    ``task-sent`` events, as one message; how many.

    Each task is what ``send_task`` alone makes of it (tests/integration/
    test_provision_publish.py), less two steps that give each the same: a queue is declared
    by the batch's first task on it (kombu binds a copy of the queue for every declare, a
    fifth of a publish's time), and no task is added to the children of a task running in
    this thread (the re-drive's: corral's own tasks keep no results, so nothing reads
    them)."""
    wanted = [outcome for outcome in outcomes if outcome.queue is not None]
    if not wanted:
        return 0
    sent = _SentEvents()
    declared: set[str] = set()
    with app.producer_or_acquire() as producer:
        with producer.batch(max_size=4 * len(wanted)):
            for outcome in wanted:
                assert outcome.queue is not None
                app.send_task(
                    "corral.provision",
                    args=[outcome.item_id],
                    queue=outcome.queue,
                    producer=producer,
                    event_dispatcher=sent,
                    declare=[] if outcome.queue in declared else None,
                    add_to_parent=False,
                )
                declared.add(outcome.queue)
        sent.send(producer)
    for outcome in wanted:
        log.debug("routed", extra={"work_item_id": outcome.item_id, "queue": outcome.queue})
    log.info("routed %d items", len(wanted))
    return len(wanted)


class _SentEvents:
    """Stands in for Celery's event dispatcher while a batch's provision tasks are
    published: it keeps their ``task-sent`` events (Celery would publish each as its task
    goes, a round trip to the broker in front of the next task and of the batch's flush),
    and :meth:`send` publishes them after the tasks, as one message. Flower reads the task's
    queue from that event; it may arrive after the worker's ``task-received``, which Celery's
    event state takes in any order."""

    def __init__(self) -> None:
        self.kept: list[tuple[str, dict[str, Any]]] = []

    def publish(self, type: str, fields: dict[str, Any], producer: Any, **_: Any) -> None:
        self.kept.append((type, fields))

    def send(self, producer: Producer) -> None:
        """Publish the kept events (best effort, as Celery's: the tasks are out already)."""
        if not self.kept:
            return
        try:
            dispatcher = app.events.Dispatcher(
                producer.connection,
                channel=producer.channel,
                buffer_group={"task"},
                buffer_while_offline=False,
            )
            for kind, fields in self.kept:
                dispatcher.send(kind, **fields)
            dispatcher.flush(errors=False)
        except Exception:
            log.debug("task-sent events of a batch not sent", exc_info=True)


def send_provision(
    item_id: str, queue: str, *, countdown: float | None = None, retries: int = 0
) -> None:
    """``corral.provision`` for ``item_id`` on its capability queue; the id is all it carries.
    ``countdown``: not before so many seconds (a create its provider's pace holds);
    ``retries``: the retries its earlier task had made (a pace counts none)."""
    app.send_task(
        "corral.provision", args=[item_id], queue=queue, countdown=countdown, retries=retries
    )


# A re-drive hands every free slot on (scheduler/admission.py), so one pending request
# serves them all: a process asks at most once per REDRIVE_GAP_S, and a request not taken
# within REDRIVE_EXPIRES_S is dropped (a newer one, or beat's, does its work). Re-drives
# cannot pile up in front of the reaper's sweeps; one costs the slots it hands on, not the
# backlog, so a slot freed waits at most the gap for its next item.
REDRIVE_GAP_S = 0.2
REDRIVE_EXPIRES_S = 10.0
_redrive_lock = threading.Lock()
_last_redrive = [float("-inf")]


def request_redrive() -> bool:
    """Ask the maintenance worker to re-drive waiting items (a slot was freed); whether
    this call sent the request."""
    with _redrive_lock:
        now = time.monotonic()
        if now - _last_redrive[0] < REDRIVE_GAP_S:
            return False
        _last_redrive[0] = now
    # A hand-on: beat's periodic re-drive sweeps for stranded items and lost provisions.
    app.send_task("corral.redrive", kwargs={"sweep": False}, expires=REDRIVE_EXPIRES_S)
    return True
