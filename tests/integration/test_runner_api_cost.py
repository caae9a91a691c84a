"""What one runner call costs the api: one worker thread, one transaction.

A runner calls the api every few seconds per sandbox, so a call's cost is the api's load:
its session is found in the call's own transaction, and its dependency, body and answer do
not each take a turn in the thread pool.
"""

from __future__ import annotations

import threading
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import anyio.to_thread
import pytest
from sqlalchemy import event

from corral.shared.store.db import Database
from tests.integration.api_clients import ClientFactory, runner_headers


@dataclass
class Cost:
    """The worker-thread hops of a call, and the transactions and statements run in them."""

    hops: int = 0
    transactions: int = 0
    commits: int = 0
    statements: list[str] = field(default_factory=list)


@contextmanager
def measured(db: Database, monkeypatch: pytest.MonkeyPatch) -> Iterator[Cost]:
    """Count what runs in the api's worker threads while the block runs (starlette and
    FastAPI hand work to one through ``anyio.to_thread.run_sync``); database work in any
    other thread is not counted."""
    cost = Cost()
    hopped = threading.local()
    run_sync = anyio.to_thread.run_sync

    async def counted(func: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        cost.hops += 1

        def marked(*inner: Any) -> Any:
            hopped.on = True
            try:
                return func(*inner)
            finally:
                hopped.on = False

        return await run_sync(marked, *args, **kwargs)

    def began(_: Any) -> None:
        if getattr(hopped, "on", False):
            cost.transactions += 1

    def committed(_: Any) -> None:
        if getattr(hopped, "on", False):
            cost.commits += 1

    def executed(_c: Any, _cur: Any, statement: str, *_rest: Any) -> None:
        if getattr(hopped, "on", False):
            cost.statements.append(statement)

    listeners: list[tuple[str, Callable[..., None]]] = [
        ("begin", began),
        ("commit", committed),
        ("before_cursor_execute", executed),
    ]
    for name, listener in listeners:
        event.listen(db.engine, name, listener)
    monkeypatch.setattr(anyio.to_thread, "run_sync", counted)
    try:
        yield cost
    finally:
        monkeypatch.undo()
        for name, listener in listeners:
            event.remove(db.engine, name, listener)


def test_a_heartbeat_is_one_worker_thread_and_one_transaction(
    make_client: ClientFactory, pg_db: Database, monkeypatch: pytest.MonkeyPatch
) -> None:
    client = make_client()
    _, headers = runner_headers(client, pg_db, f"org-{uuid.uuid4().hex[:8]}")
    with measured(pg_db, monkeypatch) as cost:
        answer = client.post("/v1/runner/heartbeat", json={}, headers=headers)
    assert answer.status_code == 200, answer.text
    assert answer.json() == {"cancel": False}
    assert cost.hops == 1
    assert (cost.transactions, cost.commits) == (1, 1)
    # The session's lookup and the heartbeat's own reads and write, in that one transaction.
    assert "FROM runner_sessions" in cost.statements[0]
    assert any(s.startswith("UPDATE sandboxes") for s in cost.statements)


def test_an_unknown_session_is_refused_in_one_worker_thread(
    make_client: ClientFactory, pg_db: Database, monkeypatch: pytest.MonkeyPatch
) -> None:
    client = make_client()
    unknown = {"Authorization": "Bearer crs_" + "x" * 43}
    with measured(pg_db, monkeypatch) as cost:
        answer = client.post("/v1/runner/heartbeat", json={}, headers=unknown)
    assert answer.status_code == 401
    assert answer.json() == {"detail": "unauthorized"}
    assert cost.hops == 1
    assert cost.transactions == 1
    assert len(cost.statements) == 1  # the lookup alone


def test_a_call_without_a_bearer_token_is_refused_without_a_worker_thread(
    make_client: ClientFactory, pg_db: Database, monkeypatch: pytest.MonkeyPatch
) -> None:
    client = make_client()
    with measured(pg_db, monkeypatch) as cost:
        answer = client.post("/v1/runner/heartbeat", json={})
    assert answer.status_code == 401
    assert answer.json() == {"detail": "unauthorized"}
    assert (cost.hops, cost.transactions) == (0, 0)


def test_a_session_that_is_not_live_is_refused_whatever_its_body(
    make_client: ClientFactory, pg_db: Database
) -> None:
    client = make_client()
    unknown = {"Authorization": "Bearer crs_" + "x" * 43}
    for path, body in (("/v1/runner/complete", {}), ("/v1/runner/logs", {"lines": "x"})):
        answer = client.post(path, json=body, headers=unknown)
        assert answer.status_code == 401, (path, answer.text)
        assert answer.json() == {"detail": "unauthorized"}
    _, live = runner_headers(client, pg_db, f"org-{uuid.uuid4().hex[:8]}")
    answer = client.post("/v1/runner/complete", json={}, headers=live)
    assert answer.status_code == 422, answer.text
    assert answer.json()["detail"] == [{"field": "exit_code", "message": "Field required"}]
