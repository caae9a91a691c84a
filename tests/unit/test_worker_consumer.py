"""corral's worker consumer: what it sets aside before Celery reads a message, and a real
Celery worker (in this process, on the in-memory broker) that survives every bad shape."""

from __future__ import annotations

import json
import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from celery import signals
from celery.contrib.testing.worker import start_worker
from celery.worker import state
from kombu import Message
from sqlalchemy import select

from corral.shared import runtime
from corral.shared.broker import celery_app
from corral.shared.broker.envelope import MalformedMessageError, TaskCall
from corral.shared.broker.task_calls import TaskSignatures, check_celery_message
from corral.shared.broker.worker_consumer import GuardedConsumer, _forget_request, read_task_message
from corral.shared.settings import CoreSettings
from corral.shared.store.db import Database
from corral.shared.store.models import DeadLetter

PLANTED = "planted-env-value-6d1f"


def headers(task: str = "corral.redrive", **changes: Any) -> dict[str, Any]:
    return {
        "lang": "py",
        "task": task,
        "id": str(uuid.uuid4()),
        "retries": 0,
        "timelimit": [None, None],
        "root_id": None,
        "parent_id": None,
        **changes,
    }


def call(*args: Any, name: str = "corral.terminate", **kwargs: Any) -> TaskCall:
    return TaskCall(name=name, id="t-1", args=list(args), kwargs=kwargs, protocol=2)


# -- the checks, without a worker ------------------------------------------------------------


def test_celery_headers_and_embed_must_be_what_a_worker_reads() -> None:
    good = headers()
    check_celery_message(call(), good, [[], {}, {"callbacks": None, "chord": None}])
    check_celery_message(call(), good, [[], {}, None])
    refused = {
        "timelimit": (headers(timelimit=PLANTED), [[], {}, {}]),
        "timelimit pair": (headers(timelimit=[1, "x"]), [[], {}, {}]),
        "retries": (headers(retries="3"), [[], {}, {}]),
        "eta": (headers(eta=12), [[], {}, {}]),
        "two elements": (good, [[], {}]),
        "embed list": (good, [[], {}, [PLANTED]]),
        "embed field": (good, [[], {}, {"args": [PLANTED]}]),
        "callbacks": (good, [[], {}, {"callbacks": PLANTED}]),
    }
    for case, (fields, body) in refused.items():
        with pytest.raises(MalformedMessageError) as raised:
            check_celery_message(call(), fields, body)
        assert raised.value.reason in ("bad_headers", "bad_call_shape"), case
        assert raised.value.task_name == "corral.terminate"
        assert PLANTED not in raised.value.message
    with pytest.raises(MalformedMessageError, match="no id header"):
        check_celery_message(TaskCall("corral.redrive", None, [], {}, 2), {}, [[], {}, {}])


def test_protocol_1_bodies_are_checked_field_by_field() -> None:
    proto1 = TaskCall("corral.redrive", "t-1", [], {}, protocol=1)
    check_celery_message(proto1, {}, {"task": "corral.redrive", "id": "t-1", "eta": None})
    with pytest.raises(MalformedMessageError, match="timelimit"):
        check_celery_message(proto1, {}, {"task": "corral.redrive", "timelimit": PLANTED})


def test_arguments_must_fit_the_tasks_signature() -> None:
    celery_app.configure(CoreSettings(broker_url="memory://"))
    signatures = TaskSignatures(celery_app.app.tasks)
    signatures.check(call("sb-1", "finished"))
    signatures.check(call(sandbox_id="sb-1", reason="finished"))
    signatures.check(call(name="corral.dispatch"))  # takes anything: records it itself
    signatures.check(call({"any": "shape"}, 5, name="corral.dispatch"))
    cases = [
        (call(name="corral.provision"), "bad_arguments"),  # no arguments
        (call(5, name="corral.provision"), "bad_arguments"),  # an int for the item id
        (call(None, name="corral.provision"), "bad_arguments"),
        (call("sb-1", "finished", "extra"), "bad_arguments"),
        (call("sb-1", reason="finished", extra=1), "bad_arguments"),
        (call(1, name="corral.redrive"), "bad_arguments"),
        (call(name="corral.nope"), "unknown_task"),
    ]
    for bad, reason in cases:
        with pytest.raises(MalformedMessageError) as raised:
            signatures.check(bad)
        assert raised.value.reason == reason, bad


class FakeChannel:
    """The channel side of a kombu message: records what was acknowledged."""

    no_ack_consumers = None

    def __init__(self) -> None:
        self.acked: list[str] = []

    def basic_ack(self, delivery_tag: str, multiple: bool = False) -> None:
        self.acked.append(delivery_tag)


def kombu_message(body: bytes, fields: Any, **extra: Any) -> Message:
    return Message(
        body=body,
        delivery_tag="tag-1",
        content_type="application/json",
        content_encoding="utf-8",
        headers=fields,
        channel=FakeChannel(),
        delivery_info={"exchange": "corral", "routing_key": "maintenance"},
        **extra,
    )


def test_a_kombu_message_is_read_within_bounds_before_kombu_decodes_it() -> None:
    celery_app.configure(CoreSettings(broker_url="memory://"))
    signatures = TaskSignatures(celery_app.app.tasks)
    good = kombu_message(b'[["sb-1", "finished"], {}, {}]', headers("corral.terminate"))
    assert read_task_message(good, signatures).args == ["sb-1", "finished"]
    bombs = {
        "pickle": kombu_message(
            b"\x80\x04K\x01.",
            headers(),
        ),
        "not json": kombu_message(PLANTED.encode(), headers()),
        "deep": kombu_message(b"[" * 200 + b"]" * 200, headers()),
    }
    bombs["pickle"].content_type = "application/x-python-serialize"
    for case, message in bombs.items():
        with pytest.raises(MalformedMessageError) as raised:
            read_task_message(message, signatures)
        assert raised.value.reason in ("unsupported_content_type", "not_json", "too_deep"), case


