"""A plain Celery sender learns how each of its dispatches ended, through Celery alone.

The deployment names a result backend (``CORRAL_RESULT_BACKEND``, Redis here). An upstream
service that has Celery and not corral (tests/acceptance/plain_celery.py, run in isolated
mode) sends ``corral.dispatch`` messages with a ``link`` and a ``link_error`` callback and
waits on ``AsyncResult(task_id).get()``: a succeeded item's final record comes back; a
failed one, a dispatch error and each hostile message (a NUL in an env value, a 10 MB env
value, ``timeout_s`` of 10^30) raise the exception its state names, the record as its
argument. Each hostile message left an item findable by its idempotency key (or, when its
body was too large to read, by its task id). The upstream's own Celery worker runs its
``link`` callback once for the item that succeeded (the record first among its arguments)
and its ``link_error`` once for each other (the task id first), never twice.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from sqlalchemy import select

from corral.shared.store.db import Database
from corral.shared.store.models import WorkItem
from tests.acceptance.conftest import shell
from tests.acceptance.stack import Stack
from tests.conftest import require_bwrap_path

PLAIN_CELERY = Path(__file__).with_name("plain_celery.py")
ORG = "results"
CALLBACKS_QUEUE = "upstream-callbacks"
TEN_MB = 10 * 1024 * 1024


@pytest.fixture(scope="module")
def stack(postgres_database_url: str, redis_url: str) -> Iterator[Stack]:
    """The stack, with the broker's Redis as its result backend."""
    require_bwrap_path()
    running = Stack(
        database_url=postgres_database_url,
        broker_url=redis_url,
        extra_env={"CORRAL_RESULT_BACKEND": redis_url, "CORRAL_CALLBACK_QUEUES": CALLBACKS_QUEUE},
    )
    try:
        running.start()
        running.make_org(ORG)
        yield running
    finally:
        running.stop()


