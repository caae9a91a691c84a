"""Engine and session set-up for the system of record, and set-based writes of many rows.

PostgreSQL in production, SQLite for the embedded default. The tables live in
:mod:`corral.shared.store.models`; schema changes ship as Alembic migrations
(:mod:`corral.shared.store.migrations`).
"""

from __future__ import annotations

import contextlib
import threading
import time
import weakref
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from sqlalchemy import (
    Connection,
    Dialect,
    Engine,
    case,
    create_engine,
    event,
    insert,
    inspect,
    literal,
    update,
)
from sqlalchemy.exc import DisconnectionError
from sqlalchemy.orm import DeclarativeBase, InstrumentedAttribute, Session, sessionmaker
from sqlalchemy.types import DateTime, TypeDecorator

from corral.shared.keyring import keyring_of
from corral.shared.settings import CommonSettings
from corral.shared.store.sealing import Sealer


class Base(DeclarativeBase):
    pass


def utcnow() -> datetime:
    return datetime.now(UTC)


class UTCDateTime(TypeDecorator[datetime]):
    """A timezone-aware UTC timestamp on every database.

    SQLite keeps no zone and hands back naive values; this type stores UTC and always
    returns aware datetimes, so that comparisons behave the same on both databases.
    """

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            raise ValueError(
                "naive datetime given to a UTC column; use corral.shared.store.db.utcnow()"
            )
        return value.astimezone(UTC)

    def process_result_value(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        return value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)


def make_engine(url: str | None = None, *, settings: CommonSettings | None = None) -> Engine:
    """An engine for ``url``, else for the configured database (SQLite by default).

    On PostgreSQL its pool holds at most ``CORRAL_DB_POOL_SIZE`` connections (no overflow),
    so that what one process may open is known: see docs/operations.md for how many
    processes a PostgreSQL serves.
    """
    settings = settings or CommonSettings()
    resolved = url or settings.resolved_database_url()
    if not resolved.startswith("sqlite"):
        # hide_parameters: a failing statement's error text (which reaches logs and task
        # events) must not carry the values, e.g. a dispatch payload's env.
        engine = create_engine(
            resolved,
            pool_pre_ping=settings.db_ping_idle_s == 0,
            pool_size=settings.db_pool_size,
            max_overflow=0,
            pool_timeout=settings.db_pool_timeout_s,
            hide_parameters=True,
        )
        if settings.db_ping_idle_s > 0:
            _ping_when_idle(engine, settings.db_ping_idle_s)
        _PING_IDLE_S[engine] = settings.db_ping_idle_s
        return engine
    path = resolved.removeprefix("sqlite:///")
    if path and path != resolved and not path.startswith(":memory:"):
        Path(path).parent.mkdir(parents=True, exist_ok=True)
    engine = create_engine(
        resolved,
        connect_args={"check_same_thread": False, "timeout": 30},
        pool_size=20,
        max_overflow=40,
        hide_parameters=True,
    )
    event.listen(engine, "connect", _sqlite_connect)
    event.listen(engine, "begin", _sqlite_begin)
    return engine


_IDLE_SINCE = "corral_idle_since"
_clock = time.monotonic  # the tests' to move
# Each PostgreSQL engine's CORRAL_DB_PING_IDLE_S, for the connections held out of its pool.
_PING_IDLE_S: weakref.WeakKeyDictionary[Engine, float] = weakref.WeakKeyDictionary()


def _ping_when_idle(engine: Engine, idle_s: float) -> None:
    """Ping a pooled connection before it is handed out only when it has been idle for
    ``idle_s`` or more; a dead one is replaced, as SQLAlchemy's pre-ping does. A connection
    used more recently is trusted: pinging it would add a round trip to every transaction
    of the hot paths. Should it have died meanwhile (the database restarted within
    ``idle_s``, or its backend was terminated), its statement fails as while the database
    is down, SQLAlchemy drops it and every connection the pool held then, and the caller
    retries (tasks, intake batches; the api answers 503 database_unavailable)."""
    error = engine.dialect.loaded_dbapi.Error

    def idle_from(_dbapi_connection: Any, record: Any) -> None:
        record.info[_IDLE_SINCE] = _clock()

    def ping_if_idle(dbapi_connection: Any, record: Any, _proxy: Any) -> None:
        since = record.info.pop(_IDLE_SINCE, None)
        if since is None or _clock() - since < idle_s:
            return  # just opened, or used a moment ago
        try:
            engine.dialect.do_ping(dbapi_connection)
        except error as exc:  # the pool opens a new connection in its place
            raise DisconnectionError("a pooled connection was found closed") from exc

    event.listen(engine, "checkin", idle_from)
    event.listen(engine, "checkout", ping_if_idle)


