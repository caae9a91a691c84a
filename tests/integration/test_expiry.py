"""A message's own expires_at, on SQLite and PostgreSQL: both intake paths store it; one
already past is a dispatch error ``expired`` and a naive one an invalid message, each
naming the field; an item not final by it fails as ``expired`` through the reaper's expiry
rule whatever state it waits in (its slot given back), and routing never routes one."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import select, update

from corral.providers.local.provider import LocalProvider
from corral.scheduler.batch import Taken, accept_batch
from corral.scheduler.consumer import Intake, IntakeConfig
from corral.scheduler.inbox_redis import RedisInbox
from corral.scheduler.intake import take_dispatch, take_one
from corral.shared import runtime
from corral.shared.broker import celery_app
from corral.shared.messages import DispatchRequest
from corral.shared.runtime import Runtime
from corral.shared.settings import CoreSettings
from corral.shared.store.db import Database, utcnow
from corral.shared.store.models import LifecycleEvent, Pool, WorkItem
from corral.worker.maintenance import redrive
from corral.worker.reaper import sweep
from corral.worker.sweep_lock import sweep_lock
from tests.acceptance.stack import delete_broker_keys
from tests.integration.api_clients import ClientFactory
from tests.integration.reaping import reaped_world
from tests.integration.test_api import admin_headers
from tests.seeding import org_with_pool


@pytest.fixture
def rt(own_db: Database, tmp_path: Path) -> Runtime:
    """A runtime on a database of the test's own, SQLite then PostgreSQL."""
    return Runtime(settings=CoreSettings(state_dir=tmp_path, broker_url="memory://"), db=own_db)


def _message(org: str, **fields: Any) -> dict[str, Any]:
    work = {"kind": "shell", "command": "true"}
    return {"org": org, "project": "web", "profile": "default", "work": work, **fields}


def _item(db: Database, item_id: str) -> WorkItem:
    with db.session() as session:
        item = session.get_one(WorkItem, item_id)
        session.expunge(item)
        return item


def _slots(db: Database, org: str) -> int:
    with db.session() as session:
        return session.get_one(Pool, f"pool-{org}").slots_in_use


def _expire_now(db: Database, item_id: str) -> None:
    """Move the item's expiry to a second ago (no waiting for it)."""
    with db.session() as session:
        session.execute(
            update(WorkItem)
            .where(WorkItem.id == item_id)
            .values(expires_at=utcnow() - timedelta(seconds=1))
        )


def test_both_intake_paths_store_the_expiry_as_an_instant_in_utc(rt: Runtime) -> None:
    org = org_with_pool(rt.db, "exp")
    later = datetime.now(UTC).replace(microsecond=0) + timedelta(hours=1)
    offset = later.astimezone(timezone(timedelta(hours=2))).isoformat()  # the same instant
    request = DispatchRequest.model_validate(_message(org, expires_at=offset))
    [batched] = accept_batch(rt.db, [request], actor="test", settings=rt.settings)
    single, _ = take_one(rt.db, request.model_copy(), actor="test", settings=rt.settings)
    for item_id in (batched.item_id, single.item_id):
        item = _item(rt.db, item_id)
        assert (item.state, item.expires_at) == ("routed", later)
        assert item.payload["expires_at"] == later.isoformat().replace("+00:00", "Z")


def test_a_message_past_its_expiry_is_a_dispatch_error_expired_on_both_paths(
    rt: Runtime,
) -> None:
    org = org_with_pool(rt.db, "exp")
    past = (datetime.now(UTC) - timedelta(seconds=5)).isoformat()
    request = DispatchRequest.model_validate(_message(org, expires_at=past))
    [batched] = accept_batch(rt.db, [request], actor="test", settings=rt.settings)
    single, outcome = take_one(rt.db, request.model_copy(), actor="test", settings=rt.settings)
    assert outcome.queue is None  # nothing to provision
    for item_id in (batched.item_id, single.item_id):
        item = _item(rt.db, item_id)
        assert (item.state, item.error_code, item.pool_id) == ("dispatch_error", "expired", None)
        assert item.expires_at is not None and (item.error_message or "").startswith(
            "expires_at: the message's own expiry"
        )
    assert _slots(rt.db, org) == 0


