"""The routing gates' one order, on PostgreSQL: there the batch path routes an unlimited
org's batch on one statement's read (or on the kept configuration), and a limited org's
under its row lock, while the one-item path takes its slot by a guarded update; every case
of tests/unit/test_placement_paths.py gets the same answer from both."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from corral.shared.store.db import Database, make_engine
from corral.shared.store.models import ModelProfile
from tests.unit import test_placement_paths as paths


@pytest.fixture
def db(fresh_pg_url: str) -> Iterator[Database]:
    database = Database(make_engine(fresh_pg_url))
    with database.session() as session:
        session.add(ModelProfile(name="default", model="m", auth_mode="byok"))
    yield database
    database.dispose()


@pytest.mark.parametrize("case", list(paths.CASES))
def test_both_paths_answer_the_same_on_postgresql(db: Database, case: str) -> None:
    paths.test_both_paths_give_an_item_the_same_answer(db, case)
