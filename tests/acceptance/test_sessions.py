"""Interactive sessions through real processes: the api, the scheduler, a local provider
worker (bubblewrap sandboxes), the maintenance worker and beat, on PostgreSQL and Redis."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import pytest
from sqlalchemy import select, text

from corral.client import AsyncSession, Session, SessionError
from corral.shared.store.db import Database
from corral.shared.store.models import CostEvent, Sandbox
from tests.acceptance.stack import Stack
from tests.conftest import require_bwrap_path


def _costs(db: Database, work_item_id: str) -> list[CostEvent]:
    with db.session() as session:
        return list(
            session.scalars(select(CostEvent).where(CostEvent.work_item_id == work_item_id))
        )


def _sandboxes(db: Database, work_item_id: str) -> list[Sandbox]:
    with db.session() as session:
        return list(session.scalars(select(Sandbox).where(Sandbox.work_item_id == work_item_id)))


SECRET = "exec-env-value-7f3a9c"


def _stored_text(db: Database) -> str:
    """Every text column of the rows a session writes, as one string."""
    with db.session() as session:
        rows = session.execute(
            text(
                "SELECT payload::text FROM work_items UNION ALL "
                "SELECT coalesce(detail, '') FROM lifecycle_events UNION ALL "
                "SELECT line FROM work_item_logs"
            )
        ).scalars()
        return "\n".join(rows)


LIMIT = 4096  # the stack's output and file limits, small enough to reach


@pytest.fixture(scope="module")
def stack(postgres_database_url: str, redis_url: str) -> Iterator[Stack]:
    """The stack of tests/acceptance/conftest.py, with small output and file limits."""
    require_bwrap_path()
    limits = {
        "CORRAL_INTERACTIVE_OUTPUT_MAX_BYTES": str(LIMIT),
        "CORRAL_INTERACTIVE_FILE_MAX_BYTES": str(LIMIT),
    }
    running = Stack(database_url=postgres_database_url, broker_url=redis_url, extra_env=limits)
    try:
        yield running.start()
    finally:
        running.stop()


@pytest.fixture(scope="module")
def org(stack: Stack) -> str:
    return stack.make_org("sessions")


def _create(stack: Stack, org: str, **fields: Any) -> Session:
    return Session.create(
        stack.api_url,
        stack.admin_token,
        org=org,
        project="p",
        profile="default",
        ready_timeout_s=60,
        poll_interval_s=0.1,
        **fields,
    )


def test_a_session_runs_commands_moves_files_and_is_billed_when_closed(
    stack: Stack, org: str, db: Database
) -> None:
    with _create(stack, org, env={"GREETING": "hello"}) as box:
        status = box.status()
        assert status["state"] == "ready"
        echoed = box.exec(["echo", "hello", "world"])
        assert (echoed.stdout, echoed.exit_code, echoed.timed_out) == ("hello world\n", 0, False)
        # A string runs through the shell; the session's env is the sandbox's.
        shell = box.exec('echo "$GREETING $EXTRA" >&2; exit 3', env={"EXTRA": SECRET})
        assert (shell.stderr, shell.exit_code) == (f"hello {SECRET}\n", 3)
        box.upload_file(b"line one\n", "inbox/data.txt")
        assert box.download_file("inbox/data.txt") == b"line one\n"
        listed = box.exec(["cat", "data.txt"], cwd="inbox")
        assert listed.stdout == "line one\n"
        written = box.exec(["sh", "-c", "printf made > out.bin"])
        assert written.exit_code == 0
        assert box.download_file("out.bin") == b"made"
        item_id = status["work_item_id"]
    # Closed: ended for its caller, its sandbox ended and billed once.
    _, closed = stack.request("GET", f"/v1/sessions/{box.id}")
    assert (closed["state"], closed["end_reason"]) == ("ended", "session_closed")
    costs = stack.until(lambda: _costs(db, item_id), "the session's cost event", timeout_s=60)
    assert len(costs) == 1
    assert costs[0].org_id == org and costs[0].seconds > 0
    (sandbox,) = _sandboxes(db, item_id)
    assert sandbox.terminated_at is not None
    status_code, answer = stack.request(
        "POST", f"/v1/sessions/{box.id}/exec", {"command": ["echo", "late"]}
    )
    assert status_code == 409 and "has ended" in answer["detail"]
    # The exec's env value reached the command and nothing else: no log, no row.
    for name in stack.processes:
        assert SECRET not in stack.log_path(name).read_text(errors="replace"), name
    assert SECRET not in _stored_text(db)


def test_an_idle_session_is_ended_by_the_reaper_and_billed(
    stack: Stack, org: str, db: Database
) -> None:
    box = _create(stack, org, idle_ttl_s=2)
    try:
        assert box.exec(["true"]).exit_code == 0
        item_id = box.status()["work_item_id"]

        def ended() -> dict[str, Any] | None:
            view = box.status()
            return view if view["state"] == "ended" else None

        view = stack.until(ended, "the reaper ends the idle session", timeout_s=60)
        assert view["end_reason"] == "session_idle"
        costs = stack.until(lambda: _costs(db, item_id), "the idle session's cost event")
        assert [cost.termination_reason for cost in costs] == ["session_idle"]
        with pytest.raises(SessionError) as refused:
            box.exec(["echo", "too late"])
        assert refused.value.status == 409
    finally:
        box.close()


def test_the_async_session_has_the_same_calls(stack: Stack, org: str) -> None:
    async def scenario() -> tuple[str, bytes, str]:
        async with await AsyncSession.create(
            stack.api_url,
            stack.admin_token,
            org=org,
            project="p",
            profile="default",
            ready_timeout_s=60,
            poll_interval_s=0.1,
        ) as box:
            result = await box.exec("echo async")
            await box.upload_file(b"\x00\x01binary", "b.bin")
            data = await box.download_file("b.bin")
            return result.stdout, data, box.id

    stdout, data, session_id = asyncio.run(scenario())
    assert (stdout, data) == ("async\n", b"\x00\x01binary")
    _, view = stack.request("GET", f"/v1/sessions/{session_id}")
    assert view["state"] == "ended"


def test_hostile_calls_are_refused_naming_the_field(stack: Stack, org: str) -> None:
    with _create(stack, org) as box:
        base = f"/v1/sessions/{box.id}"
        # Sent as they are (urllib normalises nothing; the api decodes %2E and %2F).
        for path in ("%2E%2E/escape", "a/%2E%2E/%2E%2E/b", "/etc/passwd", "a%2F%2Fb", "%2E"):
            for method in ("GET", "PUT"):
                code, answer = stack.request(method, f"{base}/files/{path}")
                assert code == 422, (method, path, answer)
                assert answer["detail"][0]["field"] == "path"
        code, answer = stack.request("POST", f"{base}/exec", {"command": "echo hi"})
        assert code == 422 and answer["detail"][0]["field"] == "command"
        code, answer = stack.request(
            "POST", f"{base}/exec", {"command": ["true"], "timeout_s": 100_000}
        )
        assert code == 422 and answer["detail"][0]["field"] == "timeout_s"
        code, answer = stack.request("POST", f"{base}/exec", {"command": ["true"], "cwd": ".."})
        assert code == 422 and answer["detail"][0]["field"] == "cwd"
        # Output and files past their limits: cut with a flag, refused naming the field.
        loud = box.exec(["sh", "-c", f"head -c {LIMIT + 100} /dev/zero | tr '\\0' x; echo err >&2"])
        assert (len(loud.stdout), loud.stdout[:3], loud.truncated) == (LIMIT, "xxx", True)
        assert (loud.stderr, loud.exit_code) == ("err\n", 0)
        box.exec(["sh", "-c", f"head -c {LIMIT + 1} /dev/zero > big.bin"])
        code, answer = stack.request("GET", f"{base}/files/big.bin")
        assert code == 422 and answer["detail"][0]["field"] == "path"
        with pytest.raises(SessionError) as too_big:
            box.upload_file(b"x" * (LIMIT + 1), "big-upload.bin")
        assert too_big.value.status == 413
        timed = box.exec(["sleep", "5"], timeout=0.5)
        assert (timed.timed_out, timed.exit_code) == (True, 124)
        with pytest.raises(SessionError) as missing:
            box.download_file("no-such-file")
        assert missing.value.status == 404


def test_a_session_no_pool_can_hold_is_refused(stack: Stack, org: str) -> None:
    code, answer = stack.request(
        "POST",
        "/v1/sessions",
        {"org": org, "project": "p", "profile": "default", "provider": "kubernetes"},
    )
    assert code == 409, answer
    assert "no active pool of provider kubernetes" in answer["detail"]