def _sqlite_connect(connection: Any, _record: Any) -> None:
    # SQLite has no row locks, so `with_for_update()` does nothing there. Instead every
    # transaction starts with BEGIN IMMEDIATE (below): it takes the write lock up front, so
    # the read-check-write sequences that PostgreSQL guards with row locks cannot interleave
    # between the threads of `corral dev`. The driver's own transaction handling is off.
    connection.isolation_level = None
    cursor = connection.cursor()
    cursor.execute("PRAGMA journal_mode=WAL")
    cursor.execute("PRAGMA foreign_keys=ON")
    cursor.execute("PRAGMA busy_timeout=30000")
    cursor.close()


def _sqlite_begin(connection: Any) -> None:
    connection.exec_driver_sql("BEGIN IMMEDIATE")


class Database:
    """An engine and its session factory; one per process."""

    def __init__(self, engine: Engine, *, sealer: Sealer | None = None) -> None:
        self.engine = engine
        self._sessions = sessionmaker(engine, expire_on_commit=False)
        self._sealer = sealer
        self._held: dict[str, HeldConnection] = {}
        self._held_lock = threading.Lock()

    @classmethod
    def from_settings(cls, settings: CommonSettings | None = None) -> Database:
        resolved = settings or CommonSettings()
        engine = make_engine(resolved.resolved_database_url(), settings=resolved)
        return cls(engine, sealer=Sealer(keyring=keyring_of(resolved)))

    @property
    def sealer(self) -> Sealer:
        """Seals the dispatch env values this database stores (with the deployment's
        CORRAL_SECRET_KEY; read from the settings when none was given)."""
        if self._sealer is None:
            self._sealer = Sealer(keyring=keyring_of(CommonSettings()))
        return self._sealer

    @property
    def is_postgres(self) -> bool:
        return self.engine.dialect.name == "postgresql"

    @contextmanager
    def session(self) -> Iterator[Session]:
        """A session in a transaction: committed on success, rolled back on error."""
        with self._sessions() as session, session.begin():
            yield session

    @contextmanager
    def connection(self) -> Iterator[Connection]:
        """A Core connection in a transaction, for the hot paths' batched statements:
        committed on success, rolled back on error."""
        with self.engine.begin() as connection:
            yield connection

    @contextmanager
    def autocommit(self) -> Iterator[Connection]:
        """A Core connection outside any transaction block: each statement commits on its
        own, one round trip (for a hot path's single-statement writes, on PostgreSQL)."""
        with autocommit_connection(self.engine) as connection:
            yield connection

    def held(self, name: str) -> HeldConnection:
        """The autocommit connection the hot path ``name`` keeps (:class:`HeldConnection`)."""
        found = self._held.get(name)
        if found is None:
            with self._held_lock:
                found = self._held.setdefault(name, HeldConnection(self))
        return found

    def dispose(self) -> None:
        for held in list(self._held.values()):
            held.release()
        self.engine.dispose()


def autocommit_connection(engine: Engine) -> Connection:
    """A connection of ``engine``'s pool outside any transaction block. Given back at once
    if it cannot be switched (a connection found broken there): an error's traceback, which
    a retry may keep, must not hold it out of a pool that has no overflow."""
    connection = engine.connect()
    try:
        return connection.execution_options(isolation_level="AUTOCOMMIT")
    except BaseException:
        with contextlib.suppress(Exception):  # a broken connection closes quietly
            connection.close()
        raise


HOLD_FROM_POOL_SIZE = 4


