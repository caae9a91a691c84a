"""The api's dispatch writer on PostgreSQL: requests that wait together are written as one
batch, and a batch that cannot be stored whole is taken one request at a time."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from sqlalchemy import event, select
from sqlalchemy.engine import Connection

from corral.scheduler.api.http_errors import ServiceUnavailable
from corral.scheduler.api.http_intake import DispatchWriter
from corral.shared.broker import celery_app
from corral.shared.messages import DispatchRequest
from corral.shared.settings import CoreSettings
from corral.shared.store.db import Database
from corral.shared.store.models import ItemState, Pool, WorkItem
from tests.lock_waits import wait_for_lock_wait
from tests.seeding import SETTINGS, org_with_pool


@pytest.fixture
def org(pg_db: Database) -> str:
    celery_app.configure(CoreSettings(broker_url="memory://"))  # provisions stay in memory
    return org_with_pool(pg_db, "w", max_concurrent=100)


@pytest.fixture
def writer(pg_db: Database) -> DispatchWriter:
    return DispatchWriter(pg_db, SETTINGS, max_batch=100, actor="test")


def _request(org: str, key: str) -> DispatchRequest:
    work = {"kind": "shell", "command": "true"}
    message = {"org": org, "project": "p", "profile": "default", "idempotency_key": key}
    return DispatchRequest.model_validate({**message, "work": work})


@pytest.fixture
def item_inserts(pg_db: Database) -> Iterator[list[str]]:
    """The statements that insert into work_items (on their own or as a CTE of a batch's
    one write) run while the test runs."""
    seen: list[str] = []

    def note(conn: Connection, cursor: Any, statement: str, *args: Any) -> None:
        if "INSERT INTO work_items " in statement:
            seen.append(statement)

    event.listen(pg_db.engine, "before_cursor_execute", note)
    try:
        yield seen
    finally:
        event.remove(pg_db.engine, "before_cursor_execute", note)


def _provision_tasks() -> list[str]:
    """The item ids of the provision tasks published on ``provision.local``."""
    ids = []
    with celery_app.app.connection_for_read() as conn:
        queue = conn.SimpleQueue("provision.local")
        while True:
            try:
                message = queue.get(block=False)
            except queue.Empty:
                return ids
            args, _kwargs, _embed = message.payload  # Celery's message protocol 2
            ids.append(args[0])
            message.ack()


def test_requests_waiting_together_are_one_batch(
    pg_db: Database, org: str, writer: DispatchWriter, item_inserts: list[str]
) -> None:
    with pg_db.session() as holder:
        # While the pool is locked the first batch waits in its transaction; everything
        # submitted meanwhile waits for the writer and must become the next batch, whole.
        holder.execute(select(Pool.id).where(Pool.org_id == org).with_for_update()).all()
        first = writer.submit(_request(org, "k-0"))
        wait_for_lock_wait(pg_db, "the writer's batch")
        rest = [writer.submit(_request(org, f"k-{n}")) for n in range(1, 20)]
        assert not first.done()
    answers = [first.result(timeout=30)] + [f.result(timeout=30) for f in rest]
    assert all(answer.created for answer in answers)
    assert len(item_inserts) == 2, "20 requests: one batch of 1, then one of 19"
    with pg_db.session() as session:
        states = session.scalars(select(WorkItem.state).where(WorkItem.org_id == org)).all()
    assert sorted(states) == [ItemState.ROUTED.value] * 20
    # The memory broker is the process's: other tests' provisions may wait there too.
    ours = {a.item_id for a in answers}
    assert sorted(t for t in _provision_tasks() if t in ours) == sorted(ours)


def test_a_key_another_replica_wrote_a_moment_earlier_fails_nothing_else(
    pg_db: Database, org: str, writer: DispatchWriter
) -> None:
    # Another replica's transaction has written key k-1 but not committed: the writer's
    # batch does not see it, waits on the unique index, and fails when it commits.
    other: list[str] = []
    with pg_db.session() as replica:
        replica.add(
            WorkItem(
                id=f"wi-{uuid.uuid4().hex}",
                org_id=org,
                project_id="p",
                idempotency_key="k-1",
                profile="default",
                payload=_request(org, "k-1").model_dump(mode="json"),
                state=ItemState.RECEIVED.value,
            )
        )
        replica.flush()
        other.extend(replica.scalars(select(WorkItem.id).where(WorkItem.org_id == org)))
        answers = [writer.submit(_request(org, key)) for key in ("k-0", "k-1", "k-2")]
        wait_for_lock_wait(pg_db, "the writer's batch")
    first, clash, third = (a.result(timeout=30) for a in answers)
    assert (clash.item_id, clash.created) == (other[0], False)  # the replica's item, answered 200
    assert first.created and third.created
    with pg_db.session() as session:
        keys = session.scalars(select(WorkItem.idempotency_key).where(WorkItem.org_id == org))
        assert sorted(keys) == ["k-0", "k-1", "k-2"]


def test_a_batch_that_fails_unexpectedly_answers_each_request_503(
    pg_db: Database, org: str, writer: DispatchWriter, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(batch: object) -> None:
        raise AssertionError("a bug in the writer")

    monkeypatch.setattr(writer, "_write", broken)
    answers = [writer.submit(_request(org, key)) for key in ("k-0", "k-1")]
    for answer in answers:
        with pytest.raises(ServiceUnavailable) as raised:
            answer.result(timeout=30)
        assert (raised.value.status_code, raised.value.error) == (503, "dispatch_unavailable")
    monkeypatch.undo()
    assert writer.submit(_request(org, "k-2")).result(timeout=30).created  # it serves on
