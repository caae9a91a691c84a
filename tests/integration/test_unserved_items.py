"""Nothing waits for ever: an item routed to a queue no worker consumes fails as no_worker
once CORRAL_ROUTED_TTL_S has passed, its slot given back; an item whose queue has a live
consumer, or that was routed within the TTL, is left to wait."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import pytest
from sqlalchemy import update

from corral.scheduler.batch import accept_batch
from corral.shared.messages import DispatchRequest
from corral.shared.runtime import Runtime
from corral.shared.settings import CoreSettings
from corral.shared.store import liveness
from corral.shared.store.db import Database, make_engine, utcnow
from corral.shared.store.models import Pool, QueueConsumer, WorkItem
from corral.worker.maintenance import redrive
from tests.seeding import in_memory_pool

TTL_S = 60


@pytest.fixture(params=["sqlite", "postgresql"])
def rt(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Runtime]:
    if request.param == "sqlite":
        path = tmp_path / "corral.db"
        shutil.copyfile(request.getfixturevalue("sqlite_template"), path)
        url = f"sqlite:///{path}"
    else:
        url = request.getfixturevalue("fresh_pg_url")
    settings = CoreSettings(state_dir=tmp_path, routed_ttl_s=TTL_S)
    db = Database(make_engine(url, settings=settings))
    in_memory_pool(db)
    yield Runtime(settings=settings, db=db)
    db.dispose()


def _routed(rt: Runtime, count: int, *, ago_s: float) -> list[str]:
    message = {
        "org": "acme",
        "project": "web",
        "profile": "default",
        "work": {"kind": "shell", "command": "true"},
    }
    requests = [DispatchRequest.model_validate(message) for _ in range(count)]
    taken = accept_batch(rt.db, requests, actor="test", settings=rt.settings)
    ids = [one.item_id for one in taken]
    with rt.db.session() as session:
        session.execute(
            update(WorkItem)
            .where(WorkItem.id.in_(ids))
            .values(routed_at=utcnow() - timedelta(seconds=ago_s))
        )
    return ids


def _states(rt: Runtime, ids: list[str]) -> list[tuple[str, str | None]]:
    with rt.db.session() as session:
        return [
            (item.state, item.error_code)
            for item in (session.get_one(WorkItem, item_id) for item_id in ids)
        ]


def _slots(rt: Runtime) -> int:
    with rt.db.session() as session:
        return session.get_one(Pool, "pool-mem").slots_in_use


def test_an_item_no_worker_serves_fails_after_the_ttl_and_frees_its_slot(rt: Runtime) -> None:
    old = _routed(rt, 2, ago_s=TTL_S + 5)
    recent = _routed(rt, 1, ago_s=TTL_S - 30)
    assert _slots(rt) == 3
    report = redrive(rt, actor="test")
    assert sorted(report.unserved) == sorted(old)
    assert _states(rt, old) == [("failed", "no_worker")] * 2
    assert _states(rt, recent) == [("routed", None)]
    assert _slots(rt) == 1
    with rt.db.session() as session:
        message = session.get_one(WorkItem, old[0]).error_message or ""
    assert "provision.in-memory" in message and "CORRAL_ROUTED_TTL_S" in message


def test_an_item_whose_queue_has_a_live_worker_waits(rt: Runtime) -> None:
    old = _routed(rt, 1, ago_s=TTL_S + 5)
    liveness.record_consumer(rt.db, ["provision.in-memory"], "worker@host:1", utcnow())
    assert redrive(rt, actor="test").unserved == []
    assert _states(rt, old) == [("routed", None)]
    # A consumer gone quiet for longer than a minute no longer counts.
    with rt.db.session() as session:
        session.execute(update(QueueConsumer).values(seen_at=utcnow() - timedelta(minutes=5)))
    assert redrive(rt, actor="test").unserved == old
