"""Malformed broker messages against the real processes, on Redis and PostgreSQL.

Every shape that used to stop a Celery worker (and, restored at shutdown, the next one) is
pushed onto ``provision.local`` and ``maintenance``: raw bytes LPUSHed onto the prefixed
list, and task messages of the wrong shape built by hand. Each must become a dead letter
(a row with its queue and reason), the workers must stay up and serve the next task, and
the env value planted in the messages must reach no process log. Then one malformed
message is published to each exchange: it lands in one queue, never in several.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import re
import time
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import pytest
import redis
from celery import Celery
from kombu import Connection, Exchange
from sqlalchemy import select

from corral.shared.store.db import Database
from corral.shared.store.models import DeadLetter, WorkItem
from tests.acceptance.conftest import shell
from tests.acceptance.stack import Stack, running_stack

PLANTED = f"planted-{uuid.uuid4().hex}"
"""An env value carried by every malformed message; no process may log it."""

QUEUES = {"provision.local": "corral.provision", "maintenance": "corral.terminate"}
ORG = "guard-org"  # this module's own org: the session's database is shared


@pytest.fixture(scope="module")
def stack(postgres_database_url: str, redis_url: str) -> Iterator[Stack]:
    """The module's own stack, logging at DEBUG: a task's success line, which these tests
    wait for, is a routine line the maintenance worker writes at DEBUG."""
    with running_stack(postgres_database_url, redis_url, CORRAL_LOG_LEVEL="DEBUG") as running:
        yield running


@pytest.fixture(scope="module")
def setup_org(stack: Stack) -> str:
    """Org guard-org with one local pool."""
    return stack.make_org(ORG)


def kombu_entry(body: bytes, headers: Any, queue: str) -> bytes:
    """A Redis list entry as kombu writes it, around ``body`` and ``headers`` as given."""
    return json.dumps(
        {
            "body": base64.b64encode(body).decode(),
            "content-encoding": "utf-8",
            "content-type": "application/json",
            "headers": headers,
            "properties": {
                "correlation_id": str(uuid.uuid4()),
                "reply_to": "",
                "delivery_mode": 2,
                "delivery_info": {"exchange": "corral", "routing_key": queue},
                "priority": 0,
                "body_encoding": "base64",
                "delivery_tag": str(uuid.uuid4()),
            },
        }
    ).encode()


def task_headers(task: str, **changes: Any) -> dict[str, Any]:
    task_id = str(uuid.uuid4())
    return {
        "lang": "py",
        "task": task,
        "id": task_id,
        "root_id": task_id,
        "parent_id": None,
        "retries": 0,
        "timelimit": [None, None],
        "argsrepr": f"({PLANTED!r},)",
        "kwargsrepr": "{}",
        "origin": "gen1@test",
        "ignore_result": True,
        **changes,
    }


@dataclass(frozen=True)
class Sent:
    """One malformed message pushed onto a queue list: what it should be recorded as."""

    shape: str
    queue: str
    reason: str
    sha256: str  # of the entry (refused by the transport) or of the body (by the consumer)


Build = Callable[[str, str], tuple[bytes, bytes | None]]  # (queue, task) -> (entry, body)


def raw(data: bytes) -> Build:
    return lambda queue, task: (data, None)


def task_message(body: Any, **headers: Any) -> Build:
    def build(queue: str, task: str) -> tuple[bytes, bytes]:
        encoded = json.dumps(body).encode()
        return kombu_entry(encoded, task_headers(task, **headers), queue), encoded

    return build


def not_an_object_as_headers(queue: str, task: str) -> tuple[bytes, None]:
    return kombu_entry(b'[["wi-x"], {}, {}]', [PLANTED, queue], queue), None


def bad_base64(queue: str, task: str) -> tuple[bytes, None]:
    entry = json.loads(kombu_entry(b"", task_headers(task), queue))
    entry["body"] = f"!!{PLANTED}!!"
    return json.dumps(entry).encode(), None


TEN_MB = 10 * 1024 * 1024
SHAPES: list[tuple[str, str, Build]] = [
    ("random bytes", "not_json", raw(b"\xff\xfe" + os.urandom(512) + PLANTED.encode())),
    ("not JSON", "not_json", raw(f"{PLANTED} is not JSON".encode())),
    ("empty", "not_json", raw(b"")),
    ("JSON number", "not_an_envelope", raw(b"42")),
    ("JSON list", "not_an_envelope", raw(json.dumps([PLANTED]).encode())),
    ("bad base64 envelope", "bad_body_encoding", bad_base64),
    ("10 MB of garbage", "too_large", raw((PLANTED.encode() * (TEN_MB // 40 + 1))[:TEN_MB])),
    ("headers not an object", "bad_headers", not_an_object_as_headers),
    ("body a dict", "bad_call_shape", task_message({"env": {"GREETING": PLANTED}})),
    ("body a one-element list", "bad_call_shape", task_message([[PLANTED]])),
    ("args an int", "bad_call_shape", task_message([5, {"greeting": PLANTED}, {}])),
    ("args null", "bad_call_shape", task_message([None, {"greeting": PLANTED}, {}])),
    ("garbage timelimit", "bad_headers", task_message([["x"], {}, {}], timelimit=PLANTED)),
    ("no arguments", "bad_arguments", task_message([[], {}, {}])),
    ("an int argument", "bad_arguments", task_message([[5], {}, {}])),
]


def push_all(stack: Stack, client: redis.Redis) -> list[Sent]:
    sent = []
    for queue, task in QUEUES.items():
        for shape, reason, build in SHAPES:
            entry, body = build(queue, task)
            client.lpush(f"{stack.key_prefix}{queue}", entry)
            digest = hashlib.sha256(entry if body is None else body).hexdigest()
            sent.append(Sent(shape, queue, reason, digest))
    return sent


@pytest.fixture
def client(stack: Stack) -> Iterator[redis.Redis]:
    connection = redis.Redis.from_url(stack.broker_url)
    yield connection
    connection.close()


def dead_letters(db: Database, since: datetime) -> list[DeadLetter]:
    with db.session() as session:
        return list(
            session.scalars(
                select(DeadLetter).where(DeadLetter.received_at >= since).order_by(DeadLetter.id)
            )
        )


def await_dead_letters(
    stack: Stack, db: Database, since: datetime, expected: set[tuple[str, str, str]]
) -> set[tuple[str, str, str]]:
    deadline = time.monotonic() + 60
    while True:
        found = {(row.queue, row.reason, row.sha256) for row in dead_letters(db, since)}
        if expected <= found or time.monotonic() > deadline:
            return found
        stack.check_alive()
        time.sleep(0.2)


def await_task_succeeded(stack: Stack, process: str, task_id: str, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for line in stack.log_path(process).read_text(errors="replace").splitlines():
            if task_id in line and "succeeded" in line:
                return
        stack.check_alive()
        time.sleep(0.2)
    raise TimeoutError(f"{task_id} did not succeed on {process}: {stack.logs()}")


def assert_workers_unharmed(stack: Stack, client: redis.Redis) -> None:
    stack.check_alive()
    for name in stack.processes:
        log = stack.log_path(name).read_text(errors="replace")
        assert "Unrecoverable error" not in log, name
        assert PLANTED not in log, f"a planted env value reached the {name} log"
    # nothing malformed waits to be delivered again
    unacked = client.hvals(f"{stack.key_prefix}unacked")
    assert not [entry for entry in unacked if PLANTED.encode() in entry]


def test_every_malformed_shape_is_dead_lettered_and_the_workers_serve_the_next_task(
    stack: Stack, setup_org: str, sender: Celery, db: Database, client: redis.Redis
) -> None:
    since = datetime.now(UTC)
    sent = push_all(stack, client)

    # Valid work after the malformed messages (each list is first in, first out).
    status, body = stack.request("POST", "/v1/dispatch", shell(setup_org, "echo after-bad"))
    assert status == 202, body
    redrive_id = f"redrive-after-bad-{uuid.uuid4().hex}"
    sender.send_task("corral.redrive", task_id=redrive_id)

    expected = {(s.queue, s.reason, s.sha256) for s in sent}
    found = await_dead_letters(stack, db, since, expected)
    missing = [s for s in sent if (s.queue, s.reason, s.sha256) not in found]
    assert not missing, f"not dead-lettered as expected: {missing}\nrecorded: {found}"
    [view] = stack.wait_final([body["id"]])
    assert view["state"] == "succeeded"
    await_task_succeeded(stack, "maintenance", redrive_id)
    assert client.llen(f"{stack.key_prefix}provision.local") == 0
    named = [row for row in dead_letters(db, since) if row.task_name]
    assert {row.task_name for row in named} == set(QUEUES.values())
    for port, queue in [
        (stack.worker_metrics_ports["worker-local"], "provision.local"),
        (stack.metrics_port, "maintenance"),
    ]:
        counted = dead_letter_counts(port)
        for shape, reason, _ in SHAPES:
            assert counted.get((queue, reason), 0) >= 1, (queue, shape)
    assert_workers_unharmed(stack, client)


def dead_letter_counts(port: int) -> dict[tuple[str, str], float]:
    """``corral_dead_letters_total`` by queue and reason, scraped from a worker."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as answer:
        text = answer.read().decode()
    pattern = re.compile(r'corral_dead_letters_total\{queue="([^"]+)",reason="([^"]+)"\} (\S+)')
    return {(m[1], m[2]): float(m[3]) for m in pattern.finditer(text)}


