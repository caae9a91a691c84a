"""What the long-running processes last said they did: when the reaper last finished a sweep,
and which processes consume each queue.

The api's metrics read both from the database (corral.scheduler.api.metrics), so one scrape
target shows whether the reaper sweeps, the intake makes progress and each queue has a
consumer, whichever process stopped. The reaper's last sweep is a row of
``maintenance_clock`` (phase :data:`SWEEP_DONE`). A consumer is a row of ``queue_consumers``
per queue it consumes, written by :class:`ConsumerBeat` every :data:`BEAT_EVERY_S`: a Celery
worker's for as long as it runs, the scheduler's intake after a round of one of its loops
(so a stuck intake stops saying so). Rows older than :data:`FORGET_AFTER` are deleted as
the beats write.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta

from sqlalchemy import Connection, Engine, Table, delete, func, select, update
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.orm import Session

from corral.shared.store.db import Database, utcnow
from corral.shared.store.models import ItemState, MaintenanceClock, QueueConsumer, WorkItem

log = logging.getLogger(__name__)

SWEEP_DONE = "sweep_done"  # the maintenance_clock phase: the reaper's last finished sweep
BEAT_EVERY_S = 10.0
FRESH = timedelta(seconds=60)  # a consumer seen within this is counted
FORGET_AFTER = timedelta(days=1)


def consumer_name(name: str) -> str:
    """This process's consumer id: ``name@host:pid``."""
    return f"{name}@{socket.gethostname()}:{os.getpid()}"


def record_phase(db: Database, phase: str, at: datetime | None = None) -> None:
    """Set ``phase``'s time in ``maintenance_clock`` (made on first use): one statement."""
    table = MaintenanceClock.__table__
    assert isinstance(table, Table)
    insert = postgresql.insert if db.is_postgres else sqlite.insert
    values = {"phase": phase, "last_run_at": at or utcnow()}
    upsert = insert(table).values(values)
    upsert = upsert.on_conflict_do_update(
        index_elements=[table.c.phase], set_={"last_run_at": upsert.excluded.last_run_at}
    )
    with db.connection() as connection:
        connection.execute(upsert)


def phase_time(session: Session, phase: str) -> datetime | None:
    return session.scalar(
        select(MaintenanceClock.last_run_at).where(MaintenanceClock.phase == phase)
    )


def record_consumer(
    db: Database, queues: Sequence[str], consumer_id: str, seen_at: datetime
) -> None:
    """Say that ``consumer_id`` consumed ``queues`` at ``seen_at``; forget long-gone ones."""
    with db.session() as session:
        changed = session.execute(
            update(QueueConsumer)
            .where(QueueConsumer.consumer_id == consumer_id, QueueConsumer.queue.in_(queues))
            .values(seen_at=seen_at)
            .execution_options(synchronize_session=False)
        )
        if getattr(changed, "rowcount", 0) != len(set(queues)):
            known = set(
                session.scalars(
                    select(QueueConsumer.queue).where(QueueConsumer.consumer_id == consumer_id)
                )
            )
            for queue in sorted(set(queues) - known):
                session.add(QueueConsumer(queue=queue, consumer_id=consumer_id, seen_at=seen_at))
        session.execute(delete(QueueConsumer).where(QueueConsumer.seen_at < seen_at - FORGET_AFTER))


def forget_consumer(db: Database, consumer_id: str) -> None:
    with db.session() as session:
        session.execute(delete(QueueConsumer).where(QueueConsumer.consumer_id == consumer_id))


def consumer_counts(session: Session, now: datetime | None = None) -> dict[str, int]:
    """Consumers seen within :data:`FRESH`, by queue (a queue with none: absent)."""
    since = (now or utcnow()) - FRESH
    rows = session.execute(
        select(QueueConsumer.queue, func.count())
        .where(QueueConsumer.seen_at >= since)
        .group_by(QueueConsumer.queue)
    )
    return {queue: int(count) for queue, count in rows}


UNSERVED_QUEUE = "unserved_queue"  # what the routing event of an item on such a queue says
SERVED_CACHE_S = 5.0  # routing reads the served queues at most this often per process


def unserved_note(queue: str) -> str:
    """What an item's routing event adds when no worker consumes its queue: it may wait
    there for ever, until the no_worker rule fails it (corral.worker.maintenance)."""
    return f" ({UNSERVED_QUEUE}: no worker said in the last minute that it consumes {queue})"


