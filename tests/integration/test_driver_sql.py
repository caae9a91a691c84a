"""DriverStatement: a Core statement compiled once and run as driver SQL gives what
SQLAlchemy's own execution gives, with the same parameter processing and errors."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta, timezone

import pytest
from sqlalchemy import (
    JSON,
    Column,
    Integer,
    MetaData,
    String,
    Table,
    bindparam,
    insert,
    literal,
    select,
)
from sqlalchemy.exc import DBAPIError, IntegrityError

from corral.shared.store.db import Database, UTCDateTime
from corral.shared.store.driver_sql import DriverStatement


@pytest.fixture
def probe(pg_db: Database) -> Iterator[Table]:
    """A table of this test's own in the shared test database."""
    table = Table(
        f"driver_sql_probe_{uuid.uuid4().hex[:8]}",
        MetaData(),
        Column("id", String, primary_key=True),
        Column("number", Integer, nullable=False),
        Column("at", UTCDateTime(), nullable=False),
        Column("doc", JSON, nullable=False),
    )
    table.create(pg_db.engine)
    try:
        yield table
    finally:
        table.drop(pg_db.engine)


def _write(table: Table) -> DriverStatement:
    """An insert with a JSON literal and a constant of its own, returning what it wrote."""
    return DriverStatement(
        insert(table)
        .from_select(
            ["id", "number", "at", "doc"],
            select(
                bindparam("id", type_=String()),
                bindparam("number", type_=Integer()) + literal(1000),
                bindparam("at", type_=UTCDateTime()),
                literal({"kept": [1, "two"]}, JSON()),
            ),
        )
        .returning(table.c.id, table.c.number, table.c.doc)
    )


def test_a_driver_statement_writes_and_answers_as_sqlalchemy_does(
    pg_db: Database, probe: Table
) -> None:
    at = datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC)
    with pg_db.autocommit() as connection:
        row = _write(probe).run(connection, {"id": "a", "number": 7, "at": at}).one()
    assert (row.id, row.number, row.doc) == ("a", 1007, {"kept": [1, "two"]})
    with pg_db.connection() as connection:  # read back through SQLAlchemy's own execution
        stored = connection.execute(select(probe)).one()
    assert (stored.number, stored.at, stored.doc) == (1007, at, {"kept": [1, "two"]})


def test_its_parameters_go_through_their_types(pg_db: Database, probe: Table) -> None:
    naive = datetime(2026, 1, 2, 3, 4, 5)  # UTCDateTime refuses a naive value when bound
    with pg_db.autocommit() as connection, pytest.raises(ValueError, match="naive datetime"):
        _write(probe).run(connection, {"id": "a", "number": 7, "at": naive})
    elsewhere = datetime(2026, 1, 2, 5, 4, 5, tzinfo=timezone(timedelta(hours=2)))
    with pg_db.autocommit() as connection:
        _write(probe).run(connection, {"id": "b", "number": 1, "at": elsewhere})
    with pg_db.connection() as connection:
        assert connection.execute(select(probe.c.at)).scalar_one() == elsewhere


def test_an_expanding_list_is_one_text_per_length(pg_db: Database, probe: Table) -> None:
    at = datetime(2026, 1, 2, tzinfo=UTC)
    with pg_db.autocommit() as connection:
        for number, key in enumerate("abcde"):
            _write(probe).run(connection, {"id": key, "number": number, "at": at})
    chosen = DriverStatement(
        select(probe.c.id)
        .where(probe.c.id.in_(bindparam("ids", expanding=True)), probe.c.number >= 1000)
        .order_by(probe.c.id)
    )
    with pg_db.autocommit() as connection:
        assert chosen.run(connection, {"ids": ["b", "d"]}).scalars().all() == ["b", "d"]
        assert chosen.run(connection, {"ids": ["a", "c", "e"]}).scalars().all() == ["a", "c", "e"]
        assert chosen.run(connection, {"ids": ["e", "b"]}).scalars().all() == ["b", "e"]
        with pytest.raises(ValueError, match="ids is empty"):
            chosen.run(connection, {"ids": []})
    compiled = chosen.compiled(pg_db.engine.dialect)
    assert compiled.render({"ids": ["x", "y"]})[0].count("%(ids_") == 2
    assert compiled.render({"ids": ["x", "y", "z"]})[0].count("%(ids_") == 3


def test_a_missing_parameter_is_named(pg_db: Database, probe: Table) -> None:
    with pg_db.autocommit() as connection, pytest.raises(ValueError, match="at, number"):
        _write(probe).run(connection, {"id": "a"})


def test_a_database_error_is_sqlalchemys_and_hides_the_values(
    pg_db: Database, probe: Table
) -> None:
    at = datetime(2026, 1, 2, tzinfo=UTC)
    with pg_db.autocommit() as connection:
        _write(probe).run(connection, {"id": "a", "number": 1, "at": at})
        with pytest.raises(IntegrityError) as raised:
            _write(probe).run(connection, {"id": "a", "number": 2, "at": at})
    assert isinstance(raised.value, DBAPIError)
    assert getattr(raised.value.orig, "sqlstate", None) == "23505"
    assert "parameters hidden" in str(raised.value)  # as the engine's own statements


def test_a_driver_without_named_parameters_is_refused(sqlite_db: Database) -> None:
    statement = DriverStatement(select(literal(1)))
    with sqlite_db.autocommit() as connection, pytest.raises(ValueError, match="pyformat"):
        statement.run(connection, {})
