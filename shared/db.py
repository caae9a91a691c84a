"""Engine and session set-up for the system of record.

PostgreSQL in production, SQLite for the embedded default. The tables live in
:mod:`shared.models`; schema changes ship as Alembic migrations (:mod:`shared.migrations`).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from sqlalchemy import Dialect, Engine, create_engine, event
from sqlalchemy.orm import DeclarativeBase, Session, sessionmaker
from sqlalchemy.types import DateTime, TypeDecorator

from shared.settings import CoreSettings


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
            raise ValueError("naive datetime given to a UTC column; use shared.db.utcnow()")
        return value.astimezone(UTC)

    def process_result_value(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        return value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)


def make_engine(url: str | None = None) -> Engine:
    """An engine for ``url``, else for the configured database (SQLite by default)."""
    resolved = url or CoreSettings().resolved_database_url()
    if not resolved.startswith("sqlite"):
        return create_engine(resolved, pool_pre_ping=True, pool_size=10, max_overflow=20)
    path = resolved.removeprefix("sqlite:///")
    if path and path != resolved and not path.startswith(":memory:"):
        Path(path).parent.mkdir(parents=True, exist_ok=True)
    engine = create_engine(resolved, connect_args={"check_same_thread": False, "timeout": 30})
    event.listen(engine, "connect", _sqlite_pragmas)
    return engine


def _sqlite_pragmas(connection: Any, _record: Any) -> None:
    # WAL lets readers run beside the one writer; threads of `corral dev` share the file.
    cursor = connection.cursor()
    cursor.execute("PRAGMA journal_mode=WAL")
    cursor.execute("PRAGMA foreign_keys=ON")
    cursor.execute("PRAGMA busy_timeout=30000")
    cursor.close()


class Database:
    """An engine and its session factory; one per process."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._sessions = sessionmaker(engine, expire_on_commit=False)

    @classmethod
    def from_settings(cls, settings: CoreSettings | None = None) -> Database:
        return cls(make_engine((settings or CoreSettings()).resolved_database_url()))

    @property
    def is_postgres(self) -> bool:
        return self.engine.dialect.name == "postgresql"

    @contextmanager
    def session(self) -> Iterator[Session]:
        """A session in a transaction: committed on success, rolled back on error."""
        with self._sessions() as session, session.begin():
            yield session

    def dispose(self) -> None:
        self.engine.dispose()