def _config(stack: Stack, messages: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    return {
        "broker": stack.broker_url,
        "backend": stack.broker_url,
        "prefix": stack.key_prefix,
        "callbacks_queue": CALLBACKS_QUEUE,
        "timeout": 240,
        "messages": messages or [],
    }


@pytest.fixture(scope="module")
def callbacks(stack: Stack, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """The upstream's Celery worker of its callbacks queue; the log its callbacks write."""
    log = tmp_path_factory.mktemp("callbacks") / "ran.jsonl"
    log.touch()
    output = log.with_name("worker.log")
    with output.open("wb") as sink:
        worker = subprocess.Popen(
            [
                sys.executable,
                "-I",
                str(PLAIN_CELERY),
                "worker",
                json.dumps(_config(stack)),
                str(log),
            ],
            stdout=sink,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        stack.until(lambda: b"ready." in output.read_bytes(), "the upstream worker is not ready")
        yield log
    finally:
        worker.terminate()
        worker.wait(timeout=20)


def _messages() -> dict[str, dict[str, Any]]:
    """By name, a message of each outcome; the hostile ones carry idempotency keys."""
    run = uuid.uuid4().hex[:8]
    hostile = {
        "nul": shell(ORG, "echo nul", env={"A": "x\x00y"}),
        "ten_mb": shell(ORG, "echo big", env={"BIG": "x" * TEN_MB}),
        "huge_timeout": shell(ORG, "echo t", resources={"timeout_s": 1e30}),
    }
    return {
        "succeeded": shell(ORG, "echo hello-results"),
        "failed": shell(ORG, "echo failing; exit 3"),
        "dispatch_error": shell(ORG, "true", profile="no-such-profile"),
        **{name: {**m, "idempotency_key": f"{name}-{run}"} for name, m in hostile.items()},
    }


def _send(stack: Stack, messages: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    config = _config(stack, list(messages.values()))
    done = subprocess.run(
        [sys.executable, "-I", str(PLAIN_CELERY), "send"],
        input=json.dumps(config).encode(),
        capture_output=True,
        timeout=600,
        check=False,
    )
    assert done.returncode == 0, done.stderr.decode(errors="replace")[-4000:] + stack.logs()
    lines = [json.loads(line) for line in done.stdout.decode().splitlines()]
    return dict(zip(messages, lines, strict=True))


def _ran(log: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in log.read_text().splitlines()]


def _item(db: Database, **by: str) -> WorkItem | None:
    with db.session() as session:
        query = select(WorkItem).where(*(getattr(WorkItem, k) == v for k, v in by.items()))
        return session.scalars(query).one_or_none()


def test_a_plain_celery_sender_gets_every_outcome_and_its_callbacks_run_once(
    stack: Stack, db: Database, callbacks: Path
) -> None:
    messages = _messages()
    got = _send(stack, messages)
    try:
        _check_results(got, messages, db)
        _check_callbacks(stack, got, callbacks)
    finally:
        client = redis.Redis.from_url(stack.broker_url)
        client.delete(*(f"celery-task-meta-{line['task_id']}" for line in got.values()))
        client.close()


def _check_results(
    got: dict[str, dict[str, Any]], messages: dict[str, dict[str, Any]], db: Database
) -> None:
    succeeded = got.pop("succeeded")
    assert succeeded["state"] == "SUCCESS", succeeded
    record = succeeded["value"]
    assert record["state"] == "succeeded" and record["exit_code"] == 0
    assert record["task_id"] == succeeded["task_id"]
    assert {"stream": "stdout", "line": "hello-results"} in record["output"]["tail"]
    assert record["cost"]["sandboxes"] == 1 and record["cost"]["settled"] is True
    raised = {name: (line["state"], line["raised"], line["module"]) for name, line in got.items()}
    assert raised == {
        "failed": ("FAILURE", "ItemFailedError", "celery.exceptions"),
        **dict.fromkeys(
            ("dispatch_error", "nul", "ten_mb", "huge_timeout"),
            ("FAILURE", "ItemDispatchError", "celery.exceptions"),
        ),
    }
    records = {name: line["record"] for name, line in got.items()}
    assert records["failed"]["exit_code"] == 3
    assert records["failed"]["error"]["code"] == "work_failed"
    assert records["dispatch_error"]["error"]["code"] == "unknown_profile"
    for name in ("nul", "ten_mb", "huge_timeout"):
        assert records[name]["error"]["code"] == "invalid_message", records[name]
        assert records[name]["task_id"] == got[name]["task_id"]
    # Each hostile message left an item its sender can find: by its own key when its body
    # could be read, by its task id when it could not.
    for name in ("nul", "huge_timeout"):
        item = _item(db, org_id=ORG, idempotency_key=messages[name]["idempotency_key"])
        assert item is not None and item.id == records[name]["id"], name
    too_large = _item(db, task_id=got["ten_mb"]["task_id"])
    assert too_large is not None and too_large.id == records["ten_mb"]["id"]
    assert too_large.idempotency_key == f"celery:{got['ten_mb']['task_id']}"
    assert "; the limit is 8388608" in (too_large.error_message or "")
    got["succeeded"] = succeeded


def _check_callbacks(stack: Stack, got: dict[str, dict[str, Any]], log: Path) -> None:
    stack.until(lambda: len(_ran(log)) >= len(got), "the callbacks did not all run", 60)
    time.sleep(3)  # long enough for a second delivery to show
    ran = _ran(log)
    done = [entry for entry in ran if entry["kind"] == "done"]
    assert [(entry["first"]["id"], entry["second"]) for entry in done] == [
        (got["succeeded"]["value"]["id"], "linked")
    ]
    failed = sorted((entry["first"], entry["second"]) for entry in ran if entry["kind"] == "failed")
    others = [line["task_id"] for name, line in got.items() if name != "succeeded"]
    assert failed == sorted((task_id, "errback") for task_id in others)
