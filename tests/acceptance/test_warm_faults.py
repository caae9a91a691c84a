"""Warm hand-overs that break (docs/warm-pools.md), through real processes: the api, the
scheduler, a local provider worker (bubblewrap sandboxes), the maintenance worker and beat,
on PostgreSQL and Redis.

Each break is reached for certain. The api killed while its hand-over transaction waits:
with the api down an item is bound to the waiting warm sandbox, the test locks the warm row,
starts the api, and kills it once the runner's wait has reached the hand-over and waits for
that lock. The answer carrying the registration token lost after the commit: the runners
reach the api through a relay on a Unix socket of the test's, which passes every call on and
drops the one answer that carries a registration token.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import func, select, text

from corral.shared.broker import celery_app
from corral.shared.settings import CoreSettings
from corral.shared.store.db import Database, make_engine
from corral.shared.store.models import (
    CostEvent,
    LifecycleEvent,
    MaintenanceClock,
    RegistrationToken,
    RunnerSession,
    Sandbox,
    WarmSandbox,
    WorkItem,
)
from tests.acceptance.conftest import shell
from tests.acceptance.stack import Stack, running_stack
from tests.acceptance.warm import make_pool, waiting, warm_rows
from tests.conftest import require_bwrap_path

# A runner whose api is away makes no call: it stays bindable (and is not ended as lost) for
# CORRAL_WARM_WAIT_S + 15 s, which must cover the api's outage while an item is bound.
WARM_ENV = {"CORRAL_WARM_INTERVAL_S": "1", "CORRAL_WARM_WAIT_S": "60"}


@pytest.fixture
def database(postgres_database_url: str) -> Iterator[Database]:
    db = Database(make_engine(postgres_database_url))
    yield db
    db.dispose()


# -- what an item left ------------------------------------------------------------------


def item_of(db: Database, org: str) -> WorkItem | None:
    with db.session() as session:
        item = session.scalars(select(WorkItem).where(WorkItem.org_id == org)).one_or_none()
        session.expunge_all()
    return item


def sandboxes(db: Database, item_id: str) -> list[Sandbox]:
    with db.session() as session:
        rows = session.scalars(
            select(Sandbox).where(Sandbox.work_item_id == item_id).order_by(Sandbox.attempt)
        ).all()
        session.expunge_all()
    return list(rows)


def count(db: Database, model: Any, *where: Any) -> int:
    with db.session() as session:
        return int(session.scalar(select(func.count()).select_from(model).where(*where)) or 0)


def cost_sandboxes(db: Database, item_id: str) -> list[str]:
    with db.session() as session:
        return sorted(
            session.scalars(select(CostEvent.sandbox_id).where(CostEvent.work_item_id == item_id))
        )


def times_running(db: Database, item_id: str) -> int:
    return count(
        db,
        LifecycleEvent,
        LifecycleEvent.entity == "work_item",
        LifecycleEvent.work_item_id == item_id,
        LifecycleEvent.to_state == "running",
    )


def printed(stack: Stack, item_id: str, line: str) -> int:
    """How many times the item's work printed ``line`` (its logs, all attempts)."""
    _, logs = stack.request("GET", f"/v1/work-items/{item_id}/logs")
    return sum(1 for entry in logs["lines"] if entry["line"] == line)


# -- the api killed while its hand-over waits -------------------------------------------


@pytest.fixture
def stack(postgres_database_url: str, redis_url: str) -> Iterator[Stack]:
    with running_stack(postgres_database_url, redis_url, **WARM_ENV) as running:
        yield running


def kill_api(stack: Stack) -> None:
    """SIGKILL the api (its process group); the stack then checks only the others."""
    api = stack.processes.pop("api")
    os.killpg(api.pid, signal.SIGKILL)
    assert api.wait() == -signal.SIGKILL


def waiting_hand_over(db: Database) -> bool:
    """Whether a backend waits for a row lock in the hand-over's UPDATE of a warm row."""
    with db.session() as session:
        found = session.scalar(
            text(
                "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
                "AND wait_event_type = 'Lock' AND state = 'active' "
                "AND query LIKE 'UPDATE warm_sandboxes SET handed_over_at%'"
            )
        )
    return bool(found)


def dispatch_while_the_api_is_down(stack: Stack, org: str) -> None:
    """Send a dispatch message straight to the scheduler, as producers do."""
    sender = celery_app.configure(
        CoreSettings(broker_url=stack.broker_url, broker_key_prefix=stack.key_prefix)
    )
    message = shell(org, "echo handed over") | {"idempotency_key": "one"}
    sender.send_task("corral.dispatch", args=[message], queue="dispatch")


