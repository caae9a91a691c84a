"""The reaper's one-at-a-time lock: a PostgreSQL advisory lock with a lease, or a process
lock.

On PostgreSQL (every broker: Redis, RabbitMQ) the lock is ``pg_try_advisory_xact_lock``
taken in a transaction that a connection of the lock's own keeps open, with
``idle_in_transaction_session_timeout`` set to the lease: the holder renews by speaking on
that connection as it works; a holder that stops (crashed, killed, hung) loses its session
when the lease runs out, and the lock with it. A second sweep started meanwhile does not
wait: it is skipped. Advisory locks are per database, so deployments on databases of their
own never block each other.

The clock of the sweep's less frequent phases (``reconcile``) is a row per phase in
``maintenance_clock``, moved by one guarded upsert: due when its last run is older than the
interval, whichever maintenance worker asks.

On SQLite (``corral dev``: one process) a process lock does.

Whatever the lock, the reaper's writes are guarded row by row as well (an ended sandbox is
never ended twice, an event is never written twice), so a lost lease costs time, not
correctness.
"""

from __future__ import annotations

import logging
import threading
import time
from abc import ABC, abstractmethod
from datetime import timedelta

from sqlalchemy import Connection, Engine, Table, text
from sqlalchemy.dialects.postgresql import insert
from sqlalchemy.exc import SQLAlchemyError

from corral.shared.settings import ReaperSettings
from corral.shared.store.db import Database, utcnow
from corral.shared.store.models import MaintenanceClock

log = logging.getLogger(__name__)

# pg_try_advisory_xact_lock(classid, objid): 0x636f7272 is "corr", 1 the reaper.
LOCK_CLASS, LOCK_OBJECT = 0x636F7272, 1  # 2: the warm tick (corral.shared.store.warm)


class SweepLock(ABC):
    """A lease on the right to sweep, and the clock of the sweep's less frequent phases."""

    def __init__(self, lease_s: float) -> None:
        self.lease_s = lease_s
        self._renewed = 0.0

    @abstractmethod
    def acquire(self) -> bool:
        """Take the lock if nobody holds it; never waits."""

    @abstractmethod
    def _renew(self) -> bool: ...

    @abstractmethod
    def release(self) -> None:
        """Give the lock up (no error if its lease ran out meanwhile)."""

    @abstractmethod
    def due(self, phase: str, interval_s: float) -> bool:
        """Whether ``phase`` is due (last run more than ``interval_s`` ago); if so, it is
        marked as run now."""

    def renew(self) -> bool:
        """Extend the lease when a third of it has passed. False: the lease was lost."""
        if time.monotonic() - self._renewed < self.lease_s / 3:
            return True
        ok = self._renew()
        self._renewed = time.monotonic()
        if not ok:
            log.warning("the reaper lost its sweep lock (lease expired); stopping this sweep")
        return ok


class PostgresSweepLock(SweepLock):
    """An advisory lock held by a transaction that dies with its holder (module docstring)."""

    def __init__(self, engine: Engine, *, lease_s: float) -> None:
        super().__init__(lease_s)
        self._engine = engine
        self._held: Connection | None = None

    def acquire(self) -> bool:
        connection = self._engine.connect()
        try:
            connection.execute(
                text("SELECT set_config('idle_in_transaction_session_timeout', :ms, true)"),
                {"ms": str(max(1, int(self.lease_s * 1000)))},
            )
            taken = connection.execute(
                text("SELECT pg_try_advisory_xact_lock(:class_id, :object_id)"),
                {"class_id": LOCK_CLASS, "object_id": LOCK_OBJECT},
            ).scalar_one()
        except BaseException:
            connection.close()
            raise
        if not taken:
            connection.rollback()
            connection.close()
            return False
        self._held = connection
        self._renewed = time.monotonic()
        return True

    def _renew(self) -> bool:
        if self._held is None:
            return False
        try:
            self._held.execute(text("SELECT 1"))  # the session is not idle: the lease restarts
        except SQLAlchemyError:
            return False  # the server ended the session: the lease had run out
        return True

    def release(self) -> None:
        connection, self._held = self._held, None
        if connection is None:
            return
        try:
            connection.commit()  # ends the transaction: the lock goes with it
        except SQLAlchemyError:
            log.warning("the sweep lock had expired before the sweep released it")
        finally:
            connection.close()

    def due(self, phase: str, interval_s: float) -> bool:
        if interval_s <= 0:
            return True
        now = utcnow()
        table = MaintenanceClock.__table__
        assert isinstance(table, Table)
        upsert = insert(table).values(phase=phase, last_run_at=now)
        statement = upsert.on_conflict_do_update(
            index_elements=[table.c.phase],
            set_={"last_run_at": now},
            where=table.c.last_run_at <= now - timedelta(seconds=interval_s),
        ).returning(table.c.phase)
        with self._engine.begin() as connection:
            return connection.execute(statement).first() is not None


class LocalSweepLock(SweepLock):
    """For one process: the embedded stack and unit tests."""

    _held = threading.Lock()
    _last_run: dict[str, float] = {}  # noqa: RUF012 - process-wide on purpose

    def acquire(self) -> bool:
        self._renewed = time.monotonic()
        return self._held.acquire(blocking=False)

    def _renew(self) -> bool:
        return True

    def release(self) -> None:
        self._held.release()

    def due(self, phase: str, interval_s: float) -> bool:
        now = time.monotonic()
        last = self._last_run.get(phase)
        if last is not None and now - last < interval_s:
            return False
        self._last_run[phase] = now
        return True


def sweep_lock(db: Database, settings: ReaperSettings) -> SweepLock:
    """The lock for this deployment: in PostgreSQL when the database is PostgreSQL."""
    if db.engine.dialect.name == "postgresql":
        return PostgresSweepLock(db.engine, lease_s=settings.reaper_lock_ttl_s)
    return LocalSweepLock(settings.reaper_lock_ttl_s)