class HeldConnection:
    """An autocommit connection a hot path keeps checked out between its statements.

    Taking a connection from the pool and giving it back, and switching it to autocommit
    and back, cost about 0.4 ms in a process woken by its message (docs/benchmarks.md), as
    much as the round trip of a small statement. The intake's write and the provider
    worker's claim each run one statement at a time from one loop: they keep a connection
    instead. It is one of the pool's, so the process's connections stay within
    ``CORRAL_DB_POOL_SIZE``; a pool of fewer than :data:`HOLD_FROM_POOL_SIZE` keeps none
    (its every connection may be needed elsewhere).

    A caller that finds it in use takes one from the pool, as before. One idle for
    ``CORRAL_DB_PING_IDLE_S`` or longer is pinged before use and replaced if dead, as the
    pool does. One that dies between two uses fails its next statement (SQLAlchemy
    invalidates it, and the next use opens another), as a pooled connection used a moment
    ago does, unless another of the pool's connections found the database gone first: then
    the pool drops every connection it had, and this one is replaced at its next use too.
    """

    def __init__(self, db: Database) -> None:
        self._db = db
        pool_size = getattr(db.engine.pool, "size", lambda: 0)()
        self._holds = db.is_postgres and pool_size >= HOLD_FROM_POOL_SIZE
        self._lock = threading.Lock()
        self._connection: Connection | None = None
        self._used = 0.0
        self._stale = False  # the pool dropped its connections since this one was opened
        if self._holds:
            event.listen(db.engine, "invalidate", self._dropped)

    @contextmanager
    def use(self) -> Iterator[Connection]:
        if not (self._holds and self._lock.acquire(blocking=False)):
            with self._db.autocommit() as connection:
                yield connection
            return
        try:
            yield self._ready()
        finally:
            self._used = _clock()
            if not self._holds:  # released while in use: the database is disposed of
                self.close()
            self._lock.release()

    def release(self) -> None:
        """Keep no connection from now on (the database is being disposed of): give it back
        once a use in progress ends; later uses take one from the pool."""
        self._holds = False
        if self._lock.acquire(timeout=30):  # else the use in progress gives it back
            try:
                self.close()
            finally:
                self._lock.release()

    def _dropped(self, _dbapi_connection: Any, _record: Any, exception: Any) -> None:
        if exception is not None:  # a disconnect: the pool drops every connection it had
            self._stale = True

    def _ready(self) -> Connection:
        connection = self._connection
        stale, self._stale = self._stale, False
        if stale and connection is not None and not connection.invalidated:
            connection.invalidate()  # of the pool's old connections: maybe dead
        if connection is not None and not (connection.closed or connection.invalidated):
            idle_s = _PING_IDLE_S.get(self._db.engine, 0.0)
            if _clock() - self._used < idle_s or self._alive(connection):
                return connection
            connection.invalidate()
        self.close()
        self._connection = autocommit_connection(self._db.engine)
        return self._connection

    def _alive(self, connection: Connection) -> bool:
        dbapi_connection = connection.connection.dbapi_connection
        if dbapi_connection is None:
            return False
        try:
            self._db.engine.dialect.do_ping(dbapi_connection)
        except self._db.engine.dialect.loaded_dbapi.Error:
            return False
        return True

    def close(self) -> None:
        """Give the connection back to the pool (the next use takes another)."""
        connection, self._connection = self._connection, None
        if connection is not None:
            with contextlib.suppress(Exception):  # a connection already lost closes quietly
                connection.close()


def update_each(
    session: Session, key: InstrumentedAttribute[str], rows: Mapping[str, Mapping[str, Any]]
) -> None:
    """One UPDATE giving each row (by ``key``) its own values (hashable ones): a column every
    row gets the same value is set to that value, any other to ``CASE key WHEN ... THEN ...
    ELSE column`` (a row that names no value for it keeps its own)."""
    if not rows:
        return
    model = key.class_
    columns = {name for values in rows.values() for name in values}
    assignments: dict[str, Any] = {}
    for name in sorted(columns):
        column = getattr(model, name)
        given = {row_key: values[name] for row_key, values in rows.items() if name in values}
        distinct = set(given.values())
        if len(given) == len(rows) and len(distinct) == 1:
            assignments[name] = distinct.pop()
        else:
            whens = {row_key: literal(value, column.type) for row_key, value in given.items()}
            assignments[name] = case(whens, value=key, else_=column)
    session.execute(
        update(model)
        .where(key.in_(sorted(rows)))
        .values(assignments)
        .execution_options(synchronize_session=False)
    )


def insert_rows(session: Session, model: type[Base], rows: Sequence[Mapping[str, Any]]) -> None:
    """INSERT ``rows`` (all with the same columns) as multi-row INSERTs, up to 1,000 rows a
    statement. Asking for RETURNING is what makes SQLAlchemy take that path
    ("insertmanyvalues", from one cached compilation) rather than the driver's executemany,
    which runs one INSERT a row."""
    if rows:
        session.execute(insert(model).returning(*inspect(model).primary_key), rows)