def test_the_api_killed_while_its_hand_over_waits_hands_over_after_its_restart(
    stack: Stack, database: Database
) -> None:
    db = database
    org = f"warmkill-{uuid.uuid4().hex[:8]}"
    pool_id = make_pool(stack, org, warm_min=1)
    [warm_id] = stack.until(lambda: waiting(db, pool_id), "a warm sandbox waiting", timeout_s=60)
    kill_api(stack)  # its runner's held wait breaks; it calls again and again
    dispatch_while_the_api_is_down(stack, org)

    def bound() -> WorkItem | None:
        item = item_of(db, org)
        rows = sandboxes(db, item.id) if item is not None else []
        ready = [row for row in rows if row.external_id == warm_id and row.status == "ready"]
        return item if ready and item is not None and item.state == "awaiting_claim" else None

    item = stack.until(bound, "the item bound to the warm sandbox", timeout_s=60)
    with db.session() as holder:
        holder.execute(select(WarmSandbox.id).where(WarmSandbox.id == warm_id).with_for_update())
        stack.start_only(["api"])
        stack.until(lambda: waiting_hand_over(db), "the hand-over to wait for the warm row")
        kill_api(stack)
        holder.rollback()

    [row] = [r for r in warm_rows(db, pool_id) if r.id == warm_id]
    assert (row.state, row.handed_over_at) == ("bound", None), "the hand-over was not kept"
    stack.start_only(["api"])  # the runner's next wait gets the token
    [view] = stack.wait_final([item.id], timeout_s=120)

    assert view["state"] == "succeeded", view
    [sandbox] = sandboxes(db, item.id)
    assert (sandbox.attempt, sandbox.external_id) == (1, warm_id), "the warm sandbox ran it"
    [row] = [r for r in warm_rows(db, pool_id) if r.id == warm_id]
    assert row.handed_over_at is not None
    # The claim's token (revoked at the bind) and the one hand-over's, redeemed once.
    assert count(db, RegistrationToken, RegistrationToken.sandbox_id == sandbox.id) == 2
    assert count(db, RunnerSession, RunnerSession.work_item_id == item.id) == 1
    assert times_running(db, item.id) == 1
    assert printed(stack, item.id, "handed over") == 1
    costs = stack.until(lambda: cost_sandboxes(db, item.id), "the sandbox's cost event")
    assert costs == [sandbox.id]


# -- the answer carrying the registration token lost --------------------------------------


