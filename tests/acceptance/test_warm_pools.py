"""Warm pools on real processes (issue 19): api, scheduler, a local provider worker, the
maintenance worker and beat, with bubblewrap sandboxes.

A pool with ``warm_min`` 3 gets three waiting warm sandboxes; three items dispatched to it
are bound to exactly those three (the provider makes no sandbox for them), run and succeed;
no enrolment, channel, registration or session token appears in a sandbox's environment, a
process's log, an api answer or the broker's traffic; the pool refills to three; a warm
sandbox past its idle TTL is ended, billed once, and replaced.
"""

from __future__ import annotations

import contextlib
import shlex
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy import select

from corral.shared.store.db import Database
from corral.shared.store.models import RegistrationToken, Sandbox
from tests.acceptance.conftest import RedisMonitor, shell
from tests.acceptance.private_redis import PrivateRedis
from tests.acceptance.stack import Stack, running_stack
from tests.acceptance.warm import exactly, make_pool, provisions, waiting, warm_rows
from tests.processes import all_procs, cmdline, cwd

SCANNER = (Path(__file__).resolve().parents[1] / "token_scan.py").read_text()
PREFIXES = ("cre_", "crw_", "crt_", "crs_")


@pytest.fixture(scope="module")
def stack(postgres_database_url: str, module_redis: PrivateRedis) -> Iterator[Stack]:
    """A stack whose beat ticks warm pools every second (the conftest's ``db`` reads it), on
    a Redis of the module's own, whose every command a test reads (MONITOR)."""
    with running_stack(
        postgres_database_url, module_redis.url, CORRAL_WARM_INTERVAL_S="1"
    ) as running:
        yield running


def sandbox_environments(stack: Stack) -> dict[int, bytes]:
    """The initial environment and command line of every process of the stack's sandboxes
    (their supervisors, bubblewrap, the runners and what they run), read from the host."""
    root = str(stack.sandbox_root)
    found = {}
    for proc in all_procs():
        if cwd(proc.pid).startswith(root) or root in cmdline(proc.pid):
            with contextlib.suppress(OSError):  # it ended meanwhile
                environ = Path(f"/proc/{proc.pid}/environ").read_bytes()
                found[proc.pid] = environ + cmdline(proc.pid).encode()
    return found


def assert_no_token_in_environments(stack: Stack, at_least: int) -> None:
    seen = sandbox_environments(stack)
    assert len(seen) >= at_least, seen.keys()  # the scan did find the sandboxes' processes
    assert any(b"CORRAL_CONTROL_URL" in environ for environ in seen.values())
    for prefix in PREFIXES:
        leaked = [pid for pid, environ in seen.items() if prefix.encode() in environ]
        assert not leaked, (prefix, leaked)


def test_three_items_bind_the_three_warm_sandboxes_and_the_pool_refills(
    stack: Stack, db: Database, redis_monitor: RedisMonitor
) -> None:
    org = f"warm-{uuid.uuid4().hex[:8]}"
    pool_id = make_pool(stack, org, warm_min=3, rate_micros=1000)
    first = stack.until(
        lambda: exactly(db, pool_id, 3),
        "three warm sandboxes waiting",
        timeout_s=60,
    )
    made_before = provisions(stack, "local")
    # Three runners wait, each holding an enrolment credential and a channel token: in
    # memory, never in an environment block or a command line.
    assert_no_token_in_environments(stack, at_least=3)

    command = f"env; python3 -c {shlex.quote(SCANNER)}"
    ids = []
    for _ in range(3):
        status, body = stack.request("POST", "/v1/dispatch", shell(org, command))
        assert status == 202, body
        ids.append(body["id"])
    views = stack.wait_final(ids, timeout_s=90)
    assert [v["state"] for v in views] == ["succeeded"] * 3, views

    with db.session() as session:
        sandboxes = session.scalars(select(Sandbox).where(Sandbox.work_item_id.in_(ids))).all()
        handles = {row.work_item_id: row.external_id for row in sandboxes}
        tokens = session.scalars(
            select(RegistrationToken).where(RegistrationToken.work_item_id.in_(ids))
        ).all()
        # A revoked token is marked redeemed and expired at once; a redeemed one is not.
        redeemed = [
            token.sandbox_id
            for token in tokens
            if token.redeemed_at is not None and token.expires_at > token.redeemed_at
        ]
    assert len(sandboxes) == 3, "one sandbox row per item: no item was provisioned twice"
    assert set(handles.values()) == first, "each item ran in one of the three warm sandboxes"
    assert provisions(stack, "local") == made_before, "the provider made no sandbox for the items"
    assert sorted(redeemed) == sorted(row.id for row in sandboxes), "one token redeemed each"
    bound = {row.id: row for row in warm_rows(db, pool_id) if row.state == "bound"}
    assert set(bound) == first
    assert {row.work_item_id for row in bound.values()} == set(ids)
    assert all(row.handed_over_at is not None for row in bound.values())
    assert all((row.idle_amount_micros or 0) > 0 for row in bound.values()), "idle time billed"

    _assert_no_token_anywhere(stack, ids, redis_monitor)

    refilled = stack.until(
        lambda: exactly(db, pool_id, 3),
        "the pool refilled to three warm sandboxes",
        timeout_s=60,
    )
    assert not refilled & first, "a warm sandbox is never offered a second item"
    assert_no_token_in_environments(stack, at_least=3)


