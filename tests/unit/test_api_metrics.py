"""The api's database gauges survive an unreachable database."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from corral.scheduler.api.metrics import DatabaseCollector
from corral.shared import runtime
from corral.shared.settings import CoreSettings
from corral.shared.store.db import Database, make_engine


@pytest.fixture
def unreachable() -> Iterator[None]:
    url = "postgresql+psycopg://nobody@127.0.0.1:1/none"  # nothing listens on port 1
    db = Database(make_engine(url))
    runtime.install(runtime.Runtime(settings=CoreSettings(database_url=url), db=db))
    yield
    runtime.reset()
    db.dispose()


@pytest.mark.usefixtures("unreachable")
def test_a_database_that_cannot_be_read_gives_up_zero_instead_of_failing_the_scrape() -> None:
    metrics = {m.name: m for m in DatabaseCollector().collect()}
    assert [s.value for s in metrics["corral_metrics_database_up"].samples] == [0]
    assert set(metrics) == {"corral_metrics_database_up"}  # nothing made up


@pytest.mark.usefixtures("unreachable")
def test_metrics_are_served_on_their_own_listener_and_not_by_the_api() -> None:
    from urllib.request import urlopen

    from fastapi.testclient import TestClient

    from corral.scheduler.api.app import create_app
    from corral.scheduler.api.metrics import start_metrics_server

    server = start_metrics_server("127.0.0.1", 0)
    try:
        with urlopen(f"http://127.0.0.1:{server.server_address[1]}/metrics", timeout=10) as answer:
            text = answer.read().decode()
    finally:
        server.shutdown()
        server.server_close()
    assert "corral_metrics_database_up 0.0" in text  # the database gauges
    assert "corral_dispatch_to_provisioned_seconds" in text  # the process's own histograms
    with TestClient(create_app()) as client:
        assert client.get("/metrics").status_code == 404
