"""The outcome outbox on a real (SQLite) database: written with an item's end, delivered
through a sink at least once, retried with back-off, given up and kept; replies added by
later messages; the ``celery`` sink against Celery's own result backend API."""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from datetime import timedelta
from typing import Any

import pytest
from celery import Celery
from prometheus_client import REGISTRY
from sqlalchemy import select

from corral.providers.base import SandboxState
from corral.scheduler.admin.views import item_of_task, task_of_item
from corral.scheduler.intake import Origin, record_invalid, take_dispatch
from corral.shared.broker.callbacks import Callback, Reply
from corral.shared.broker.results import ItemDispatchError, ItemFailedError
from corral.shared.settings import CoreSettings
from corral.shared.store import outbox
from corral.shared.store.db import Database, utcnow
from corral.shared.store.lifecycle import transition
from corral.shared.store.models import (
    CostEvent,
    ItemState,
    OutcomeOutbox,
    Pool,
    Sandbox,
    WorkItem,
    WorkItemLog,
)
from corral.worker.outcome_delivery import deliver_due
from corral.worker.outcome_sinks.celery_result import CeleryResultSink
from corral.worker.outcome_sinks.testing import RecordingSink

SETTINGS = CoreSettings(outcome_cost_wait_s=30, outcome_max_attempts=3)
WITH_RESULTS = CoreSettings(result_backend="redis://127.0.0.1:6379/9")
ACTOR = "test"


def _reply(task_id: str) -> dict[str, Any]:
    return Reply(task_id, link=(Callback("up.done"),), link_error=(Callback("up.err"),)).as_json()


def _item(db: Database, *, state: ItemState = ItemState.RUNNING, sandbox: bool = False) -> str:
    """An item of org acme made by a Celery message (its task id: ``task-<item>``)."""
    suffix = uuid.uuid4().hex[:10]
    item_id = f"wi-{suffix}"
    with db.session() as session:
        if session.get(Pool, "pool-o") is None:
            session.add(
                Pool(id="pool-o", org_id="acme", name="o", provider_id="local", max_concurrent=9)
            )
            session.flush()
        session.add(
            WorkItem(
                id=item_id,
                org_id="acme",
                project_id="web",
                payload={},
                state=state.value,
                pool_id="pool-o",
                attempts=1,
                task_id=f"task-{suffix}",
                replies=[_reply(f"task-{suffix}")],
            )
        )
        session.flush()
        if sandbox:
            session.add(
                Sandbox(
                    id=f"sb-{suffix}",
                    work_item_id=item_id,
                    attempt=1,
                    org_id="acme",
                    pool_id="pool-o",
                    provider_id="local",
                    status=SandboxState.RUNNING.value,
                )
            )
    return item_id


def _end(db: Database, item_id: str, to: ItemState, **columns: Any) -> None:
    with db.session() as session:
        item = session.get_one(WorkItem, item_id, with_for_update=True)
        for name, value in columns.items():
            setattr(item, name, value)
        transition(session, item, to, actor=ACTOR)


def _rows(db: Database, item_id: str) -> list[OutcomeOutbox]:
    with db.session() as session:
        query = select(OutcomeOutbox).where(OutcomeOutbox.work_item_id == item_id)
        rows = list(session.scalars(query.order_by(OutcomeOutbox.id)))
        session.expunge_all()
        return rows


def _delivered(sink: str = "celery") -> float:
    labels = {"sink": sink, "result": "delivered"}
    return REGISTRY.get_sample_value("corral_outcome_deliveries_total", labels) or 0.0


