"""Held warm waits (``POST /v1/runner/warm/wait``) on PostgreSQL: the api looks for bound
sandboxes once per ``CORRAL_WARM_POLL_S`` for all its waits together, not once per wait."""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import Engine, event, select, text, update
from sqlalchemy.engine import make_url

from corral.scheduler.api.app import create_app
from corral.shared import runtime
from corral.shared.broker import celery_app
from corral.shared.settings import CoreSettings
from corral.shared.store import warm
from corral.shared.store.db import Database, make_engine, utcnow
from corral.shared.store.models import Sandbox, WarmSandbox, WorkItem
from tests.integration.api_clients import ClientFactory
from tests.integration.test_api import awaiting_item
from tests.seeding import enrolled_warm_sandboxes

POLL_S = 0.05
WAIT_PATH = "/v1/runner/warm/wait"


@dataclass(frozen=True)
class Pool:
    """A pool with an item whose sandbox row awaits a runner (what a warm sandbox is bound
    to), and warm sandboxes of it waiting to be bound: (warm id, channel token) each."""

    id: str
    item_id: str
    sandbox_id: str
    waiting: list[tuple[str, str]]


def warm_pool(db: Database, count: int) -> Pool:
    item_id, _ = awaiting_item(db, f"warmwait-{uuid.uuid4().hex[:8]}")
    with db.session() as session:
        item = session.get(WorkItem, item_id)
        assert item is not None and item.pool_id is not None
        pool_id, org_id = item.pool_id, item.org_id
        sandbox_id = session.scalars(
            select(Sandbox.id).where(Sandbox.work_item_id == item_id)
        ).one()
    waiting = enrolled_warm_sandboxes(
        db, count, pool_id=pool_id, org_id=org_id, provider_id="local"
    )
    return Pool(pool_id, item_id, sandbox_id, waiting)


class Looks:
    """Statements that read the warm sandboxes' table, counted as they are sent."""

    def __init__(self, db: Database) -> None:
        self.count = 0
        self.first_looks = 0  # a wait's first look notes its runner: an UPDATE of its row
        self._lock = threading.Lock()
        self._db = db

    def __enter__(self) -> Looks:
        event.listen(self._db.engine, "before_cursor_execute", self._seen)
        return self

    def __exit__(self, *_: object) -> None:
        event.remove(self._db.engine, "before_cursor_execute", self._seen)

    def _seen(self, *args: Any) -> None:
        statement = args[2]
        with self._lock:
            self.count += "FROM warm_sandboxes" in statement
            self.first_looks += statement.startswith("UPDATE warm_sandboxes SET last_seen_at")


def seen_since(db: Database, pool: Pool, since: datetime) -> bool:
    """Whether the first look of each of the pool's waits has committed: it notes the runner
    (the row's last_seen_at) after ``since``."""
    with db.session() as session:
        seen = session.scalars(
            select(WarmSandbox.last_seen_at).where(
                WarmSandbox.id.in_([warm_id for warm_id, _ in pool.waiting])
            )
        ).all()
    return len(seen) == len(pool.waiting) and all(at is not None and at > since for at in seen)


def end(db: Database, warm_ids: list[str]) -> None:
    with db.session() as session:
        session.execute(
            update(WarmSandbox).where(WarmSandbox.id.in_(warm_ids)).values(state="ended")
        )