def read_message(sock: socket.socket) -> bytes:
    """One HTTP request or answer with a Content-Length (corral's runner and api send no
    other), whole."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        if not chunk:
            raise ConnectionError("closed before the headers ended")
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    length = 0
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            length = int(value.strip())
    while len(body) < length:
        chunk = sock.recv(65536)
        if not chunk:
            raise ConnectionError("closed before the body ended")
        body += chunk
    return head + b"\r\n\r\n" + body


def carries_a_token(answer: bytes) -> bool:
    _, _, body = answer.partition(b"\r\n\r\n")
    with contextlib.suppress(ValueError):
        decoded = json.loads(body)
        return isinstance(decoded, dict) and isinstance(decoded.get("registration_token"), str)
    return False


class Relay:
    """The runners' way to the api: a Unix socket at ``path`` whose calls go to the api's
    socket ``upstream``, one call per connection as the runner makes them. The first answer
    that carries a registration token is dropped: its connection closes without a byte."""

    def __init__(self, path: Path, upstream: Path) -> None:
        self.upstream = upstream
        self.lost = threading.Event()
        path.parent.mkdir(parents=True)
        self._server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._server.bind(str(path))
        os.chmod(path, 0o666)  # sandboxes run as another user
        self._server.listen(64)
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._server.accept()
            except OSError:
                return
            threading.Thread(target=self._relay, args=(client,), daemon=True).start()

    def _relay(self, client: socket.socket) -> None:
        with client, contextlib.suppress(OSError):
            request = read_message(client)
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as api:
                api.connect(str(self.upstream))  # the api down: the call breaks, as direct
                api.sendall(request)
                answer = read_message(api)
            if carries_a_token(answer) and not self.lost.is_set():
                self.lost.set()  # the api committed the hand-over; the runner hears nothing
                return
            client.sendall(answer)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self._server.shutdown(socket.SHUT_RDWR)
        self._server.close()


@pytest.fixture(
    params=[
        # Reconciled every sweep: the ended warm sandbox is found at its provider.
        pytest.param(({"CORRAL_RECONCILE_INTERVAL_S": "0"}, "sandbox_lost"), id="reconciled"),
        # Reconciled rarely: the claim deadline (the token's TTL) ends it.
        pytest.param(
            ({"CORRAL_RECONCILE_INTERVAL_S": "3600", "CORRAL_TOKEN_TTL_S": "30"}, "never_claimed"),
            id="claim-deadline",
        ),
    ]
)
def relayed(
    request: pytest.FixtureRequest, postgres_database_url: str, redis_url: str
) -> Iterator[tuple[Stack, Relay, str]]:
    """A stack whose provider worker gives sandboxes the relay's socket as the api's; the
    reaper rule expected to end the sandbox whose runner never got its token."""
    require_bwrap_path()
    settings, reason = request.param
    running = Stack(
        database_url=postgres_database_url,
        broker_url=redis_url,
        extra_env={**WARM_ENV, **settings},
    )
    relay = Relay(running.state_dir / "relay" / "api.sock", running.state_dir / "run" / "api.sock")
    try:
        running.start_only(["api", "scheduler", "maintenance", "beat"])
        running.env["CORRAL_API_SOCKET"] = str(running.state_dir / "relay" / "api.sock")
        running.start_only(["worker-local"])
        if float(settings["CORRAL_RECONCILE_INTERVAL_S"]) > 0:
            # A database with no reconciliation on record reconciles at the first sweep, which
            # notes the time first and then asks every provider the session's pools name
            # (those of earlier tests too): were the sandbox ended before that sweep is done,
            # it would be found ended there, before its claim deadline. So the sweep that
            # reconciled, or a later one, must have finished first.
            running.until(
                lambda: reconciled_once(postgres_database_url),
                "the first reconciliation",
                timeout_s=60,
            )
            done = len(running.sweeps_done())
            running.until(
                lambda: len(running.sweeps_done()) > done, "that sweep done", timeout_s=120
            )
        yield running, relay, reason
    finally:
        running.stop()
        relay.close()


def ended_how(db: Database, sandbox_id: str, stack: Stack) -> str:
    """The sandbox's events and the maintenance worker's reaper lines, for a failure."""
    with db.session() as session:
        events = session.scalars(
            select(LifecycleEvent)
            .where(LifecycleEvent.entity_id == sandbox_id)
            .order_by(LifecycleEvent.id)
        ).all()
        lines = [
            f"{e.created_at} {e.from_state}->{e.to_state} {e.actor}: {e.detail}" for e in events
        ]
    log = stack.log_path("maintenance").read_text(errors="replace").splitlines()
    lines += [line for line in log if "reconcil" in line or "ended" in line][-40:]
    return "\n".join(lines)


def reconciled_once(database_url: str) -> bool:
    engine = make_engine(database_url)
    try:
        with engine.connect() as connection:
            phase = select(MaintenanceClock.phase).where(MaintenanceClock.phase == "reconcile")
            return connection.scalar(phase) is not None
    finally:
        engine.dispose()


def test_a_lost_hand_over_answer_ends_that_sandbox_and_the_item_runs_once_after(
    relayed: tuple[Stack, Relay, str], database: Database
) -> None:
    stack, relay, reason = relayed
    db = database
    org = f"warmlost-{uuid.uuid4().hex[:8]}"
    pool_id = make_pool(stack, org, warm_min=1)
    [warm_id] = stack.until(lambda: waiting(db, pool_id), "a warm sandbox waiting", timeout_s=60)
    status, body = stack.request("POST", "/v1/dispatch", shell(org, "echo ran once"))
    assert status == 202, body

    [view] = stack.wait_final([body["id"]], timeout_s=180)

    assert relay.lost.is_set(), "the registration token's answer was lost"
    assert view["state"] == "succeeded", view
    first, second = sandboxes(db, body["id"])
    assert (first.attempt, first.external_id) == (1, warm_id)
    assert first.terminated_at is not None and first.termination_reason == reason, ended_how(
        db, first.id, stack
    )
    [row] = [r for r in warm_rows(db, pool_id) if r.id == warm_id]
    assert row.handed_over_at is not None, "its token was handed over (and lost)"
    # That token was never redeemed: only attempt 2's runner registered, claimed and ran.
    sessions = count(db, RunnerSession, RunnerSession.work_item_id == body["id"])
    assert (second.attempt, sessions) == (2, 1)
    assert count(db, RunnerSession, RunnerSession.sandbox_id == second.id) == 1
    assert times_running(db, body["id"]) == 1
    assert printed(stack, body["id"], "ran once") == 1

    def both_billed() -> list[str] | None:
        found = cost_sandboxes(db, body["id"])
        return found if len(found) == 2 else None

    costs = stack.until(both_billed, "a cost event for each sandbox")
    assert costs == sorted([first.id, second.id]), "one cost event per sandbox"
