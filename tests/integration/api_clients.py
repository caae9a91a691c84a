"""The api app on real PostgreSQL with settings of a test's choosing (the ``make_client``
fixture, registered in this folder's conftest), and a runner session."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import ExitStack
from typing import Any

import pytest
from fastapi.routing import APIRoute
from fastapi.testclient import TestClient
from pydantic import SecretStr

from corral.scheduler.api.app import create_app
from corral.shared import runtime
from corral.shared.broker import celery_app
from corral.shared.settings import CoreSettings
from corral.shared.store.db import Database
from tests.integration.test_api import ADMIN, awaiting_item

ClientFactory = Callable[..., TestClient]


@pytest.fixture
def make_client(pg_db: Database, postgres_database_url: str) -> Iterator[ClientFactory]:
    """``make_client(**settings)``: the api app (in a TestClient) with those settings."""
    with ExitStack() as stack:

        def make(*, raise_server_exceptions: bool = True, **overrides: Any) -> TestClient:
            settings = CoreSettings(
                database_url=postgres_database_url,
                admin_token=SecretStr(ADMIN),
                broker_url="memory://",
                **overrides,
            )
            celery_app.configure(settings)  # tasks the api sends stay in this process
            runtime.install(runtime.Runtime(settings=settings, db=pg_db))
            client = TestClient(create_app(), raise_server_exceptions=raise_server_exceptions)
            return stack.enter_context(client)

        yield make
    runtime.reset()


def runner_headers(client: TestClient, db: Database, org: str) -> tuple[str, dict[str, str]]:
    """A claimed work item of ``org`` and its runner session's headers."""
    item_id, token = awaiting_item(db, org)
    registered = client.post("/v1/runner/register", json={"token": token})
    assert registered.status_code == 200, registered.text
    headers = {"Authorization": f"Bearer {registered.json()['session_token']}"}
    assert client.post("/v1/runner/claim", json={}, headers=headers).status_code == 200
    return item_id, headers


def api_routes(routes: list[Any]) -> list[APIRoute]:
    """Every api route, those of included routers too: FastAPI 0.165 keeps an included
    router as one entry (its ``original_router``) where older releases copied its routes."""
    found: list[APIRoute] = []
    for route in routes:
        if isinstance(route, APIRoute):
            found.append(route)
        elif (included := getattr(route, "original_router", None)) is not None:
            found += api_routes(list(included.routes))
    return found