def wait_until(condition: Any, what: str, timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


@pytest.fixture
def client(make_client: ClientFactory) -> Iterator[TestClient]:
    yield make_client(warm_wait_s=60, warm_poll_s=POLL_S)


def test_many_held_waits_cost_one_look_per_poll_and_each_answers_when_its_sandbox_is_bound_or_ends(
    client: TestClient, pg_db: Database
) -> None:
    pool = warm_pool(pg_db, 30)
    answered: dict[str, tuple[int, Any]] = {}

    def hold(warm_id: str, channel: str) -> None:
        reply = client.post(WAIT_PATH, json={}, headers={"Authorization": f"Bearer {channel}"})
        answered[warm_id] = (reply.status_code, reply.json())

    with Looks(pg_db) as looks, ThreadPoolExecutor(len(pool.waiting)) as threads:
        held = [threads.submit(hold, *sandbox) for sandbox in pool.waiting]
        wait_until(lambda: looks.first_looks >= len(pool.waiting), "each wait's first look")
        started, before = time.monotonic(), looks.count
        time.sleep(1.0)  # a measurement window: a second of held waits, polled every 50 ms
        held_s, held_looks = time.monotonic() - started, looks.count - before
        assert not answered, "nothing bound or ended yet: every wait is held"
        # Thirty waits, each looking every 50 ms, would be about 600 looks in that second.
        assert held_looks <= held_s / POLL_S + 5, (held_looks, held_s)

        bound = warm.bind(
            pg_db, pool.id, pool.item_id, pool.sandbox_id, revoke_hash="0" * 64, seen_within_s=60
        )
        assert bound is not None
        wait_until(lambda: bound.warm_id in answered, "the bound sandbox's wait to answer")
        status, body = answered[bound.warm_id]
        assert status == 200 and body["registration_token"].startswith("crt_"), body
        assert len(answered) == 1, "only its wait answered; the others are held"

        others = [warm_id for warm_id, _ in pool.waiting if warm_id != bound.warm_id]
        end(pg_db, others[:1])
        wait_until(lambda: others[0] in answered, "the ended sandbox's wait to answer")
        assert len(answered) == 2, "only its wait answered"
        end(pg_db, others[1:])
        for future in held:
            future.result(timeout=30)
    assert {answered[warm_id][0] for warm_id in others} == {401}, "ended: the generic 401"


def test_a_failing_look_is_logged_once_and_the_waits_still_answer_at_their_end(
    make_client: ClientFactory,
    pg_db: Database,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    client = make_client(warm_wait_s=1, warm_poll_s=POLL_S)
    sandboxes = warm_pool(pg_db, 3).waiting
    failed = threading.Event()

    def down(*_: Any) -> set[str]:
        failed.set()
        raise ConnectionError("the database went away")

    monkeypatch.setattr(warm, "still_waiting", down)
    caplog.set_level(logging.WARNING, logger="corral.scheduler.api.warm_api")
    with ThreadPoolExecutor(len(sandboxes)) as pool:
        replies = list(
            pool.map(
                lambda sandbox: client.post(
                    WAIT_PATH, json={}, headers={"Authorization": f"Bearer {sandbox[1]}"}
                ),
                sandboxes,
            )
        )
    assert failed.is_set()
    assert [(r.status_code, r.json()) for r in replies] == [(200, {"registration_token": None})] * 3
    warnings = [r for r in caplog.records if "looking for bound sandboxes failed" in r.message]
    assert len(warnings) == 1, "once per outage, not once per poll"


@contextmanager
def database_down(admin: Engine, url: str) -> Iterator[None]:
    """The database of ``url`` takes no connections and loses those it had, until the end."""
    name = make_url(url).database
    with admin.execution_options(isolation_level="AUTOCOMMIT").connect() as connection:
        connection.execute(text(f'ALTER DATABASE "{name}" WITH ALLOW_CONNECTIONS false'))
        try:
            connection.execute(
                text("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = :n"),
                {"n": name},
            )
            yield
        finally:
            connection.execute(text(f'ALTER DATABASE "{name}" WITH ALLOW_CONNECTIONS true'))


def test_held_waits_are_woken_again_once_the_database_is_back(
    fresh_pg_url: str, postgres_engine: Engine, caplog: pytest.LogCaptureFixture
) -> None:
    settings = CoreSettings(
        database_url=fresh_pg_url, broker_url="memory://", warm_wait_s=60, warm_poll_s=POLL_S
    )
    served, seeded = Database(make_engine(fresh_pg_url)), Database(make_engine(fresh_pg_url))
    celery_app.configure(settings)
    runtime.install(runtime.Runtime(settings=settings, db=served))
    caplog.set_level(logging.WARNING, logger="corral.scheduler.api.warm_api")
    pool = warm_pool(seeded, 3)
    answered: dict[str, tuple[int, Any]] = {}
    try:
        with TestClient(create_app()) as client, ThreadPoolExecutor(3) as threads:

            def hold(warm_id: str, channel: str) -> None:
                headers = {"Authorization": f"Bearer {channel}"}
                reply = client.post(WAIT_PATH, json={}, headers=headers)
                answered[warm_id] = (reply.status_code, reply.json())

            since = utcnow()
            held = [threads.submit(hold, *sandbox) for sandbox in pool.waiting]
            # Committed, not only sent: a look the outage cut short would answer 503.
            wait_until(lambda: seen_since(seeded, pool, since), "each wait's first look")
            with database_down(postgres_engine, fresh_pg_url):
                wait_until(lambda: "bound sandboxes failed" in caplog.text, "a failed look")
                headers = {"Authorization": f"Bearer {pool.waiting[0][1]}"}
                meanwhile = client.post(WAIT_PATH, json={}, headers=headers)
                assert meanwhile.status_code == 503, "a new wait call is not held meanwhile"
            assert not answered, "held through the outage"
            seeded.engine.dispose()  # this test's own connections did not live through it
            bound = warm.bind(
                seeded,
                pool.id,
                pool.item_id,
                pool.sandbox_id,
                revoke_hash="0" * 64,
                seen_within_s=60,
            )
            assert bound is not None
            wait_until(lambda: bound.warm_id in answered, "the bound sandbox's wait to answer")
            status, body = answered[bound.warm_id]
            assert status == 200 and body["registration_token"].startswith("crt_"), body
            assert caplog.text.count("bound sandboxes failed") == 1, "logged once"
            end(seeded, [warm_id for warm_id, _ in pool.waiting if warm_id != bound.warm_id])
            for future in held:
                future.result(timeout=30)
    finally:
        runtime.reset()
        served.dispose()
        seeded.dispose()
