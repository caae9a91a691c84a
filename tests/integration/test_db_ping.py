"""A pooled PostgreSQL connection is pinged before use only when it has been idle for
CORRAL_DB_PING_IDLE_S: a dead idle one is replaced unseen; one used a moment ago is trusted,
and should it have died, its statement fails once and the pool recovers."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest
from sqlalchemy import Engine, create_engine, text
from sqlalchemy.exc import OperationalError

from corral.shared.settings import CoreSettings
from corral.shared.store import db as db_module
from corral.shared.store.db import make_engine

IDLE_S = 5.0


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    fake = Clock()
    monkeypatch.setattr(db_module, "_clock", fake)
    return fake


@pytest.fixture
def engine(postgres_database_url: str) -> Iterator[Engine]:
    settings = CoreSettings(db_pool_size=1, db_ping_idle_s=IDLE_S)
    engine = make_engine(postgres_database_url, settings=settings)
    yield engine
    engine.dispose()


@pytest.fixture
def pings(engine: Engine, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    seen: list[int] = []
    ping = engine.dialect.do_ping

    def counted(dbapi_connection: Any) -> bool:
        seen.append(1)
        return ping(dbapi_connection)

    monkeypatch.setattr(engine.dialect, "do_ping", counted)
    return seen


def _backend(engine: Engine) -> int:
    with engine.connect() as connection:
        return int(connection.execute(text("SELECT pg_backend_pid()")).scalar_one())


def _terminate(url: str, pid: int) -> None:
    """End backend ``pid``, and wait until it has."""
    admin = create_engine(url, isolation_level="AUTOCOMMIT")
    try:
        with admin.connect() as connection:
            connection.execute(text("SELECT pg_terminate_backend(:pid)"), {"pid": pid})
        wait_gone(url, pid)
    finally:
        admin.dispose()


def wait_gone(url: str, pid: int) -> None:
    """Wait until backend ``pid`` has ended (a backend ends a moment after its end)."""
    admin = create_engine(url, isolation_level="AUTOCOMMIT")
    try:
        with admin.connect() as connection:
            query = text("SELECT count(*) FROM pg_stat_activity WHERE pid = :pid")
            deadline = time.monotonic() + 30
            while connection.execute(query, {"pid": pid}).scalar_one():
                assert time.monotonic() < deadline, f"backend {pid} did not end"
                time.sleep(0.02)
    finally:
        admin.dispose()


def test_a_connection_used_a_moment_ago_is_not_pinged(
    engine: Engine, clock: Clock, pings: list[int]
) -> None:
    first = _backend(engine)
    clock.now += IDLE_S - 0.5
    assert _backend(engine) == first
    assert pings == []
    clock.now += IDLE_S
    assert _backend(engine) == first
    assert pings == [1]


def test_a_dead_connection_idle_past_the_limit_is_replaced_unseen(
    engine: Engine, clock: Clock, pings: list[int], postgres_database_url: str
) -> None:
    first = _backend(engine)
    _terminate(postgres_database_url, first)
    clock.now += IDLE_S
    assert _backend(engine) != first  # no error reached the caller
    assert pings == [1]


def test_a_dead_connection_used_a_moment_ago_fails_once_then_the_pool_recovers(
    engine: Engine, clock: Clock, pings: list[int], postgres_database_url: str
) -> None:
    first = _backend(engine)
    _terminate(postgres_database_url, first)
    clock.now += 0.1
    with pytest.raises(OperationalError):  # what a task retries, or the api answers 503 for
        _backend(engine)
    assert _backend(engine) != first
    assert pings == []