def test_an_item_owes_its_reply_from_its_end_and_the_sink_gets_its_final_record(
    sqlite_db: Database,
) -> None:
    item_id = _item(sqlite_db)
    with sqlite_db.session() as session:
        session.add_all(
            WorkItemLog(work_item_id=item_id, stream="stdout", line=f"line {n}") for n in range(30)
        )
    assert _rows(sqlite_db, item_id) == []
    _end(sqlite_db, item_id, ItemState.SUCCEEDED, exit_code=0, result={"answer": 42})
    [row] = _rows(sqlite_db, item_id)
    assert (row.sink, row.target, row.attempts) == ("celery", _reply(f"task-{item_id[3:]}"), 0)
    sink, before = RecordingSink(), _delivered()
    report = deliver_due(sqlite_db, {"celery": sink}, SETTINGS)
    assert report.summary() == {
        "delivered": 1,
        "waiting": 0,
        "given_back": 0,
        "retried": 0,
        "given_up": 0,
    }
    [(target, record)] = sink.delivered
    assert target == row.target
    assert record["id"] == item_id and record["state"] == "succeeded"
    assert (record["exit_code"], record["result"], record["error"]) == (0, {"answer": 42}, None)
    assert record["task_id"] == f"task-{item_id[3:]}"
    assert [line["line"] for line in record["output"]["tail"]] == [
        f"line {n}" for n in range(10, 30)
    ]
    assert record["cost"] == {
        "amount_micros": 0,
        "amount": "0.000000",
        "seconds": 0.0,
        "sandboxes": 0,
        "settled": True,
    }
    assert _rows(sqlite_db, item_id) == [] and _delivered() == before + 1
    assert deliver_due(sqlite_db, {"celery": sink}, SETTINGS).summary()["delivered"] == 0


def test_a_record_waits_for_its_sandboxes_cost_a_while_then_goes_without_it(
    sqlite_db: Database,
) -> None:
    item_id = _item(sqlite_db, sandbox=True)
    _end(sqlite_db, item_id, ItemState.FAILED, error_code="work_failed", error_message="exit 3")
    sink = RecordingSink()
    assert deliver_due(sqlite_db, {"celery": sink}, SETTINGS).waiting == [
        _rows(sqlite_db, item_id)[0].id
    ]
    assert sink.delivered == [] and _rows(sqlite_db, item_id)[0].attempts == 0
    later = utcnow() + timedelta(seconds=31)
    assert len(deliver_due(sqlite_db, {"celery": sink}, SETTINGS, now=later).delivered) == 1
    [(_, record)] = sink.delivered
    assert record["cost"]["settled"] is False and record["cost"]["sandboxes"] == 1
    assert record["error"] == {"code": "work_failed", "message": "exit 3"}


def test_a_billed_sandbox_settles_the_record_at_once(sqlite_db: Database) -> None:
    item_id = _item(sqlite_db, sandbox=True)
    now = utcnow()
    with sqlite_db.session() as session:
        sandbox = session.scalars(select(Sandbox).where(Sandbox.work_item_id == item_id)).one()
        sandbox.status, sandbox.terminated_at = SandboxState.TERMINATED.value, now
        session.add(
            CostEvent(
                sandbox_id=sandbox.id,
                work_item_id=item_id,
                org_id="acme",
                project_id="web",
                pool_id="pool-o",
                provider_id="local",
                started_at=now,
                ended_at=now,
                seconds=2.5,
                billing_model="wall_clock",
                amount_micros=1_500_000,
            )
        )
    _end(sqlite_db, item_id, ItemState.SUCCEEDED, exit_code=0)
    sink = RecordingSink()
    deliver_due(sqlite_db, {"celery": sink}, SETTINGS)
    [(_, record)] = sink.delivered
    assert record["cost"] == {
        "amount_micros": 1_500_000,
        "amount": "1.500000",
        "seconds": 2.5,
        "sandboxes": 1,
        "settled": True,
    }


def test_a_failed_delivery_backs_off_then_is_given_up_and_kept(sqlite_db: Database) -> None:
    item_id = _item(sqlite_db)
    _end(sqlite_db, item_id, ItemState.CANCELLED, error_code="cancelled")
    sink = RecordingSink(failures=10)
    now = utcnow()
    assert len(deliver_due(sqlite_db, {"celery": sink}, SETTINGS, now=now).retried) == 1
    [row] = _rows(sqlite_db, item_id)
    assert row.attempts == 1 and row.due_at == now + timedelta(seconds=2)
    assert row.last_error == "OutcomeDeliveryError: the in-memory sink was told to fail"
    assert deliver_due(sqlite_db, {"celery": sink}, SETTINGS, now=now).summary()["retried"] == 0
    later = now + timedelta(seconds=2)
    assert len(deliver_due(sqlite_db, {"celery": sink}, SETTINGS, now=later).retried) == 1
    assert _rows(sqlite_db, item_id)[0].due_at == later + timedelta(seconds=4)
    last = later + timedelta(seconds=4)
    assert len(deliver_due(sqlite_db, {"celery": sink}, SETTINGS, now=last).given_up) == 1
    [row] = _rows(sqlite_db, item_id)
    assert (row.attempts, row.failed_at) == (3, last)
    far = last + timedelta(days=1)
    assert deliver_due(sqlite_db, {"celery": sink}, SETTINGS, now=far).summary()["given_up"] == 0
    assert outbox.counts(sqlite_db)[("celery", "failed")] >= 1
    assert outbox.prune(sqlite_db, before=far) >= 1 and _rows(sqlite_db, item_id) == []


