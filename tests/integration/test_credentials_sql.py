"""The SQL credential store on real PostgreSQL and on SQLite."""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest
from sqlalchemy import Engine, create_engine, text

from providers.credentials import CredentialResolver, SqlCredentialStore


@pytest.fixture(params=["postgresql", "sqlite"])
def engine(request: pytest.FixtureRequest, tmp_path: Path) -> Engine:
    if request.param == "postgresql":
        engine: Engine = request.getfixturevalue("postgres_engine")
        return engine
    return create_engine(f"sqlite:///{tmp_path / 'corral.db'}")


def test_credentials_round_trip_encrypted(engine: Engine) -> None:
    store = SqlCredentialStore(engine)
    store.create_table()
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
