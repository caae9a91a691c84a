"""The connection a hot path keeps checked out (corral.shared.store.db.HeldConnection), on real
PostgreSQL: it is taken from the pool once; a caller that finds it in use takes another; a
pool of fewer than four keeps none; one idle past CORRAL_DB_PING_IDLE_S is pinged and
replaced if dead; one that died a moment ago fails its next statement once, and the use
after that has a new one; one that cannot be switched to autocommit goes back to the pool
at once; disposing of the database gives it back."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import pytest
from sqlalchemy import Connection, event
from sqlalchemy.exc import OperationalError

from corral.shared.settings import CoreSettings
from corral.shared.store import db as db_module
from corral.shared.store.db import HOLD_FROM_POOL_SIZE, Database, make_engine
from tests.integration.test_db_ping import IDLE_S, Clock, _terminate, wait_gone


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    fake = Clock()
    monkeypatch.setattr(db_module, "_clock", fake)
    return fake


def _database(url: str, pool_size: int) -> Database:
    settings = CoreSettings(db_pool_size=pool_size, db_ping_idle_s=IDLE_S)
    return Database(make_engine(url, settings=settings))


@pytest.fixture
def db(postgres_database_url: str) -> Iterator[Database]:
    database = _database(postgres_database_url, HOLD_FROM_POOL_SIZE)
    yield database
    database.dispose()


def _checkouts(database: Database) -> list[int]:
    seen: list[int] = []
    event.listen(database.engine, "checkout", lambda *_: seen.append(1))
    return seen


def _pid(connection: Connection) -> int:
    return int(connection.exec_driver_sql("SELECT pg_backend_pid()").scalar_one())


def _autocommit(connection: Connection) -> bool:
    return bool(connection.connection.dbapi_connection.autocommit)  # type: ignore[union-attr]


def test_a_hot_path_takes_its_connection_from_the_pool_once(db: Database) -> None:
    checkouts = _checkouts(db)
    held = db.held("claim")
    pids = set()
    for _ in range(5):
        with held.use() as connection:
            assert _autocommit(connection)  # each statement commits on its own
            pids.add(_pid(connection))
    assert (len(pids), len(checkouts)) == (1, 1)
    assert db.engine.pool.checkedout() == 1  # type: ignore[attr-defined]
    assert db.held("claim") is held and db.held("intake-write") is not held


def test_a_caller_that_finds_it_in_use_takes_one_from_the_pool(db: Database) -> None:
    held = db.held("claim")
    inside, leave = threading.Event(), threading.Event()
    pids: dict[str, int] = {}

    def keep() -> None:
        with held.use() as connection:
            pids["holder"] = _pid(connection)
            inside.set()
            leave.wait(30)

    holder = threading.Thread(target=keep)
    holder.start()
    try:
        assert inside.wait(30)
        with held.use() as connection:  # at once: not waiting for the holder
            pids["other"] = _pid(connection)
            assert _autocommit(connection)
    finally:
        leave.set()
        holder.join(30)
    assert pids["holder"] != pids["other"]
    assert db.engine.pool.checkedout() == 1  # type: ignore[attr-defined]  # the pool's came back


def test_a_small_pool_keeps_no_connection(postgres_database_url: str) -> None:
    database = _database(postgres_database_url, HOLD_FROM_POOL_SIZE - 1)
    try:
        checkouts = _checkouts(database)
        for _ in range(3):
            with database.held("claim").use() as connection:
                _pid(connection)
        assert len(checkouts) == 3
        assert database.engine.pool.checkedout() == 0  # type: ignore[attr-defined]
    finally:
        database.dispose()


def test_one_that_died_a_moment_ago_fails_once_then_is_replaced(
    db: Database, postgres_database_url: str, clock: Clock
) -> None:
    held = db.held("claim")
    with held.use() as connection:
        first = _pid(connection)
    _terminate(postgres_database_url, first)
    clock.now += IDLE_S / 2  # used a moment ago: trusted, not pinged
    with pytest.raises(OperationalError) as failed, held.use() as connection:
        _pid(connection)
    assert failed.value.connection_invalidated
    with held.use() as connection:
        assert _pid(connection) not in (first, 0)
    assert db.engine.pool.checkedout() == 1  # type: ignore[attr-defined]


def test_one_idle_past_the_limit_is_pinged_and_a_dead_one_replaced_unseen(
    db: Database, postgres_database_url: str, clock: Clock, monkeypatch: pytest.MonkeyPatch
) -> None:
    pings: list[int] = []
    ping = db.engine.dialect.do_ping

    def counted(dbapi_connection: Any) -> bool:
        pings.append(1)
        return ping(dbapi_connection)

    monkeypatch.setattr(db.engine.dialect, "do_ping", counted)
    held = db.held("claim")
    with held.use() as connection:
        first = _pid(connection)
    clock.now += IDLE_S / 2
    with held.use() as connection:
        assert _pid(connection) == first
    assert pings == []  # a moment ago: no round trip added
    _terminate(postgres_database_url, first)
    clock.now += IDLE_S
    with held.use() as connection:
        assert _pid(connection) != first
    assert pings == [1]
    assert db.engine.pool.checkedout() == 1  # type: ignore[attr-defined]


def test_disposing_of_the_database_gives_it_back(postgres_database_url: str) -> None:
    database = _database(postgres_database_url, HOLD_FROM_POOL_SIZE)
    with database.held("claim").use() as connection:
        pid = _pid(connection)
    database.dispose()
    assert database.engine.pool.checkedout() == 0  # type: ignore[attr-defined]
    wait_gone(postgres_database_url, pid)  # its backend ends: it was closed, not left open


def test_one_the_pool_dropped_with_the_rest_is_replaced_without_failing(
    db: Database, postgres_database_url: str, clock: Clock
) -> None:
    held = db.held("claim")
    with held.use() as connection:
        kept = _pid(connection)
    with db.engine.connect() as other:  # another of the pool's connections
        pid = _pid(other)
        _terminate(postgres_database_url, kept)  # the database restarts, say
        _terminate(postgres_database_url, pid)
        with pytest.raises(OperationalError):  # this one finds out first: the pool drops all
            _pid(other)
    clock.now += IDLE_S / 2  # used a moment ago: not pinged
    with held.use() as connection:
        assert _pid(connection) not in (kept, pid)


def test_after_the_database_is_disposed_of_it_keeps_none(postgres_database_url: str) -> None:
    database = _database(postgres_database_url, HOLD_FROM_POOL_SIZE)
    held = database.held("claim")
    with held.use() as connection:
        _pid(connection)
    database.dispose()
    checkouts = _checkouts(database)
    for _ in range(2):
        with held.use() as connection:
            _pid(connection)
    assert len(checkouts) == 2
    assert database.engine.pool.checkedout() == 0  # type: ignore[attr-defined]
    database.dispose()


@pytest.mark.parametrize("path", ["kept", "autocommit"])
def test_a_connection_that_cannot_be_switched_to_autocommit_goes_back_to_the_pool_at_once(
    db: Database, monkeypatch: pytest.MonkeyPatch, path: str
) -> None:
    dialect = db.engine.dialect

    def broken(*_: Any) -> None:
        raise OperationalError("SET autocommit", {}, Exception("the connection is closed"))

    monkeypatch.setattr(dialect, "set_isolation_level", broken)
    with pytest.raises(OperationalError) as raised:
        if path == "kept":
            with db.held("claim").use():
                pass
        else:
            with db.autocommit():
                pass
    # The error's traceback is still held here (a task's retry may keep one for long).
    assert raised.value is not None
    assert db.engine.pool.checkedout() == 0  # type: ignore[attr-defined]
    monkeypatch.undo()
    with db.held("claim").use() as connection:
        assert _autocommit(connection), "the next use has a connection, switched"