class _SlowSink(RecordingSink):
    """A sink each of whose deliveries takes ``seconds`` on a clock of its own."""

    def __init__(self, seconds: float) -> None:
        super().__init__()
        self.seconds, self.now = seconds, 0.0

    def deliver(self, target: Mapping[str, Any], record: Mapping[str, Any]) -> None:
        super().deliver(target, record)
        self.now += self.seconds

    def clock(self) -> float:
        return self.now


def test_a_run_gives_back_what_it_did_not_reach_before_its_claim_ends(
    sqlite_db: Database,
) -> None:
    items = [_item(sqlite_db) for _ in range(3)]
    for item_id in items:
        _end(sqlite_db, item_id, ItemState.SUCCEEDED)
    short = CoreSettings(outcome_claim_s=15)  # 3 s to start deliveries in: 12 s in reserve
    sink, now = _SlowSink(seconds=2), utcnow()
    report = deliver_due(sqlite_db, {"celery": sink}, short, now=now, clock=sink.clock)
    assert (len(report.delivered), len(report.given_back)) == (2, 1)  # started at 0 s and 2 s
    [kept] = [row for item_id in items for row in _rows(sqlite_db, item_id)]
    assert (kept.attempts, kept.due_at, kept.last_error) == (0, now, None)  # due again at once
    assert len(deliver_due(sqlite_db, {"celery": RecordingSink()}, short).delivered) == 1


def test_a_row_no_sink_of_this_process_delivers_is_retried_saying_why(
    sqlite_db: Database,
) -> None:
    item_id = _item(sqlite_db)
    _end(sqlite_db, item_id, ItemState.SUCCEEDED, exit_code=0)
    assert len(deliver_due(sqlite_db, {}, SETTINGS).retried) == 1
    assert "is CORRAL_RESULT_BACKEND set?" in (_rows(sqlite_db, item_id)[0].last_error or "")


def test_a_later_message_naming_the_item_is_owed_a_reply_of_its_own(sqlite_db: Database) -> None:
    item_id = _item(sqlite_db)
    outbox.add_reply(sqlite_db, item_id, _reply("task-later"))
    outbox.add_reply(sqlite_db, item_id, _reply("task-later"))  # its second delivery
    assert _rows(sqlite_db, item_id) == []
    _end(sqlite_db, item_id, ItemState.FAILED, error_code="work_failed")
    owed = [row.target["task_id"] for row in _rows(sqlite_db, item_id)]
    assert owed == [f"task-{item_id[3:]}", "task-later"]
    outbox.add_reply(sqlite_db, item_id, _reply("task-after-its-end"))  # owed at once
    outbox.add_reply(sqlite_db, item_id, _reply("task-later"))
    owed = [row.target["task_id"] for row in _rows(sqlite_db, item_id)]
    assert owed == [f"task-{item_id[3:]}", "task-later", "task-after-its-end"]


def test_an_invalid_message_is_found_by_its_own_key_and_owes_its_result(
    sqlite_db: Database,
) -> None:
    message = {"org": "acme", "idempotency_key": "mine-1", "env": {"A": "x\x00y"}}
    origin = Origin("task-inv", Reply("task-inv"))
    item_id = record_invalid(
        sqlite_db,
        message,
        "env.*: no NUL",
        actor=ACTOR,
        idempotency_key="celery:task-inv",
        origin=origin,
    )
    again = record_invalid(
        sqlite_db,
        message,
        "env.*: no NUL",
        actor=ACTOR,
        idempotency_key="celery:task-inv",
        origin=origin,
    )
    assert again == item_id
    with sqlite_db.session() as session:
        item = session.get_one(WorkItem, item_id)
        assert (item.idempotency_key, item.state, item.task_id) == (
            "mine-1",
            "dispatch_error",
            "task-inv",
        )
    [row] = _rows(sqlite_db, item_id)
    assert row.target == {"task_id": "task-inv", "link": [], "link_error": []}
    assert (
        item_of_task(sqlite_db, "task-inv") == item_id
        and task_of_item(sqlite_db, item_id) == "task-inv"
    )
    assert item_of_task(sqlite_db, "a\x00b") is None and item_of_task(sqlite_db, "nobody") is None