class _Served:
    """One engine's served queues, as last read."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.read_at = -SERVED_CACHE_S
        self.queues: frozenset[str] = frozenset()


_served: weakref.WeakKeyDictionary[Engine, _Served] = weakref.WeakKeyDictionary()
_served_lock = threading.Lock()


def served_queues(session: Session) -> frozenset[str]:
    """The queues a consumer said within :data:`FRESH` that it consumes, read through
    ``session`` at most every :data:`SERVED_CACHE_S` per database and process (routing asks
    once per batch: a worker that just started may be missed for that long)."""
    bind = session.get_bind()
    engine = bind.engine if isinstance(bind, Connection) else bind
    assert isinstance(engine, Engine)
    with _served_lock:
        served = _served.setdefault(engine, _Served())
    with served.lock:
        if time.monotonic() - served.read_at >= SERVED_CACHE_S:
            served.queues = frozenset(consumer_counts(session))
            served.read_at = time.monotonic()
        return served.queues


@dataclass(frozen=True)
class Unserved:
    """A queue items are routed to and no worker consumes: how many wait on it, since when."""

    queue: str
    items: int
    oldest_routed_at: datetime | None


def unserved(session: Session, org_id: str | None = None) -> list[Unserved]:
    """The queues of routed items (of ``org_id``) that no consumer said within
    :data:`FRESH` that it consumes, by name: one read of the routed items (the pending
    ones, by the state index) and one of the consumers."""
    query = (
        select(WorkItem.queue, func.count(), func.min(WorkItem.routed_at))
        .where(WorkItem.state == ItemState.ROUTED.value, WorkItem.queue.is_not(None))
        .group_by(WorkItem.queue)
    )
    if org_id is not None:
        query = query.where(WorkItem.org_id == org_id)
    waiting = session.execute(query).all()
    if not waiting:
        return []
    served = consumer_counts(session)
    return [
        Unserved(queue, int(count), oldest)
        for queue, count, oldest in sorted(waiting, key=lambda row: str(row[0]))
        if queue is not None and queue not in served
    ]


def known_queues(session: Session) -> set[str]:
    return set(session.scalars(select(QueueConsumer.queue).distinct()))


def last_seen(session: Session, queue: str) -> datetime | None:
    """When a consumer of ``queue`` last said so."""
    return session.scalar(
        select(func.max(QueueConsumer.seen_at)).where(QueueConsumer.queue == queue)
    )


class ConsumerBeat:
    """Keeps this process's rows of ``queue_consumers`` fresh from a daemon thread.

    With ``on_progress`` the time written is that of the last :meth:`progressed` call (the
    intake's loops call it after each round), so a process that stops making progress stops
    being counted; otherwise it is the time of writing (alive is enough).
    """

    def __init__(
        self,
        db: Database,
        queues: Sequence[str],
        consumer_id: str,
        *,
        every_s: float = BEAT_EVERY_S,
        on_progress: bool = False,
    ) -> None:
        self._db, self._queues, self.consumer_id = db, list(queues), consumer_id
        self._every_s, self._on_progress = every_s, on_progress
        self._progress: datetime | None = None
        self._written: datetime | None = None

    def progressed(self) -> None:
        self._progress = utcnow()  # one assignment: no lock needed

    def beat(self) -> None:
        """Write once, if there is anything new to say."""
        seen = self._progress if self._on_progress else utcnow()
        if seen is None or seen == self._written:
            return
        record_consumer(self._db, self._queues, self.consumer_id, seen)
        self._written = seen

    def start(self, stop: threading.Event) -> threading.Thread:
        """Beat from a daemon thread until ``stop`` is set; then this consumer's rows go."""
        thread = threading.Thread(target=self.run, args=(stop,), name="consumer-beat", daemon=True)
        thread.start()
        return thread

    def run(self, stop: threading.Event) -> None:
        while True:
            try:
                self.beat()
            except Exception:  # the database is away: the next beat tries again
                log.warning("consumer beat not written", exc_info=True)
            # Until the first write, look again soon: a process says it consumes from its
            # first round on, not a beat later.
            if stop.wait(self._every_s if self._written else min(self._every_s, 0.5)):
                break
        try:
            forget_consumer(self._db, self.consumer_id)
        except Exception:
            log.warning("consumer rows not removed; they age out", exc_info=True)