def test_a_celery_message_with_a_naive_or_numeric_expiry_is_an_invalid_message_naming_it(
    rt: Runtime,
) -> None:
    org = org_with_pool(rt.db, "exp")
    for number, value in enumerate(["2031-02-03T04:05:06", 1_900_000_000, "1900000000"]):
        item_id = take_dispatch(
            rt.db,
            [_message(org, expires_at=value)],
            {},
            task_id=f"task-naive-{number}",
            actor="test",
            settings=rt.settings,
        )
        item = _item(rt.db, item_id)
        assert (item.state, item.error_code) == ("dispatch_error", "invalid_message")
        assert "expires_at: " in (item.error_message or "")
        assert "2031" not in (item.error_message or "")  # the value is never echoed
    # A datetime a Celery sender passed as one arrives in kombu's JSON form: it is read.
    sent = {"__type__": "datetime", "__value__": "2099-01-01T00:00:00+00:00"}
    item_id = take_dispatch(
        rt.db, [_message(org, expires_at=sent)], {}, task_id="t", actor="test", settings=rt.settings
    )
    assert _item(rt.db, item_id).expires_at == datetime(2099, 1, 1, tzinfo=UTC)


def _one_routed_one_waiting(rt: Runtime) -> tuple[str, Taken, Taken]:
    """An org with one slot, and two items expiring in an hour: the first routed, the
    second waiting for its slot."""
    org = org_with_pool(rt.db, "exp", max_concurrent=1)
    later = (datetime.now(UTC) + timedelta(hours=1)).isoformat()
    first, waiting = accept_batch(
        rt.db,
        [DispatchRequest.model_validate(_message(org, expires_at=later)) for _ in range(2)],
        actor="test",
        settings=rt.settings,
    )
    return org, first, waiting


def test_an_item_waiting_for_capacity_past_its_expiry_fails_as_expired(rt: Runtime) -> None:
    org, first, waiting = _one_routed_one_waiting(rt)
    assert [_item(rt.db, t.item_id).state for t in (first, waiting)] == [
        "routed",
        "waiting_capacity",
    ]
    assert sweep(rt, sweep_lock(rt.db, rt.settings)).expired == []  # not yet
    _expire_now(rt.db, waiting.item_id)
    report = sweep(rt, sweep_lock(rt.db, rt.settings))
    assert report.expired == [waiting.item_id]
    item = _item(rt.db, waiting.item_id)
    assert (item.state, item.error_code) == ("failed", "expired")
    assert (item.error_message or "").startswith("expires_at: the item was not final by its")
    assert item.error_message.endswith("it was waiting_capacity")  # type: ignore[union-attr]
    assert _item(rt.db, first.item_id).state == "routed"  # not expired: untouched
    assert _slots(rt.db, org) == 1  # the first's, still held; the waiting one held none
    with rt.db.session() as session:
        event = session.scalars(
            select(LifecycleEvent)
            .where(LifecycleEvent.work_item_id == waiting.item_id)
            .order_by(LifecycleEvent.id.desc())
        ).first()
    assert event is not None
    assert (event.from_state, event.to_state, event.detail) == (
        "waiting_capacity",
        "failed",
        "expired",
    )


def test_a_routed_item_past_its_expiry_fails_and_gives_its_slot_back(rt: Runtime) -> None:
    org = org_with_pool(rt.db, "exp", max_concurrent=1)
    later = (datetime.now(UTC) + timedelta(hours=1)).isoformat()
    request = DispatchRequest.model_validate(_message(org, expires_at=later))
    [routed] = accept_batch(rt.db, [request], actor="test", settings=rt.settings)
    assert _slots(rt.db, org) == 1
    _expire_now(rt.db, routed.item_id)
    assert sweep(rt, sweep_lock(rt.db, rt.settings)).expired == [routed.item_id]
    assert (_item(rt.db, routed.item_id).state, _slots(rt.db, org)) == ("failed", 0)
    # A second sweep finds nothing more: the item is final.
    assert sweep(rt, sweep_lock(rt.db, rt.settings)).expired == []


def test_routing_never_routes_an_expired_item(rt: Runtime) -> None:
    org, first, waiting = _one_routed_one_waiting(rt)
    _expire_now(rt.db, waiting.item_id)
    with rt.db.session() as session:  # a slot more: the re-drive would route the waiting one
        session.execute(update(Pool).where(Pool.org_id == org).values(max_concurrent=2))
    report = redrive(rt, actor="test")
    assert [(o.item_id, o.state.value, o.queue) for o in report.routed] == [
        (waiting.item_id, "failed", None)
    ]
    item = _item(rt.db, waiting.item_id)
    assert (item.state, item.error_code, item.pool_id) == ("failed", "expired", None)
    assert (_item(rt.db, first.item_id).state, _slots(rt.db, org)) == ("routed", 1)


