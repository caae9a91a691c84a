"""The Alembic migrations build exactly the schema the models declare, on both databases."""

from __future__ import annotations

from pathlib import Path

import pytest
from alembic import command
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from sqlalchemy import inspect

import corral.shared.store.models  # noqa: F401 - registers the tables
from corral.shared.store.db import Base, Database, make_engine
from corral.shared.store.migrate import alembic_config, is_current, upgrade

TABLES = {
    "model_profiles",
    "pools",
    "work_items",
    "sandboxes",
    "registration_tokens",
    "runner_sessions",
    "cost_events",
    "lifecycle_events",
    "provider_credentials",
    "work_item_logs",
}


@pytest.fixture(params=["postgresql", "sqlite"])
def db(request: pytest.FixtureRequest) -> Database:
    database: Database = request.getfixturevalue(
        "pg_db" if request.param == "postgresql" else "sqlite_db"
    )
    return database


def test_migrations_match_the_models(db: Database) -> None:
    with db.engine.connect() as connection:
        context = MigrationContext.configure(connection, opts={"compare_type": True})
        differences = compare_metadata(context, Base.metadata)
    assert differences == []
    assert set(inspect(db.engine).get_table_names()) >= TABLES


def test_upgrade_is_idempotent_and_reports_current(db: Database) -> None:
    assert is_current(db.engine)
    upgrade(db.engine)
    assert is_current(db.engine)


def test_the_uniqueness_the_design_relies_on_is_in_the_schema(db: Database) -> None:
    inspector = inspect(db.engine)

    def unique_sets(table: str) -> set[tuple[str, ...]]:
        found = {tuple(c["column_names"]) for c in inspector.get_unique_constraints(table)}
        found |= {tuple(i["column_names"]) for i in inspector.get_indexes(table) if i["unique"]}
        return found

    assert ("org_id", "idempotency_key") in unique_sets("work_items")
    assert ("work_item_id", "attempt") in unique_sets("sandboxes")
    assert ("token_hash",) in unique_sets("registration_tokens")
    assert ("sandbox_id",) in unique_sets("cost_events")


@pytest.mark.parametrize("dialect", ["postgresql", "sqlite"])
def test_each_migration_downgrades_and_upgrades_again(
    dialect: str, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    url = (
        request.getfixturevalue("fresh_pg_url")
        if dialect == "postgresql"
        else f"sqlite:///{tmp_path / 'down.db'}"
    )
    engine = make_engine(url)
    try:
        upgrade(engine)
        config = alembic_config()
        with engine.begin() as connection:
            config.attributes["connection"] = connection
            command.downgrade(config, "0001")
        assert "cost_due_at" not in {c["name"] for c in inspect(engine).get_columns("sandboxes")}
        assert not is_current(engine)
        upgrade(engine)
        assert is_current(engine)
        with engine.connect() as connection:
            context = MigrationContext.configure(connection, opts={"compare_type": True})
            assert compare_metadata(context, Base.metadata) == []
    finally:
        engine.dispose()
