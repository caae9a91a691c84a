"""The api reaches its process's runtime through one FastAPI dependency, ``get_runtime``:
a test that overrides it has the routes, the middleware and the JSON reading use its
runtime, and the process's runtime is never consulted."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from pydantic import SecretStr

from corral.scheduler.admin.pools import ProfileCreate, create_profile
from corral.scheduler.api.app import create_app
from corral.scheduler.api.process_runtime import get_runtime
from corral.shared import runtime
from corral.shared.settings import CoreSettings
from corral.shared.store.db import Database
from corral.shared.store.models import AuthMode


@pytest.fixture
def process_database(tmp_path: Path) -> Iterator[Path]:
    """The file of the process's own runtime's database (another admin token too): it is
    made when the database is first opened."""
    settings = CoreSettings(state_dir=tmp_path / "process", admin_token=SecretStr("process-token"))
    installed = runtime.install(runtime.Runtime.from_settings(settings))
    try:
        yield tmp_path / "process" / "corral.db"
    finally:
        runtime.reset()
        installed.db.dispose()


def test_the_routes_use_the_runtime_that_overrides_the_dependency(
    sqlite_db: Database, process_database: Path
) -> None:
    settings = CoreSettings(
        database_url=str(sqlite_db.engine.url),
        admin_token=SecretStr("override-token"),
        api_body_limit_default=200,
        api_json_max_depth=3,
    )
    overriding = runtime.Runtime(settings=settings, db=sqlite_db)
    create_profile(sqlite_db, ProfileCreate(name="only-here", model="m", auth_mode=AuthMode.BYOK))
    app = create_app()
    app.dependency_overrides[get_runtime] = lambda: overriding
    with TestClient(app) as client:
        admin = {"Authorization": "Bearer override-token"}
        listed = client.get("/v1/admin/profiles", headers=admin)
        assert listed.status_code == 200, listed.text
        assert [p["name"] for p in listed.json()["profiles"]] == ["only-here"]
        # The process's token means nothing to an api handed another runtime.
        process_admin = {"Authorization": "Bearer process-token"}
        assert client.get("/v1/admin/profiles", headers=process_admin).status_code == 401
        # The body limit (middleware) and the JSON depth (request reading) are its too.
        large = {"name": "x" * 300, "model": "m", "auth_mode": "byok"}
        assert client.post("/v1/admin/profiles", json=large, headers=admin).status_code == 413
        deep = {"name": "deep", "model": "m", "auth_mode": "byok", "a": [[[[1]]]]}
        refused = client.post("/v1/admin/profiles", json=deep, headers=admin)
        assert refused.status_code == 422 and "nested" in refused.text
        assert client.get("/readyz").json()["database"] == "ok"
    assert not process_database.exists()  # the process's runtime was never asked
