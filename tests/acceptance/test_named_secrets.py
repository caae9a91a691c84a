"""Named secrets through real processes (api, scheduler, local worker, maintenance, beat) on
PostgreSQL and a Redis of the module's own: work dispatched over HTTP and over Celery with
``secret_env`` naming a secret gets its value, while no Redis command of the whole run, no
log file of the stack, no answer and no error ever holds it."""

from __future__ import annotations

import hashlib
import json
import time
import uuid
from collections.abc import Iterator

import pytest
from celery import Celery
from sqlalchemy import select

from corral.shared.store.db import Database
from corral.shared.store.models import WorkItem
from tests.acceptance.conftest import RedisMonitor, shell
from tests.acceptance.private_redis import PrivateRedis
from tests.acceptance.stack import Stack, running_stack

# The work prints the digest of the variable's value, never the value.
DIGEST = 'printf %s "$DB_PASSWORD" | sha256sum'


@pytest.fixture(scope="module")
def stack(postgres_database_url: str, module_redis: PrivateRedis) -> Iterator[Stack]:
    """A stack on a Redis of the module's own, whose every command a test reads (MONITOR)."""
    with running_stack(postgres_database_url, module_redis.url) as running:
        yield running


def _celery_item(db: Database, key: str, stack: Stack) -> str:
    """The id of the item the Celery message with idempotency key ``key`` made."""

    def found() -> str | None:
        with db.session() as session:
            return session.scalar(select(WorkItem.id).where(WorkItem.idempotency_key == key))

    return str(stack.until(found, f"the Celery message {key} made no item"))


def _log_text(stack: Stack, item_id: str) -> str:
    status, logs = stack.request("GET", f"/v1/work-items/{item_id}/logs")
    assert status == 200, logs
    return "\n".join(line["line"] for line in logs["lines"])


def test_a_named_secret_reaches_the_work_and_never_the_broker_or_a_log(
    stack: Stack, sender: Celery, db: Database, redis_monitor: RedisMonitor
) -> None:
    org = stack.make_org(f"secrets-{uuid.uuid4().hex[:8]}")
    value = f"named-secret-{uuid.uuid4().hex}"
    stored = stack.request("PUT", f"/v1/admin/orgs/{org}/secrets/db-password", {"value": value})
    assert stored[0] == 200, stored

    message = shell(org, DIGEST, secret_env={"DB_PASSWORD": "db-password"})
    status, body = stack.request("POST", "/v1/dispatch", message)
    assert status == 202, body
    key = f"secret-{uuid.uuid4().hex[:8]}"
    sender.send_task("corral.dispatch", args=[{**message, "idempotency_key": key}])
    # A control: a value sent inline in a Celery message is seen by the monitor.
    inline = f"inline-value-{uuid.uuid4().hex}"
    sender.send_task("corral.dispatch", args=[shell(org, "true", env={"INLINE": inline})])
    unknown = shell(org, DIGEST, secret_env={"DB_PASSWORD": "no-such-secret"})
    refused = stack.request("POST", "/v1/dispatch", unknown)
    ids = [body["id"], _celery_item(db, key, stack), refused[1]["id"]]

    views = stack.wait_final(ids)
    assert [v["state"] for v in views] == ["succeeded", "succeeded", "dispatch_error"], views
    assert views[2]["error"]["code"] == "unknown_secret"
    assert "no-such-secret" in views[2]["error"]["message"]
    digest = hashlib.sha256(value.encode()).hexdigest()
    logs = [_log_text(stack, item_id) for item_id in ids[:2]]
    assert all(digest in text for text in logs), logs  # the work received the value
    uses = [stack.request("GET", f"/v1/work-items/{i}/secret-uses")[1] for i in ids[:2]]
    assert [[(u["name"], u["scope"], u["target"]) for u in use["uses"]] for use in uses] == [
        [("db-password", "org", "DB_PASSWORD")]
    ] * 2

    time.sleep(1)  # the run's last commands (the items' ends) reach the monitor
    traffic = redis_monitor.stop()
    assert b"corral.provision" in traffic  # the monitor saw the run's task messages
    assert b"db-password" in traffic  # and the Celery message, which names the secret
    assert inline.encode() in traffic  # where a value sent inline would be seen
    assert value.encode() not in traffic
    answers = json.dumps([views, logs, uses, stored, refused])
    assert value not in answers
    for name in stack.processes:
        assert value not in stack.log_path(name).read_text(errors="replace"), name
    with db.session() as session:
        rows = session.scalars(select(WorkItem).where(WorkItem.id.in_(ids))).all()
        assert not any(value in json.dumps(row.payload) for row in rows)
        assert not any(value in (row.error_message or "") for row in rows)