def _assert_no_token_anywhere(stack: Stack, ids: list[str], redis_monitor: RedisMonitor) -> None:
    traffic = redis_monitor.stop()
    assert b"corral.warm.provision" in traffic  # the monitor saw the warm tasks
    logs = [stack.request("GET", f"/v1/work-items/{i}/logs")[1] for i in ids]
    out = [line["line"] for entry in logs for line in entry["lines"]]
    assert any(line.startswith("CORRAL_CONTROL_URL=") for line in out), out  # env was printed
    assert any(line == "scan done" for line in out), out
    [runner, *_] = [line for line in out if line.startswith("scanned") and "-m runner" in line]
    assert "environ=denied mem=denied" in runner, runner
    assert not [line for line in out if line.startswith("found")], out
    answers = str(logs) + str([stack.request("GET", f"/v1/work-items/{i}")[1] for i in ids])
    for prefix in PREFIXES:
        assert prefix.encode() not in traffic, prefix
        assert prefix not in answers, prefix
        for name in stack.processes:
            assert prefix not in stack.log_path(name).read_text(errors="replace"), name


def test_an_item_that_needs_the_network_goes_cold(stack: Stack, db: Database) -> None:
    org = f"warm-{uuid.uuid4().hex[:8]}"
    pool_id = make_pool(stack, org, warm_min=1)
    stack.until(lambda: waiting(db, pool_id), "a warm sandbox waiting", timeout_s=60)
    message = shell(org, "echo cold") | {"egress": {"allow_network": True}}
    status, body = stack.request("POST", "/v1/dispatch", message)
    assert status == 202, body
    [view] = stack.wait_final([body["id"]])
    assert view["state"] == "succeeded", view
    with db.session() as session:
        [row] = session.scalars(select(Sandbox).where(Sandbox.work_item_id == body["id"])).all()
    assert row.external_id == row.id, "its own sandbox, made for it"
    assert [r.state for r in warm_rows(db, pool_id)] == ["waiting"], "the warm one still waits"


def test_a_warm_sandbox_past_its_idle_ttl_is_ended_billed_and_replaced(
    stack: Stack, db: Database
) -> None:
    org = f"warm-{uuid.uuid4().hex[:8]}"
    pool_id = make_pool(stack, org, warm_min=1, warm_idle_ttl_s=10, rate_micros=1000)
    [first] = stack.until(lambda: waiting(db, pool_id), "a warm sandbox waiting", timeout_s=60)
    ended = stack.until(
        lambda: [r for r in warm_rows(db, pool_id) if r.id == first and r.state == "ended"],
        "the warm sandbox ended after its idle TTL",
        timeout_s=60,
    )
    assert ended[0].end_reason == "idle_ttl"
    assert (ended[0].idle_seconds or 0) >= 10
    assert abs((ended[0].idle_amount_micros or 0) - (ended[0].idle_seconds or 0) * 1000) <= 1
    stack.until(
        lambda: not (stack.sandbox_root / first).exists(), "its sandbox removed", timeout_s=30
    )
    replacement = stack.until(
        lambda: waiting(db, pool_id) - {first}, "a new warm sandbox waiting", timeout_s=60
    )
    assert first not in replacement
