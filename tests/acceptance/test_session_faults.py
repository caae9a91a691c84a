"""The api SIGKILLed while it runs a session's command (docs/sessions.md), through real
processes: the api, the scheduler, a local provider worker (bubblewrap sandboxes), the
maintenance worker and beat, on PostgreSQL and Redis.

Exec runs in the api, through the provider: the local provider runs the command as a child
process group of the api's, in the session's sandbox. The test waits until that command
runs in the sandbox, then kills the api. The caller's call fails at once; the command is
killed at its timeout although no api is left to kill it; the restarted api serves the same
session, and closing it ends its sandbox and bills it once.
"""

from __future__ import annotations

import os
import secrets
import signal
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from sqlalchemy import select

from corral.client import ExecResult, Session
from corral.shared.store.db import Database
from corral.shared.store.models import CostEvent, Sandbox
from tests.acceptance.stack import Stack
from tests.conftest import require_bwrap_path
from tests.processes import Proc, all_procs, cmdline

EXEC_TIMEOUT_S = 5.0


@pytest.fixture(scope="module")
def stack(postgres_database_url: str, redis_url: str) -> Iterator[Stack]:
    """A stack of this module's own: its api is killed (the conftest's ``db`` reads it)."""
    require_bwrap_path()
    running = Stack(database_url=postgres_database_url, broker_url=redis_url)
    try:
        yield running.start()
    finally:
        running.stop()


def running(marker: str) -> list[Proc]:
    """The live processes whose command line holds ``marker``."""
    return [proc for proc in all_procs() if proc.state != "Z" and marker in cmdline(proc.pid)]


def _sandbox(db: Database, item_id: str) -> Sandbox:
    with db.session() as session:
        [row] = session.scalars(select(Sandbox).where(Sandbox.work_item_id == item_id)).all()
        session.expunge_all()
    return row


def _costs(db: Database, item_id: str) -> list[CostEvent]:
    with db.session() as session:
        return list(session.scalars(select(CostEvent).where(CostEvent.work_item_id == item_id)))


def _kill_api_during(stack: Stack, box: Session, marker: str) -> BaseException | ExecResult:
    """Start ``sleep <marker>`` in the session, kill the api once it runs in the sandbox;
    what the caller's exec call ended with."""
    with ThreadPoolExecutor(1) as thread:
        call = thread.submit(box.exec, ["sleep", marker], timeout=EXEC_TIMEOUT_S)
        stack.until(
            lambda: [proc for proc in running(marker) if proc.name == "sleep"],
            "the command to run in the session's sandbox",
        )
        api = stack.processes["api"]
        os.killpg(api.pid, signal.SIGKILL)
        api.wait()
        try:
            return call.result(timeout=30)  # an answer would be wrong: it is checked below
        except Exception as error:
            return error


def test_an_exec_cut_by_an_api_crash_fails_and_its_command_dies_at_its_timeout(
    stack: Stack, db: Database
) -> None:
    org = stack.make_org("sessionfaults")
    box = Session.create(
        stack.api_url,
        stack.admin_token,
        org=org,
        project="p",
        profile="default",
        ready_timeout_s=120,
        poll_interval_s=0.1,
    )
    try:
        item_id = box.status()["work_item_id"]
        # A sleep longer than any test: its seconds name it among the host's processes.
        marker = f"{4000 + secrets.randbelow(1000)}.{secrets.randbelow(10**6):06d}"

        ended = _kill_api_during(stack, box, marker)

        # The caller learns at once that the call broke (whether the command ran or not,
        # it cannot tell): no answer, no hang until its read timeout.
        assert isinstance(ended, httpx.TransportError), ended
        stack.start_only(["api"])
        # Nobody is left to stop the command at its timeout but the command's own guard.
        stack.until(
            lambda: not running(marker),
            f"the killed call's command ended by its {EXEC_TIMEOUT_S:g} s timeout",
            timeout_s=EXEC_TIMEOUT_S + 60,
        )

        assert box.status()["state"] == "ready"
        again = box.exec(["sh", "-c", "echo back; exit 3"])
        assert (again.stdout, again.exit_code, again.timed_out) == ("back\n", 3, False)
    finally:
        box.close()

    _, view = stack.request("GET", f"/v1/sessions/{box.id}")
    assert (view["state"], view["end_reason"]) == ("ended", "session_closed")
    costs = stack.until(lambda: _costs(db, item_id), "the session's cost event", timeout_s=60)
    sandbox = stack.until(
        lambda: (row := _sandbox(db, item_id)).terminated_at is not None and row,
        "the session's sandbox ended",
    )
    assert [cost.sandbox_id for cost in costs] == [sandbox.id], "billed once"
    stack.until(
        lambda: not (stack.sandbox_root / str(sandbox.external_id)).exists(),
        "the sandbox's directory removed",
    )