def test_a_request_reserved_before_the_strategy_raised_is_released() -> None:
    message = kombu_message(b"[[], {}, {}]", headers())

    class Reserved:
        id = "t-forget"

    request = Reserved()
    request.message = message  # type: ignore[attr-defined]
    state.task_reserved(request)
    _forget_request(message)
    assert request not in state.reserved_requests and "t-forget" not in state.requests


# -- a real worker ----------------------------------------------------------------------------


@pytest.fixture
def worker_db(sqlite_db: Database) -> Iterator[Database]:
    app = celery_app.configure(CoreSettings(broker_url="memory://"))
    with app.connection_for_write() as connection:
        # what other tests sent through the process's in-memory broker, and never consumed
        app.amqp.queues["maintenance"](connection.default_channel).purge()
    runtime.install(runtime.Runtime(settings=CoreSettings(broker_url="memory://"), db=sqlite_db))
    yield sqlite_db
    runtime.reset()


def publish(body: bytes, fields: dict[str, Any], content_type: str = "application/json") -> None:
    """Straight onto the ``maintenance`` queue (the default exchange routes by queue name)."""
    with celery_app.app.producer_or_acquire() as producer:
        producer.publish(
            body,
            exchange="",
            routing_key="maintenance",
            headers=fields,
            content_type=content_type,
            content_encoding="utf-8",
        )


SHAPES: list[tuple[str, bytes, dict[str, Any], str]] = [
    ("body dict", json.dumps({"env": {"GREETING": PLANTED}}).encode(), headers(), "bad_call_shape"),
    ("one-element list", json.dumps([[PLANTED]]).encode(), headers(), "bad_call_shape"),
    ("args int", b"[5, {}, {}]", headers(), "bad_call_shape"),
    ("args null", b"[null, {}, {}]", headers(), "bad_call_shape"),
    ("two elements", b"[[], {}]", headers(), "bad_call_shape"),
    ("timelimit", b"[[], {}, {}]", headers(timelimit=PLANTED), "bad_headers"),
    ("eta", b"[[], {}, {}]", headers(eta=f"not-a-date-{PLANTED}"), "invalid_task"),
    ("embed", b"[[], {}, 7]", headers(), "bad_call_shape"),
    ("unknown task", b"[[], {}, {}]", headers("corral.nope"), "unknown_task"),
    ("arguments", json.dumps([[PLANTED], {}, {}]).encode(), headers(), "bad_arguments"),
    ("provision without", b"[[], {}, {}]", headers("corral.provision"), "bad_arguments"),
    ("provision int", b"[[5], {}, {}]", headers("corral.provision"), "bad_arguments"),
    (
        "strategy raises",
        b'[["sb-1", "finished"], {}, {}]',
        headers("corral.terminate"),
        "task_refused",
    ),
]


def exploding_strategy(message: Any, *args: Any) -> None:
    """A strategy that reserves the request, then raises (as Celery's does on a timelimit
    it cannot unpack)."""

    class Request:
        id = "t-exploded"

    request = Request()
    request.message = message  # type: ignore[attr-defined]
    state.task_reserved(request)
    raise ValueError(PLANTED)


def test_a_worker_sets_every_bad_message_aside_and_runs_the_next(
    worker_db: Database, caplog: pytest.LogCaptureFixture
) -> None:
    succeeded: list[str] = []
    done = threading.Event()
    sentinel = str(uuid.uuid4())

    def on_success(sender: Any = None, **_: Any) -> None:
        succeeded.append(sender.request.id)
        if sender.request.id == sentinel:
            done.set()

    signals.task_success.connect(on_success, weak=False)
    try:
        with start_worker(
            celery_app.app,
            pool="threads",
            concurrency=2,
            queues=["maintenance"],
            perform_ping_check=False,
            loglevel="WARNING",
            shutdown_timeout=10,
        ) as worker:
            assert isinstance(worker.consumer, GuardedConsumer)
            # Whatever else Celery's own strategy may raise on a message is caught too.
            worker.consumer.strategies["corral.terminate"] = exploding_strategy
            for _, body, fields, _ in SHAPES:
                publish(body, fields)
            publish(b"\x80\x04K\x01.", headers(), "application/x-python-serialize")
            celery_app.app.send_task("corral.redrive", task_id=sentinel)
            assert done.wait(30), "the task after the bad messages did not run"
            deadline = time.monotonic() + 10
            while len(rows := _rows(worker_db)) < len(SHAPES) + 1 and time.monotonic() < deadline:
                time.sleep(0.05)
    finally:
        signals.task_success.disconnect(on_success)
    assert succeeded == [sentinel]
    assert [(queue, reason) for queue, reason, _ in rows] == [
        ("maintenance", reason) for *_, reason in SHAPES
    ] + [("maintenance", "unsupported_content_type")]
    assert {name for *_, name in rows} >= {"corral.redrive", "corral.provision"}
    assert not state.reserved_requests  # every slot is free again
    assert PLANTED not in caplog.text


def _rows(db: Database) -> list[tuple[str, str, str | None]]:
    with db.session() as session:
        found = session.scalars(select(DeadLetter).order_by(DeadLetter.id))
        return [(row.queue, row.reason, row.task_name) for row in found]