def publish(stack: Stack, exchange: str, routing_key: str, task: str) -> str:
    """A malformed task message (its body an object), published as any kombu client would."""
    headers = task_headers(task)
    with Connection(
        stack.broker_url, transport_options={"global_keyprefix": stack.key_prefix}
    ) as conn:
        conn.Producer().publish(
            {"env": {"GREETING": PLANTED}},
            exchange=Exchange(exchange, "direct"),
            routing_key=routing_key,
            headers=headers,
            serializer="json",
        )
    return str(headers["id"])


def test_a_publish_to_either_exchange_reaches_one_queue_and_no_worker_dies(
    stack: Stack, setup_org: str, sender: Celery, db: Database, client: redis.Redis
) -> None:
    since = datetime.now(UTC)
    # A third-party sender with plain Celery and no corral configuration.
    upstream = Celery("upstream", broker=stack.broker_url)
    upstream.conf.broker_transport_options = {"global_keyprefix": stack.key_prefix}
    key = f"upstream-{uuid.uuid4().hex[:8]}"
    try:
        upstream.send_task(
            "corral.dispatch",
            args=[shell(setup_org, "echo upstream", idempotency_key=key)],
            queue="dispatch",
        )
    finally:
        upstream.close()

    # The scheduler's intake records a malformed corral.dispatch as an invalid_message item
    # (keyed by its task id); the maintenance worker dead-letters its malformed task.
    dispatch_ids = [
        publish(stack, "dispatch", "dispatch", "corral.dispatch"),  # the old fan-out
        publish(stack, "corral", "dispatch", "corral.dispatch"),
    ]
    maintenance_id = publish(stack, "corral", "maintenance", "corral.terminate")
    # Valid work on every worker's queue afterwards: once it ran, a copy of a malformed
    # message in that queue would have been recorded before it.
    redrive_id = f"redrive-after-exchanges-{uuid.uuid4().hex}"
    sender.send_task("corral.redrive", task_id=redrive_id)
    status, body = stack.request("POST", "/v1/dispatch", shell(setup_org, "echo after-exchanges"))
    assert status == 202
    await_task_succeeded(stack, "maintenance", redrive_id)
    assert [v["state"] for v in stack.wait_final([body["id"]])] == ["succeeded"]

    keys = [f"celery:{task_id}" for task_id in dispatch_ids]
    deadline = time.monotonic() + 30
    while True:
        rows = [r for r in dead_letters(db, since) if r.task_id in {*dispatch_ids, maintenance_id}]
        with db.session() as session:
            invalid = list(
                session.scalars(select(WorkItem).where(WorkItem.idempotency_key.in_(keys)))
            )
        if (len(rows) >= 1 and len(invalid) >= 2) or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert [(row.task_id, row.queue) for row in rows] == [(maintenance_id, "maintenance")]
    assert sorted(i.idempotency_key or "" for i in invalid) == sorted(keys)
    assert {(i.state, i.error_code) for i in invalid} == {("dispatch_error", "invalid_message")}
    with db.session() as session:
        item = session.scalar(select(WorkItem).where(WorkItem.idempotency_key == key))
    assert item is not None, "the plain Celery sender's dispatch did not arrive"
    assert [v["state"] for v in stack.wait_final([item.id])] == ["succeeded"]
    assert_workers_unharmed(stack, client)
