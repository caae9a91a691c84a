"""Hostile env names and values on the Celery intake, against a running api and scheduler: a
``corral.dispatch`` whose env names LD_PRELOAD (a library an earlier item planted), has an
``=`` in a name, or carries a 10 MB value becomes a ``dispatch_error`` item with code
``invalid_message`` naming ``env``, findable by its task id; nothing of it reaches a log."""

from __future__ import annotations

import secrets
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from celery import Celery
from sqlalchemy import select

from corral.shared.store.db import Database
from corral.shared.store.models import WorkItem
from tests.acceptance.stack import Stack

PLANTED = f"/tmp/planted-{uuid.uuid4().hex}.so"
MIB = 1024 * 1024


@pytest.fixture(scope="module")
def stack(postgres_database_url: str, redis_url: str) -> Iterator[Stack]:
    """The api and the scheduler alone (no item here gets a sandbox), with a secret key,
    and broker limits past 10 MB so that the message's own bound is what refuses."""
    extra = {
        "CORRAL_SECRET_KEY": secrets.token_urlsafe(32),
        "CORRAL_MAX_MESSAGE_BYTES": str(64 * MIB),
        "CORRAL_MAX_MESSAGE_BODY_BYTES": str(32 * MIB),
    }
    running = Stack(database_url=postgres_database_url, broker_url=redis_url, extra_env=extra)
    try:
        yield running.start_only(["api", "scheduler"])
    finally:
        running.stop()


def _message(org: str, **fields: Any) -> dict[str, Any]:
    work = {"kind": "shell", "command": "true"}
    return {"org": org, "project": "web", "profile": "default", "work": work, **fields}


def _item(db: Database, key: str) -> WorkItem | None:
    with db.session() as session:
        return session.scalar(select(WorkItem).where(WorkItem.idempotency_key == key))


def test_a_dispatch_with_a_loader_env_name_becomes_an_invalid_message_item(
    stack: Stack, sender: Celery, db: Database
) -> None:
    org = stack.make_org(f"env-{uuid.uuid4().hex[:8]}")
    cases = {
        "loader": (
            {"env": {"LD_PRELOAD": PLANTED}},
            "env: LD_PRELOAD is refused: the dynamic loader acts on it",
        ),
        "toolchain": (
            {"toolchain": {"env": {"LD_LIBRARY_PATH": PLANTED}}},
            "toolchain: toolchain.env: LD_LIBRARY_PATH is refused: the dynamic loader acts on it",
        ),
        "equals": ({"env": {"A=B": PLANTED}}, "env: a name is not an environment variable name"),
        "10 MB": (
            {"env": {"BIG": PLANTED * (10 * MIB // len(PLANTED))}},
            "env: a value is too long",
        ),
    }
    task_ids = {case: f"env-{case.replace(' ', '')}-{uuid.uuid4().hex}" for case in cases}
    for case, (fields, _) in cases.items():
        sender.send_task("corral.dispatch", args=[_message(org, **fields)], task_id=task_ids[case])
    for case, (_, said) in cases.items():
        key = f"celery:{task_ids[case]}"
        item = stack.until(lambda key=key: _item(db, key), f"the {case} message was not recorded")
        status, view = stack.request("GET", f"/v1/work-items/{item.id}")
        assert status == 200
        assert (view["state"], view["error"]["code"]) == ("dispatch_error", "invalid_message")
        assert view["error"]["message"].startswith(f"invalid dispatch message: {said}")
        assert PLANTED not in str(view) and PLANTED not in str(item.payload)
    # An ordinary env is taken, sealed and routed as before.
    ordinary = _message(org, env={"CI": "true", "node_env": "ci"}, idempotency_key="env-ok")
    sender.send_task("corral.dispatch", args=[ordinary])
    item = stack.until(lambda: _item(db, "env-ok"), "the ordinary message was not taken")
    assert stack.until(
        lambda: (found := _item(db, "env-ok")) and found.state == "routed", "not routed"
    )
    assert item.error_code is None
    stack.check_alive()
    for name in stack.processes:
        assert PLANTED.encode() not in stack.log_path(name).read_bytes()
