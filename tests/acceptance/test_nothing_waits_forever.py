"""Nothing waits for ever, through real processes (api, scheduler, ``corral worker --provider
local``, maintenance and beat, on PostgreSQL and Redis): an item fails as ``expired`` at its
message's own expires_at, a running one with its sandbox ended (its process gone) and one
waiting behind it for the org's only slot alike; an item routed to a provider no worker
serves is flagged at once (its routing event, the api's gauge) and fails as ``no_worker``
after its pool's own TTL of 2 s, while an item of a pool on the deployment's TTL waits."""

from __future__ import annotations

import os
import uuid
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from celery import Celery
from sqlalchemy import select

from corral.shared.store.db import Database
from corral.shared.store.models import Pool, Sandbox
from tests.acceptance.conftest import shell
from tests.acceptance.stack import Stack


def _sleeping(seconds: int) -> list[int]:
    """The pids of processes running ``sleep <seconds>`` (a number this test chose)."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            command = (entry / "cmdline").read_bytes().split(b"\0")
        except (OSError, ValueError):
            continue
        if command[:2] == [b"sleep", str(seconds).encode()]:
            found.append(int(entry.name))
    return found


def _events(stack: Stack, item_id: str) -> list[dict[str, Any]]:
    status, body = stack.request("GET", f"/v1/work-items/{item_id}/events")
    assert status == 200, body
    return list(body["events"])


def _in(seconds: float) -> str:
    return (datetime.now(UTC) + timedelta(seconds=seconds)).isoformat()


def test_a_running_item_and_one_waiting_behind_it_fail_at_their_own_expiry(
    stack: Stack, db: Database
) -> None:
    org = stack.make_org(f"exp-{uuid.uuid4().hex[:8]}", max_concurrent=1)
    marker = 3000 + int.from_bytes(os.urandom(2), "big") % 5000  # sleep's seconds: ours alone
    status, running = stack.request(
        "POST", "/v1/dispatch", shell(org, f"sleep {marker}", expires_at=_in(15))
    )
    assert status == 202, running
    stack.until(
        lambda: stack.request("GET", f"/v1/work-items/{running['id']}")[1]["state"] == "running",
        "the first item to run",
    )
    assert stack.until(lambda: _sleeping(marker), "its work to be sleeping")
    status, waiting = stack.request("POST", "/v1/dispatch", shell(org, "true", expires_at=_in(3)))
    assert (status, waiting["state"]) == (202, "waiting_capacity"), waiting

    views = stack.wait_final([waiting["id"], running["id"]], timeout_s=60)

    assert [(v["state"], v["error"]["code"]) for v in views] == [("failed", "expired")] * 2
    assert views[0]["error"]["message"].endswith("it was waiting_capacity")
    assert views[1]["error"]["message"].endswith("it was running")
    moves = [(e["from"], e["to"], e["detail"]) for e in _events(stack, running["id"])]
    assert ("running", "failed", "expired") in moves

    # Its sandbox was ended as at a deadline, its process is gone, and the slot is free.
    def sandbox_end() -> tuple[str | None, str | None]:
        with db.session() as session:
            sandbox = session.scalars(
                select(Sandbox).where(Sandbox.work_item_id == running["id"])
            ).one()
            deadline = sandbox.deadline_at.isoformat() if sandbox.deadline_at else None
            return sandbox.termination_reason, deadline

    # The item's end and its sandbox's are written apart: wait for the sandbox's.
    stack.until(lambda: sandbox_end()[0] is not None, "the sandbox's end to be recorded")
    assert sandbox_end() == ("deadline", views[1]["timestamps"]["expires_at"])
    stack.until(lambda: not _sleeping(marker), "the expired work's process to be gone")
    with db.session() as session:
        assert session.scalars(select(Pool.slots_in_use).where(Pool.org_id == org)).one() == 0


def test_a_provider_nobody_serves_is_flagged_at_once_and_a_pools_own_ttl_fails_its_items(
    stack: Stack, sender: Celery, db: Database
) -> None:
    # Two orgs' pools of e2b, whose worker no test starts: one with a TTL of its own (2 s),
    # one on the deployment's (15 minutes).
    short, default = (f"ttl-{uuid.uuid4().hex[:8]}" for _ in range(2))
    for org, ttl in ((short, 2), (default, None)):
        stack.make_org(org)
        pool = {"org_id": org, "name": "e2b", "provider_id": "e2b", "max_concurrent": 5}
        status, body = stack.request("POST", "/v1/admin/pools", {**pool, "priority": 10})
        assert status == 201, body
        status, body = stack.request(
            "PATCH", f"/v1/admin/pools/{body['id']}", {"routed_ttl_s": ttl}
        )
        assert (status, body["routed_ttl_s"]) == (200, ttl), body
    # Sent by a plain Celery sender, the message's own expiry a datetime (far off).
    later = datetime.now(UTC).replace(microsecond=0) + timedelta(hours=2)
    for org in (short, default):
        message = shell(org, "true", idempotency_key=f"{org}-1", expires_at=later)
        sender.send_task("corral.dispatch", args=[message], queue="dispatch")
    items = [
        stack.until(lambda org=org: _by_key(stack, org), f"{org}'s item to be routed")
        for org in (short, default)
    ]
    for item in items:
        assert item["queue"] == "provision.e2b" and item["timestamps"]["expires_at"] == (
            later.isoformat()
        )
        routed = [e for e in _events(stack, item["id"]) if e["to"] == "routed"]
        assert (
            "(unserved_queue: no worker said in the last minute that it consumes "
            in (routed[0]["detail"])
        )
    gauge = stack.scrape(stack.api_metrics_port)
    assert gauge['corral_unserved_queue_items{queue="provision.e2b"}'] >= 1

    [failed] = stack.wait_final([items[0]["id"]], timeout_s=30)
    assert (failed["state"], failed["error"]["code"]) == ("failed", "no_worker")
    assert "for 2 s (its pool's routed_ttl_s)" in failed["error"]["message"]
    waiting = stack.request("GET", f"/v1/work-items/{items[1]['id']}")[1]
    assert waiting["state"] == "routed"  # the deployment's 15 minutes have not passed
    with db.session() as session:
        slots = dict(
            session.execute(
                select(Pool.org_id, Pool.slots_in_use).where(
                    Pool.org_id.in_([short, default]), Pool.provider_id == "e2b"
                )
            ).all()
        )
    assert slots == {short: 0, default: 1}
    status, _ = stack.request("POST", f"/v1/work-items/{items[1]['id']}/cancel")
    assert status == 200


def _by_key(stack: Stack, org: str) -> dict[str, Any] | None:
    """The org's item (its key ``<org>-1``) once routed."""
    status, body = stack.request("GET", f"/v1/work-items?idempotency_key={org}-1&org={org}")
    assert status == 200, body
    found = body["items"]
    if not found or found[0]["state"] != "routed":
        return None
    return stack.request("GET", f"/v1/work-items/{found[0]['id']}")[1]  # type: ignore[no-any-return]
