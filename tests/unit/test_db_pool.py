"""The database pool of a process: bounded by CORRAL_DB_POOL_SIZE, with no overflow."""

from __future__ import annotations

import pytest

from corral.shared.settings import CoreSettings
from corral.shared.store.db import make_engine

URL = "postgresql+psycopg://corral@127.0.0.1:1/corral"  # never connected to here


def test_a_postgres_pool_holds_at_most_the_configured_connections() -> None:
    engine = make_engine(URL, settings=CoreSettings(db_pool_size=3, db_pool_timeout_s=2.5))
    pool = engine.pool
    assert (pool.size(), pool._max_overflow, pool._timeout) == (3, 0, 2.5)  # type: ignore[attr-defined]


def test_the_pool_size_comes_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CORRAL_DB_POOL_SIZE", "7")
    assert make_engine(URL).pool.size() == 7  # type: ignore[attr-defined]
    monkeypatch.delenv("CORRAL_DB_POOL_SIZE")
    assert make_engine(URL).pool.size() == 10  # type: ignore[attr-defined]


def test_a_pool_size_of_zero_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CORRAL_DB_POOL_SIZE", "0")
    with pytest.raises(ValueError, match="db_pool_size"):
        CoreSettings()


def test_connections_are_pinged_when_idle_unless_every_use_is_asked_for() -> None:
    # The default pings only a connection idle for db_ping_idle_s (a listener, see
    # tests/integration/test_db_ping.py); 0 turns SQLAlchemy's ping before every use on.
    assert make_engine(URL).pool._pre_ping is False  # type: ignore[attr-defined]
    every = make_engine(URL, settings=CoreSettings(db_ping_idle_s=0))
    assert every.pool._pre_ping is True  # type: ignore[attr-defined]
