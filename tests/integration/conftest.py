"""Fixtures of the integration tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from corral.shared.store.db import Database, make_engine
from tests.integration.api_clients import make_client

__all__ = ["make_client"]


@pytest.fixture(params=["sqlite", "postgresql"])
def own_db(request: pytest.FixtureRequest) -> Iterator[Database]:
    """A database of the test's own, on each engine: for code that reads every row of a
    table (a deliverer claims whatever is due), so that no other test's rows are in it."""
    if request.param == "sqlite":
        yield request.getfixturevalue("sqlite_db")
        return
    db = Database(make_engine(request.getfixturevalue("fresh_pg_url")))
    yield db
    db.dispose()
