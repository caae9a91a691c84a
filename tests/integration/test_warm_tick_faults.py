"""Beat's warm tick (corral.warm.tick) when its database fails, on real PostgreSQL
(docs/warm-pools.md): it leaves no half-made rows that keep a pool from filling, and the
next tick fills it.

Each failure is reached for certain. Mid-way: the test holds a stale warm row of the second
pool locked, so the tick waits for it with the first pool's new rows written in its
transaction; its backend is then terminated. At the commit: the tick reaches PostgreSQL
through a loopback proxy that passes its COMMIT on and loses the answer, so the rows are
committed and the tick fails without sending their provision tasks.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import select, text, update
from sqlalchemy.exc import OperationalError

from corral.providers.testing import InMemoryProvider
from corral.scheduler.admin.pools import ProfileCreate, create_profile
from corral.shared import runtime
from corral.shared.runtime import Runtime
from corral.shared.settings import CoreSettings
from corral.shared.store import warm
from corral.shared.store.db import Database, make_engine, utcnow
from corral.shared.store.models import AuthMode, Pool, WarmSandbox
from corral.worker import tasks
from corral.worker.warm import WarmOutcome, provision_warm, warm_tick
from tests.pg_proxy import PostgresProxy

# Ticks go through pools in id order: the first one's new rows are written before the
# second one's stale row is ended.
FIRST, SECOND = "pool-a", "pool-b"


@pytest.fixture
def db(fresh_pg_url: str) -> Iterator[Database]:
    database = Database(make_engine(fresh_pg_url))
    create_profile(database, ProfileCreate(name="default", model="m", auth_mode=AuthMode.BYOK))
    with database.session() as session:
        for pool_id, warm_min in ((FIRST, 2), (SECOND, 1)):
            session.add(
                Pool(
                    id=pool_id,
                    org_id="acme",
                    name=pool_id,
                    provider_id="in-memory",
                    max_concurrent=10,
                    sandbox_config={},
                    warm_min=warm_min,
                )
            )
    yield database
    database.dispose()


def maintenance(db: Database, tmp_path: Path) -> tuple[Runtime, InMemoryProvider]:
    """The maintenance worker's runtime on ``db``, with the in-memory provider."""
    rt = Runtime(settings=CoreSettings(state_dir=tmp_path, broker_url="memory://"), db=db)
    provider = InMemoryProvider()
    rt.use_provider(provider)
    return rt, provider


def rows(db: Database) -> dict[str, WarmSandbox]:
    with db.session() as session:
        found = {row.id: row for row in session.scalars(select(WarmSandbox))}
        session.expunge_all()
    return found


def idle_past_its_ttl(db: Database, worker: tuple[Runtime, InMemoryProvider]) -> str:
    """A warm sandbox of the second pool (the only one keeping any now), made and waiting,
    past its pool's idle TTL: the next tick ends it (``idle_ttl``)."""
    rt, provider = worker
    [(warm_id, _)] = warm.tick(db, boot_timeout_s=300, seen_within_s=60).made
    assert provision_warm(rt, warm_id) is WarmOutcome.MADE
    credential = provider.boxes[warm_id].spec.registration_token
    with db.session() as session:
        assert warm.enrol(session, credential.get_secret_value()) is not None
        session.execute(
            update(WarmSandbox)
            .where(WarmSandbox.id == warm_id)
            .values(ready_at=utcnow() - timedelta(seconds=601))
        )
    return warm_id


def waiting_tick(db: Database) -> tuple[int, bool] | None:
    """The backend of a tick that waits for a warm row's lock, and whether its transaction
    has written anything yet; None while there is none."""
    with db.session() as session:
        found = session.execute(
            text(
                "SELECT pid, backend_xid IS NOT NULL FROM pg_stat_activity "
                "WHERE datname = current_database() AND wait_event_type = 'Lock' "
                "AND state = 'active' AND query LIKE 'UPDATE warm_sandboxes%'"
            )
        ).first()
    return None if found is None else (int(found[0]), bool(found[1]))


