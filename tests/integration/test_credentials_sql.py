"""The SQL credential store on real PostgreSQL and on SQLite."""

from __future__ import annotations

import uuid

import pytest
from sqlalchemy import Engine, text
from typer.testing import CliRunner

from corral.cli.app import app
from corral.providers.credentials import CredentialResolver
from corral.shared.runtime import Runtime
from corral.shared.settings import CoreSettings
from corral.shared.store.credential_store import SqlCredentialStore
from corral.shared.store.db import Database


@pytest.fixture(params=["postgresql", "sqlite"])
def engine(request: pytest.FixtureRequest) -> Engine:
    db: Database = request.getfixturevalue(
        "pg_db" if request.param == "postgresql" else "sqlite_db"
    )
    return db.engine


def test_credentials_round_trip_encrypted(engine: Engine) -> None:
    store = SqlCredentialStore(engine)
    org = f"org-{uuid.uuid4().hex[:12]}"
    resolver = CredentialResolver(
        store, secret_key="tests-only-key-A1b2C3d4E5f6G7h8J9k0", environ={}
    )
    resolver.put(org, "e2b", "first-secret")
    resolver.put(org, "e2b", "second-secret")  # replaces, does not duplicate

    assert resolver.resolve(org, "e2b").get_secret_value() == "second-secret"
    with engine.connect() as connection:
        rows = connection.execute(
            text("select ciphertext from provider_credentials where org_id = :org"), {"org": org}
        ).all()
    assert len(rows) == 1
    assert b"second-secret" not in bytes(rows[0][0])


def test_the_cli_stores_with_the_deployments_key_and_a_worker_reads_it(
    sqlite_db: Database, monkeypatch: pytest.MonkeyPatch
) -> None:
    # `corral credentials set` and a worker's runtime both take CORRAL_SECRET_KEY from the
    # deployment's settings: what one stores, the other decrypts.
    monkeypatch.setenv("CORRAL_DATABASE_URL", str(sqlite_db.engine.url))
    monkeypatch.setenv("CORRAL_SECRET_KEY", "tests-only-key-Z9y8X7w6V5u4T3s2R1q0")
    result = CliRunner().invoke(
        app, ["credentials", "set", "--org", "acme", "--provider", "e2b"], input="cli-secret\n"
    )
    assert result.exit_code == 0, result.output
    runtime = Runtime(settings=CoreSettings(), db=sqlite_db)
    resolver = runtime.provider("e2b").credentials
    assert resolver is not None
    assert resolver.resolve("acme", "e2b").get_secret_value() == "cli-secret"
