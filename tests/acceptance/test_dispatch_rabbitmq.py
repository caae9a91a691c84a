"""The dispatch flow on RabbitMQ, Celery's most common production broker: api, scheduler,
local worker, maintenance and beat on a vhost of the run's own, with PostgreSQL."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
from celery import Celery
from sqlalchemy import select

from corral.shared.broker import celery_app
from corral.shared.settings import CoreSettings
from corral.shared.store.db import Database, make_engine
from corral.shared.store.models import Sandbox, WorkItem
from corral.worker.sweep_lock import sweep_lock
from tests.acceptance.conftest import shell
from tests.acceptance.rabbitmq import private_vhost
from tests.acceptance.stack import Stack
from tests.conftest import require_bwrap_path

ORG = "rabbit"


@pytest.fixture(scope="module")
def rabbit_stack(postgres_database_url: str) -> Iterator[Stack]:
    require_bwrap_path()
    with private_vhost() as broker_url:
        running = Stack(database_url=postgres_database_url, broker_url=broker_url)
        try:
            running.start()
            running.make_org(ORG)
            yield running
        finally:
            running.stop()


@pytest.fixture(scope="module")
def rabbit_db(rabbit_stack: Stack) -> Iterator[Database]:
    database = Database(make_engine(rabbit_stack.database_url))
    yield database
    database.dispose()


def _sender(stack: Stack) -> Celery:
    return celery_app.configure(CoreSettings(broker_url=stack.broker_url))


def _items_by_key(db: Database, prefix: str, count: int) -> list[str]:
    deadline = time.monotonic() + 60
    while True:
        with db.session() as session:
            found = list(
                session.scalars(
                    select(WorkItem.id).where(WorkItem.idempotency_key.like(f"{prefix}%"))
                )
            )
        if len(found) == count or time.monotonic() > deadline:
            return found
        time.sleep(0.2)


def test_items_over_http_and_celery_all_succeed_with_one_sandbox_each(
    rabbit_stack: Stack, rabbit_db: Database
) -> None:
    ids = []
    for number in range(10):
        status, body = rabbit_stack.request(
            "POST", "/v1/dispatch", shell(ORG, f"echo http-{number}")
        )
        assert status == 202, body
        ids.append(body["id"])
    sender = _sender(rabbit_stack)
    for number in range(10):
        message = shell(ORG, f"echo amqp-{number}", idempotency_key=f"amqp-{number}")
        sender.send_task("corral.dispatch", args=[message])
    celery_ids = _items_by_key(rabbit_db, "amqp-", 10)
    assert len(celery_ids) == 10

    views = rabbit_stack.wait_final(ids + celery_ids)

    assert [v["state"] for v in views] == ["succeeded"] * 20, [v["error"] for v in views]
    deadline = time.monotonic() + 60
    while True:  # each sandbox ended by the normal path, one per item
        with rabbit_db.session() as session:
            rows = list(
                session.scalars(select(Sandbox).where(Sandbox.work_item_id.in_(ids + celery_ids)))
            )
        if all(row.termination_reason for row in rows) or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert sorted(row.work_item_id for row in rows) == sorted(ids + celery_ids)
    assert {row.termination_reason for row in rows} == {"finished"}


def test_a_sweep_is_skipped_while_another_process_holds_the_lock(
    rabbit_stack: Stack, rabbit_db: Database
) -> None:
    """Beat sends a sweep every second; while this test's process holds the sweep lock, the
    maintenance worker's sweeps are skipped, and they run again once it is released."""
    log = rabbit_stack.log_path("maintenance")
    lock = sweep_lock(rabbit_db, CoreSettings(reaper_lock_ttl_s=60))
    rabbit_stack.until(lock.acquire, "the sweep lock was never free")
    try:
        start = log.stat().st_size
        rabbit_stack.until(
            lambda: b"reaper sweep skipped" in log.read_bytes()[start:],
            "no sweep was skipped while the lock was held",
        )
    finally:
        lock.release()
    start = log.stat().st_size
    rabbit_stack.until(
        lambda: b"reaper sweep done" in log.read_bytes()[start:], "no sweep ran after"
    )
