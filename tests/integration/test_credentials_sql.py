"""The SQL credential store on real PostgreSQL and on SQLite."""

from __future__ import annotations

import uuid

import pytest
from sqlalchemy import Engine, text

from corral.providers.credentials import CredentialResolver, SqlCredentialStore
from corral.shared.db import Database


@pytest.fixture(params=["postgresql", "sqlite"])
def engine(request: pytest.FixtureRequest) -> Engine:
    db: Database = request.getfixturevalue(
        "pg_db" if request.param == "postgresql" else "sqlite_db"
    )
    return db.engine


def test_credentials_round_trip_encrypted(engine: Engine) -> None:
    store = SqlCredentialStore(engine)
    org = f"org-{uuid.uuid4().hex[:12]}"
    resolver = CredentialResolver(store, secret_key="k" * 32, environ={})
    resolver.put(org, "e2b", "first-secret")
    resolver.put(org, "e2b", "second-secret")  # replaces, does not duplicate

    assert resolver.resolve(org, "e2b").get_secret_value() == "second-secret"
    with engine.connect() as connection:
        rows = connection.execute(
            text("select ciphertext from provider_credentials where org_id = :org"), {"org": org}
        ).all()
    assert len(rows) == 1
    assert b"second-secret" not in bytes(rows[0][0])
