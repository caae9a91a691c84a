"""Held warm waits (``POST /v1/runner/warm/wait``) on PostgreSQL: the api looks for bound
sandboxes once per ``CORRAL_WARM_POLL_S`` for all its waits together, not once per wait."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import event, update

from corral.shared import warm
from corral.shared.db import Database
from corral.shared.models import WarmSandbox
from tests.integration.api_clients import ClientFactory
from tests.seeding import enrolled_warm_sandboxes, org_with_pool

POLL_S = 0.05
WAIT_PATH = "/v1/runner/warm/wait"


def waiting_sandboxes(db: Database, count: int) -> list[tuple[str, str]]:
    """``count`` warm sandboxes of a new org's pool, waiting to be bound: (id, channel)."""
    org = org_with_pool(db, "warmwait-")
    return enrolled_warm_sandboxes(
        db, count, pool_id=f"pool-{org}", org_id=org, provider_id="local"
    )


class Looks:
    """Statements that read the warm sandboxes' table, counted as they are sent."""

    def __init__(self, db: Database) -> None:
        self.count = 0
        self._lock = threading.Lock()
        self._db = db

    def __enter__(self) -> Looks:
        event.listen(self._db.engine, "before_cursor_execute", self._seen)
        return self

    def __exit__(self, *_: object) -> None:
        event.remove(self._db.engine, "before_cursor_execute", self._seen)

    def _seen(self, *args: Any) -> None:
        statement = args[2]
        if "FROM warm_sandboxes" in statement:
            with self._lock:
                self.count += 1


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


def test_many_held_waits_cost_one_look_per_poll_and_each_answers_when_its_sandbox_goes(
    client: TestClient, pg_db: Database
) -> None:
    sandboxes = waiting_sandboxes(pg_db, 30)
    answered: dict[str, float] = {}

    def hold(warm_id: str, channel: str) -> int:
        reply = client.post(WAIT_PATH, json={}, headers={"Authorization": f"Bearer {channel}"})
        answered[warm_id] = time.monotonic()
        return reply.status_code

    with Looks(pg_db) as looks, ThreadPoolExecutor(len(sandboxes)) as pool:
        held = [pool.submit(hold, *sandbox) for sandbox in sandboxes]
        wait_until(lambda: looks.count >= len(sandboxes), "each wait's first look")
        started, before = time.monotonic(), looks.count
        time.sleep(1.0)  # held: a second of polls at 50 ms
        held_s, held_looks = time.monotonic() - started, looks.count - before
        assert not answered, "nothing bound or ended yet: every wait is held"
        # Thirty waits, each looking every 50 ms, would be about 600 looks in that second.
        assert held_looks <= held_s / POLL_S + 5, (held_looks, held_s)
        first = sandboxes[0][0]
        end(pg_db, [first])
        wait_until(lambda: first in answered, "the ended sandbox's wait to answer")
        assert len(answered) == 1, "only its wait answered"
        end(pg_db, [warm_id for warm_id, _ in sandboxes[1:]])
        codes = [future.result(timeout=30) for future in held]
    assert codes == [401] * len(sandboxes), "an ended warm sandbox's wait: the generic 401"


def test_a_failing_look_is_logged_once_and_the_waits_still_answer_at_their_end(
    make_client: ClientFactory,
    pg_db: Database,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    client = make_client(warm_wait_s=1, warm_poll_s=POLL_S)
    sandboxes = waiting_sandboxes(pg_db, 3)
    failed = threading.Event()

    def down(*_: Any) -> set[str]:
        failed.set()
        raise ConnectionError("the database went away")

    monkeypatch.setattr(warm, "still_waiting", down)
    caplog.set_level(logging.WARNING, logger="corral.scheduler.warm_api")
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
