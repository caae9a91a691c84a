"""The api's database gauges survive an unreachable database."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from scheduler.metrics import DatabaseCollector
from shared import runtime
from shared.db import Database, make_engine
from shared.settings import CoreSettings


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
