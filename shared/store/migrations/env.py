"""Alembic environment: runs migrations on the connection corral hands it.

Migrations are run by ``corral db upgrade`` (or :func:`corral.shared.store.migrate.upgrade`), which
passes an open connection in ``config.attributes["connection"]``.
"""

from __future__ import annotations

from alembic import context
from sqlalchemy import Connection, create_engine

import corral.shared.store.models  # noqa: F401 - registers the tables on Base.metadata
from corral.shared.settings import CommonSettings
from corral.shared.store.db import Base

target_metadata = Base.metadata


def _run(connection: Connection) -> None:
    context.configure(
        connection=connection,
        target_metadata=target_metadata,
        render_as_batch=connection.dialect.name == "sqlite",
        compare_type=True,
    )
    with context.begin_transaction():
        context.run_migrations()


connection = context.config.attributes.get("connection")
if connection is not None:
    _run(connection)
else:
    engine = create_engine(CommonSettings().resolved_database_url())
    with engine.begin() as fresh:
        _run(fresh)
    engine.dispose()