def until(condition: Callable[[], Any], what: str, timeout_s: float = 30) -> Any:
    deadline = time.monotonic() + timeout_s
    while not (found := condition()):
        assert time.monotonic() < deadline, what
        time.sleep(0.05)
    return found


def test_a_tick_killed_mid_way_leaves_no_row_and_the_next_tick_fills_both_pools(
    db: Database, tmp_path: Path
) -> None:
    rt, provider = maintenance(db, tmp_path)
    with db.session() as session:  # the first pool keeps none yet
        session.execute(update(Pool).where(Pool.id == FIRST).values(warm_min=0))
    stale = idle_past_its_ttl(db, (rt, provider))
    with db.session() as session:
        session.execute(update(Pool).where(Pool.id == FIRST).values(warm_min=2))

    with db.session() as holder, ThreadPoolExecutor(1) as thread:
        holder.execute(select(WarmSandbox.id).where(WarmSandbox.id == stale).with_for_update())
        ticking: Future[warm.Tick] = thread.submit(warm_tick, rt)
        pid, wrote = until(lambda: waiting_tick(db), "the tick to wait for the stale row")
        assert wrote, "the first pool's new rows are in the tick's transaction"
        with db.session() as session:
            assert session.scalar(text("SELECT pg_terminate_backend(:pid)"), {"pid": pid})
        with pytest.raises(OperationalError):
            ticking.result(timeout=30)
        holder.rollback()

    after = rows(db)
    assert list(after) == [stale], "none of the first pool's rows was kept"
    assert (after[stale].state, after[stale].ended_at) == ("waiting", None)
    assert "terminate" not in provider.methods()

    ticked = warm_tick(rt)  # takes the tick lock: the killed one's went with its backend

    assert [(e.warm_id, e.reason) for e in ticked.ended] == [(stale, "idle_ttl")]
    assert provider.methods().count("terminate") == 1
    after = rows(db)
    booting = {row.id: row.pool_id for row in after.values() if row.state == "booting"}
    assert sorted(booting.values()) == [FIRST, FIRST, SECOND]
    assert sorted(warm_id for warm_id, _ in ticked.made) == sorted(booting)


def test_rows_whose_tick_lost_its_commit_answer_get_their_provisions_at_the_next_tick(
    db: Database, fresh_pg_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    proxy = PostgresProxy()
    through = Database(make_engine(proxy.url(fresh_pg_url)))
    rt, _ = maintenance(through, tmp_path)
    sent: list[tuple[str, list[Any], str]] = []

    def send_task(name: str, args: list[Any], queue: str, **_: Any) -> None:
        sent.append((name, args, queue))

    monkeypatch.setattr(tasks.app, "send_task", send_task)
    runtime.install(rt)
    try:
        proxy.lose_next_commit_answer()
        with pytest.raises(OperationalError):  # the task retries it (DATABASE_DOWN)
            tasks.warm_tick_task()
        assert proxy.lost.is_set()
        committed = {row.id: row.pool_id for row in rows(db).values()}
        assert sorted(committed.values()) == [FIRST, FIRST, SECOND], "the commit was made"
        assert sent == [], "the failed tick sent nothing"

        tasks.warm_tick_task()  # its retry, or beat's next tick
        resent = list(sent)
        tasks.warm_tick_task()  # the sends were noted
    finally:
        runtime.reset()
        through.dispose()
        proxy.close()

    assert set(rows(db)) == set(committed), "no row was added for those"
    assert sorted(args[0] for _, args, _ in resent) == sorted(committed)
    assert {(name, queue) for name, _, queue in resent} == {
        ("corral.warm.provision", "provision.in-memory")
    }
    assert sent == resent, "once sent and noted, not sent again"
    worker, _ = maintenance(db, tmp_path)
    assert [provision_warm(worker, warm_id) for warm_id in committed] == [WarmOutcome.MADE] * 3