def _dispatched(db: Database, task_id: str, settings: CoreSettings, callbacks: Any) -> WorkItem:
    """The item a ``corral.dispatch`` of org acme with the profile ``ghost`` (none such: a
    dispatch error) made, sent as task ``task_id`` with ``callbacks`` as its link."""
    work = {"kind": "shell", "command": "true"}
    message = {"org": "acme", "project": "web", "profile": "ghost", "work": work}
    item_id = take_dispatch(
        db, [message], {}, task_id=task_id, actor=ACTOR, settings=settings, callbacks=callbacks
    )
    with db.session() as session:
        item = session.get_one(WorkItem, item_id)
        session.expunge(item)
        return item


def test_refused_callbacks_make_the_message_invalid_and_it_is_still_answered(
    sqlite_db: Database,
) -> None:
    bad = [{"task": "corral.provision", "args": ["wi-x"], "kwargs": {}, "options": {}}]
    item = _dispatched(sqlite_db, "task-bad", WITH_RESULTS, bad)
    assert (item.state, item.error_code) == ("dispatch_error", "invalid_message")
    said = item.error_message or ""
    assert "link[0]: a callback may not name corral's or Celery's tasks" in said
    assert "wi-x" not in said
    assert item.replies == [{"task_id": "task-bad", "link": [], "link_error": []}]
    assert len(_rows(sqlite_db, item.id)) == 1


def test_without_a_result_backend_nothing_is_owed(sqlite_db: Database) -> None:
    callbacks = [{"task": "up.done", "args": [], "kwargs": {}, "options": {}}]
    item = _dispatched(sqlite_db, "task-none", SETTINGS, callbacks)
    assert (item.state, item.error_code) == ("dispatch_error", "unknown_profile")
    assert (item.task_id, item.replies) == ("task-none", None)
    assert _rows(sqlite_db, item.id) == []


class _Sent:
    """Stands in for the Celery app a sink sends callbacks through: records each send."""

    def __init__(self) -> None:
        self.tasks: list[tuple[str, list[Any], dict[str, Any], dict[str, Any]]] = []

    def send_task(self, name: str, *, args: Any, kwargs: Any, **options: Any) -> None:
        self.tasks.append((name, args, kwargs, options))


@pytest.fixture
def results() -> Celery:
    """A Celery app whose result backend is Celery's in-memory cache, JSON only."""
    app = Celery("results-test", broker="memory://", backend="cache+memory://")
    app.conf.update(
        result_serializer="json", result_accept_content=["json"], accept_content=["json"]
    )
    return app


def test_the_celery_sink_stores_what_asyncresult_get_gives_and_sends_the_callbacks(
    results: Celery,
) -> None:
    sent = _Sent()
    sink = CeleryResultSink(sent, results.backend)  # type: ignore[arg-type]
    reply = {
        "task_id": "t-ok",
        "link": [
            {"task": "up.done", "args": [7], "kwargs": {"k": 1}, "queue": "cb", "immutable": False}
        ],
        "link_error": [
            {"task": "up.err", "args": [], "kwargs": {}, "queue": "celery", "immutable": False}
        ],
    }
    record = {"id": "wi-1", "state": "succeeded", "result": [1, 2]}
    sink.deliver(reply, record)
    assert results.AsyncResult("t-ok").get(timeout=1) == record
    assert sent.tasks == [
        ("up.done", [record, 7], {"k": 1}, {"queue": "cb", "parent_id": "t-ok", "root_id": "t-ok"})
    ]
    failed = {"id": "wi-2", "state": "failed", "error": {"code": "work_failed", "message": "m"}}
    sink.deliver(reply | {"task_id": "t-bad"}, failed)
    outcome = results.AsyncResult("t-bad")
    with pytest.raises(ItemFailedError) as raised:
        outcome.get(timeout=1)
    assert raised.value.args == (failed,) and outcome.state == "FAILURE"
    assert sent.tasks[-1][:2] == ("up.err", ["t-bad"])
    sink.deliver({"task_id": "t-refused"}, {"id": "wi-3", "state": "dispatch_error"})
    with pytest.raises(ItemDispatchError):
        results.AsyncResult("t-refused").get(timeout=1)
    assert len(sent.tasks) == 2  # a reply without callbacks sends none