def test_a_made_sandbox_of_an_expired_item_is_ended_as_at_its_deadline(
    fresh_pg_url: str, redis_url: str, tmp_path: Path, require_bwrap: str
) -> None:
    # A real local sandbox (bubblewrap) that would sleep for five minutes.
    provider = LocalProvider(
        {
            "root_dir": str(tmp_path / "sandboxes"),
            "isolation": "required",
            "command": ["sleep", "300"],
            "grace_period_s": 1,
        }
    )
    with reaped_world(fresh_pg_url, redis_url, tmp_path, provider) as reaped:
        reaped.rt.settings.resolved_api_socket().parent.mkdir(parents=True, exist_ok=True)
        later = (datetime.now(UTC) + timedelta(hours=1)).isoformat()
        item_id = reaped.dispatch(expires_at=later, resources={"timeout_s": 3600})
        sandbox = reaped.sandbox(item_id)
        [listed] = provider.list_managed()
        assert (sandbox.status, listed.state.value) == ("ready", "running")
        _expire_now(reaped.db, item_id)

        report = reaped.sweep()  # one sweep: the item fails, its sandbox ends

        assert report.expired == [item_id] and report.ended == {"deadline": 1}
        item, ended = reaped.item(item_id), reaped.sandbox(item_id)
        assert (item.state, item.error_code) == ("failed", "expired")
        assert (ended.termination_reason, ended.deadline_at) == ("deadline", item.expires_at)
        assert provider.list_managed() == []  # the process is gone
        assert [cost.sandbox_id for cost in reaped.costs()] == [sandbox.id]  # billed once
        with reaped.db.session() as session:
            assert session.get_one(Pool, "pool-local").slots_in_use == 0


def test_the_http_intake_stores_the_expiry_and_answers_a_past_or_naive_one(
    make_client: ClientFactory, pg_db: Database
) -> None:
    org = org_with_pool(pg_db, "exp")
    client = make_client()
    later = datetime.now(UTC).replace(microsecond=0) + timedelta(hours=1)
    sent = client.post(
        "/v1/dispatch",
        json=_message(org, expires_at=later.isoformat()),
        headers=admin_headers(),
    )
    assert sent.status_code == 202, sent.text
    assert sent.json()["state"] == "routed"
    item_id = sent.json()["id"]
    assert _item(pg_db, item_id).expires_at == later
    shown = client.get(f"/v1/work-items/{item_id}", headers=admin_headers()).json()
    assert shown["timestamps"]["expires_at"] == later.isoformat()

    past = (datetime.now(UTC) - timedelta(minutes=1)).isoformat()
    expired = client.post(
        "/v1/dispatch", json=_message(org, expires_at=past), headers=admin_headers()
    )
    assert expired.status_code == 202, expired.text
    answer = expired.json()
    assert (answer["state"], answer["error"]["code"]) == ("dispatch_error", "expired")
    assert answer["error"]["message"].startswith("expires_at: the message's own expiry")

    naive = client.post(
        "/v1/dispatch",
        json=_message(org, expires_at="2031-02-03T04:05:06"),
        headers=admin_headers(),
    )
    assert naive.status_code == 422, naive.text
    assert naive.json()["error"] == "invalid_message"
    assert "expires_at" in naive.text and "has no UTC offset" in naive.text
    assert "2031-02-03T04:05:06" not in naive.text  # the value is never echoed


def test_the_celery_intake_reads_a_senders_datetime_and_refuses_a_past_or_naive_one(
    pg_db: Database, redis_url: str
) -> None:
    prefix = f"corral-expiry-{uuid.uuid4().hex[:8]}:"
    settings = CoreSettings(broker_url=redis_url, broker_key_prefix=prefix)
    celery_app.configure(settings)
    rt = runtime.install(Runtime(settings=settings, db=pg_db))
    inbox = RedisInbox(redis_url, queue="dispatch", prefix=prefix, limits=settings.message_limits())
    intake = Intake(
        rt, lambda: inbox, config=IntakeConfig(wait_s=0, limits=settings.message_limits())
    )
    org = org_with_pool(pg_db, "exp")
    later = datetime.now(UTC).replace(microsecond=0) + timedelta(hours=1)
    try:
        for key, expires_at in (
            ("as-datetime", later),  # kombu sends it as {"__type__": "datetime", ...}
            ("as-text", later.isoformat()),
            ("past", datetime.now(UTC) - timedelta(minutes=1)),
            ("naive", "2031-02-03T04:05:06"),
        ):
            message = _message(org, idempotency_key=key, expires_at=expires_at)
            celery_app.app.send_task("corral.dispatch", args=[message], queue="dispatch")
        intake.process(inbox, inbox.take(50, wait_s=0))
    finally:
        inbox.close()
        runtime.reset()
        delete_broker_keys(redis_url, prefix)
    with pg_db.session() as session:
        items = {
            item.idempotency_key: (item.state, item.error_code, item.expires_at)
            for item in session.scalars(select(WorkItem).where(WorkItem.org_id == org))
        }
    assert items["as-datetime"] == items["as-text"] == ("routed", None, later)
    assert items["past"][:2] == ("dispatch_error", "expired")
    assert items["naive"] == ("dispatch_error", "invalid_message", None)
