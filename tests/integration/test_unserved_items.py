"""Nothing waits for ever: an item routed to a queue no worker consumes is flagged at once
(its routing event, the api's gauge, `corral status` and the console's overview) and fails
as no_worker once its pool's routed_ttl_s, else CORRAL_ROUTED_TTL_S, has passed, its slot
given back; an item whose queue has a live consumer, or that was routed within the TTL, is
left to wait."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import pytest
from sqlalchemy import select, update

from corral.cli import status
from corral.scheduler.admin import overview
from corral.scheduler.batch import accept_batch
from corral.scheduler.intake import take_one
from corral.shared.messages import DispatchRequest
from corral.shared.runtime import Runtime
from corral.shared.settings import CoreSettings
from corral.shared.store import liveness
from corral.shared.store.db import Database, make_engine, utcnow
from corral.shared.store.models import LifecycleEvent, Pool, QueueConsumer, WorkItem
from corral.worker.maintenance import redrive
from tests.seeding import in_memory_pool
from tests.unit.test_budget_gauges import collected, samples

TTL_S = 60
SHELL = {"kind": "shell", "command": "true"}


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


def _routed(rt: Runtime, count: int, *, ago_s: float, org: str = "acme") -> list[str]:
    message = {
        "org": org,
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


def _pool_ttl(rt: Runtime, pool_id: str, ttl_s: int | None) -> None:
    with rt.db.session() as session:
        session.execute(update(Pool).where(Pool.id == pool_id).values(routed_ttl_s=ttl_s))


def test_a_pools_own_ttl_is_used_when_set_and_the_setting_otherwise(rt: Runtime) -> None:
    # The pool's own TTL, far below the setting's, fails its items; another pool, without
    # one, keeps the setting's: its items as old wait.
    with rt.db.session() as session:
        session.add(
            Pool(
                id="pool-other",
                org_id="other",
                name="mem",
                provider_id="in-memory",
                max_concurrent=10,
                sandbox_config={},
            )
        )
    _pool_ttl(rt, "pool-mem", 2)
    short = _routed(rt, 1, ago_s=3)
    fresh = _routed(rt, 1, ago_s=1)
    other = _routed(rt, 1, ago_s=TTL_S - 5, org="other")
    report = redrive(rt, actor="test")
    assert report.unserved == short
    assert _states(rt, short + fresh + other) == [
        ("failed", "no_worker"),
        ("routed", None),
        ("routed", None),
    ]
    with rt.db.session() as session:
        message = session.get_one(WorkItem, short[0]).error_message or ""
    assert "for 2 s (its pool's routed_ttl_s)" in message
    # 0: this pool's items wait for ever, whatever the setting says.
    _pool_ttl(rt, "pool-mem", 0)
    waiting = _routed(rt, 1, ago_s=TTL_S * 10)
    assert redrive(rt, actor="test").unserved == []
    assert _states(rt, waiting) == [("routed", None)]
    # Cleared, the setting's TTL holds again.
    _pool_ttl(rt, "pool-mem", None)
    assert redrive(rt, actor="test").unserved == waiting


def _routing_detail(rt: Runtime, item_id: str) -> str:
    with rt.db.session() as session:
        detail = session.scalar(
            select(LifecycleEvent.detail).where(
                LifecycleEvent.work_item_id == item_id, LifecycleEvent.to_state == "routed"
            )
        )
    return str(detail)


def test_an_item_routed_to_a_queue_no_worker_consumes_is_flagged_at_once(
    rt: Runtime, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(liveness, "SERVED_CACHE_S", 0.0)  # read the consumers at each routing
    [batched] = _routed(rt, 1, ago_s=0)  # the batch path
    message = {"org": "acme", "project": "web", "profile": "default", "work": SHELL}
    single, _ = take_one(
        rt.db, DispatchRequest.model_validate(message), actor="test", settings=rt.settings
    )  # the one-item path
    for item_id in (batched, single.item_id):
        detail = _routing_detail(rt, item_id)
        assert detail.startswith("pool mem via provision.in-memory (unserved_queue: ")
        assert "no worker said in the last minute that it consumes provision.in-memory" in detail
    gauge = samples(collected(rt.db)["corral_unserved_queue_items"])
    assert gauge == {("provision.in-memory",): 2}
    [queue] = overview.unserved_queues(rt.db)
    assert (queue["queue"], queue["items"]) == ("provision.in-memory", 2)
    assert queue["oldest_routed_at"] is not None
    [line] = _unserved_lines(rt)  # (the broker is the in-memory one `collected` set)
    assert line.startswith("  UNSERVED provision.in-memory: 2 item(s) routed")
    assert "`corral worker --provider in-memory`" in line
    assert overview.unserved_queues(rt.db, "another-org") == []

    # A worker says it consumes the queue: items routed there are not flagged, and nothing
    # waits unserved any more.
    liveness.record_consumer(rt.db, ["provision.in-memory"], "worker@host:1", utcnow())
    [served] = _routed(rt, 1, ago_s=0)
    assert _routing_detail(rt, served) == "pool mem via provision.in-memory"
    assert samples(collected(rt.db)["corral_unserved_queue_items"]) == {}
    assert overview.unserved_queues(rt.db) == []
    assert not [
        line for line in status.render(status.gather(rt, timedelta(hours=1))) if "UNSERVED" in line
    ]


def _unserved_lines(rt: Runtime) -> list[str]:
    """`corral status`'s lines on queues nobody serves."""
    document = status.gather(rt, timedelta(hours=1))
    return [line for line in status.render(document) if "UNSERVED" in line]
