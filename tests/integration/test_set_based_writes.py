"""The set-based writes (corral.shared.store.db.update_each, insert_rows,
corral.shared.store.slots.free_slots) on both databases: PostgreSQL in production, SQLite for
``corral dev``."""

from __future__ import annotations

import uuid
from collections import Counter

import pytest
from sqlalchemy import select

from corral.shared.store.db import Database, insert_rows, update_each
from corral.shared.store.models import Pool
from corral.shared.store.slots import free_slots


@pytest.fixture(params=["sqlite_db", "pg_db"])
def db(request: pytest.FixtureRequest) -> Database:
    found: Database = request.getfixturevalue(request.param)
    return found


def _pools(db: Database, **slots: int) -> dict[str, str]:
    """Pools named after the keywords, with those slots in use; their ids by name."""
    ids = {name: f"pool-{name}-{uuid.uuid4().hex[:8]}" for name in slots}
    with db.session() as session:
        insert_rows(
            session,
            Pool,
            [
                {
                    "id": ids[name],
                    "org_id": "acme",
                    "name": ids[name],
                    "provider_id": "local",
                    "priority": 0,
                    "active": True,
                    "max_concurrent": 10,
                    "sandbox_config": {},
                    "rate_micros": 0,
                    "slots_in_use": used,
                    "billing_model": "wall-clock",
                }
                for name, used in slots.items()
            ],
        )
    return ids


def _read(db: Database, ids: dict[str, str], column: str) -> dict[str, object]:
    with db.session() as session:
        rows = session.execute(
            select(Pool.id, getattr(Pool, column)).where(Pool.id.in_(ids.values()))
        )
        by_id = {pool_id: value for pool_id, value in rows}
    return {name: by_id[pool_id] for name, pool_id in ids.items()}


def test_update_each_gives_each_row_its_values_and_keeps_what_a_row_does_not_name(
    db: Database,
) -> None:
    ids = _pools(db, a=0, b=0, c=0)
    with db.session() as session:
        update_each(
            session,
            Pool.id,
            {
                ids["a"]: {"priority": 7, "billing_model": "fixed"},
                ids["b"]: {"priority": 7, "billing_model": None},
                ids["c"]: {"priority": 7},
            },
        )
        update_each(session, Pool.id, {ids["c"]: {"max_concurrent": 3}})

    assert _read(db, ids, "priority") == {"a": 7, "b": 7, "c": 7}
    assert _read(db, ids, "billing_model") == {"a": "fixed", "b": None, "c": "wall-clock"}
    assert _read(db, ids, "max_concurrent") == {"a": 10, "b": 10, "c": 3}


def test_free_slots_gives_back_each_pools_count_and_never_goes_below_zero(
    db: Database,
) -> None:
    ids = _pools(db, a=5, b=4, c=1, d=4)
    with db.session() as session:
        free_slots(session, Counter({ids["a"]: 2, ids["b"]: 3, ids["c"]: 3}))
    assert _read(db, ids, "slots_in_use") == {"a": 3, "b": 1, "c": 0, "d": 4}
    with db.session() as session:
        free_slots(session, Counter({ids["d"]: 1}))
    assert _read(db, ids, "slots_in_use") == {"a": 3, "b": 1, "c": 0, "d": 3}
