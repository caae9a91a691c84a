"""Signed webhooks through real processes (api, scheduler, a local provider worker, the
maintenance worker and beat) on PostgreSQL and Redis (issue 35): an org's endpoint, a
receiver on loopback (the deployment opens it: CORRAL_WEBHOOK_OPEN_NETWORKS and
CORRAL_WEBHOOK_ALLOW_HTTP), gets one signed, verifiable item.final event per final item
(deduplicated by event id: at least once, so the same event may come twice), none lost
although the api, the scheduler and both workers are SIGKILLed twice during the run (and
started again) and the receiver is down for 30 s of it. Items arrive over HTTP and as
Celery messages; some fail, some are dispatch errors.

The down window is the one sleep: the point of the test. The rest waits on conditions. An
event that failed while the receiver was down is tried again after its back-off (2 s, 4 s,
8 s, ... so at most about 32 s after the window); a delivery run the kill cut short leaves
its claimed rows to the next run once its claim ends (CORRAL_OUTCOME_CLAIM_S, 15 s here).
"""

from __future__ import annotations

import os
import signal
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from sqlalchemy import func, select

from corral.shared.broker import celery_app
from corral.shared.settings import CoreSettings
from corral.shared.store.db import Database, make_engine
from corral.shared.store.models import FINAL_ITEM_STATES, WebhookDelivery, WorkItem
from tests.acceptance.conftest import shell
from tests.acceptance.stack import Stack
from tests.conftest import TEST_SECRET_KEY, require_bwrap_path
from tests.webhook_receivers import Receiver

DOWN_S = 30.0
KILLED = ["api", "scheduler", "worker-local", "maintenance"]
FINAL = {state.value for state in FINAL_ITEM_STATES}


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    found = Receiver()
    yield found
    found.stop()


@pytest.fixture
def webhook_stack(
    receiver: Receiver, postgres_database_url: str, redis_url: str
) -> Iterator[Stack]:
    require_bwrap_path()
    running = Stack(
        database_url=postgres_database_url,
        broker_url=redis_url,
        extra_env={
            "CORRAL_SECRET_KEY": TEST_SECRET_KEY,
            "CORRAL_WEBHOOK_ALLOW_HTTP": "true",
            "CORRAL_WEBHOOK_OPEN_NETWORKS": f"127.0.0.1:{receiver.port}",
            # What a killed process held comes back soon: the scheduler's messages after
            # 1 s, a provision task after 10 s (the re-drive sends it again), the outbox
            # rows a delivery run had claimed after 15 s.
            "CORRAL_INTAKE_LEASE_S": "1",
            "CORRAL_PROVISION_LEASE_S": "10",
            "CORRAL_OUTCOME_CLAIM_S": "15",
        },
    )
    try:
        yield running.start()
    finally:
        running.stop()


class Run:
    """The test's org, what it sent, and a view of the database."""

    def __init__(self, stack: Stack) -> None:
        self.stack = stack
        self.org = stack.make_org(f"hooks-{uuid.uuid4().hex[:8]}")
        self.sent = 0
        self.db = Database(make_engine(stack.database_url))
        self.sender = celery_app.configure(
            CoreSettings(broker_url=stack.broker_url, broker_key_prefix=stack.key_prefix)
        )

    def over_http(self, count: int) -> None:
        for number in range(count):
            status, body = self.stack.request(
                "POST", "/v1/dispatch", shell(self.org, f"sleep 1; echo http-{number}")
            )
            assert status == 202, body
            self.sent += 1

    def as_celery(self, count: int) -> None:
        """``count`` Celery messages: succeeding, failing, and refused (an unknown profile)."""
        for number in range(count):
            kind = number % 3
            message = shell(self.org, f"sleep 1; echo celery-{number}" + "; exit 3" * (kind == 1))
            if kind == 2:
                message["profile"] = "no-such-profile"
            self.sender.send_task("corral.dispatch", args=[message], queue="dispatch")
            self.sent += 1

    def items(self) -> dict[str, str]:
        with self.db.session() as session:
            query = select(WorkItem.id, WorkItem.state).where(WorkItem.org_id == self.org)
            return {item_id: state for item_id, state in session.execute(query)}

    def all_final(self) -> dict[str, str] | None:
        items = self.items()
        done = len(items) == self.sent and set(items.values()) <= FINAL
        return items if done else None

    def finals(self) -> int:
        return sum(state in FINAL for state in self.items().values())

    def failed_tries(self) -> int:
        with self.db.session() as session:
            query = select(func.count()).where(
                WebhookDelivery.org_id == self.org, WebhookDelivery.status.is_(None)
            )
            return int(session.scalar(query) or 0)


def _kill_and_restart(stack: Stack) -> None:
    """SIGKILL the api, the scheduler and both workers (their process groups), then start
    them again."""
    for name in KILLED:
        process = stack.processes[name]
        os.killpg(process.pid, signal.SIGKILL)
        assert process.wait() == -signal.SIGKILL
    stack.start_only(KILLED)


def _events(receiver: Receiver, secret: str) -> dict[str, list[dict[str, Any]]]:
    """The events received, each verified as the documented snippet does, deduplicated
    by their id; by the item each is of."""
    unique = {event["id"]: event for event in receiver.verified(secret)}
    by_item: dict[str, list[dict[str, Any]]] = {}
    for event in unique.values():
        by_item.setdefault(event["data"]["id"], []).append(event)
    return by_item


def test_every_final_item_sends_one_signed_event_through_kills_and_a_receiver_outage(
    webhook_stack: Stack, receiver: Receiver
) -> None:
    stack = webhook_stack
    run = Run(stack)
    try:
        status, made = stack.request(
            "POST", f"/v1/admin/orgs/{run.org}/webhooks", {"url": receiver.url}
        )
        assert status == 201, made
        secret = made["secret"]

        run.over_http(8)
        run.as_celery(6)
        stack.until(lambda: run.finals() > 0, "an item to end")
        _kill_and_restart(stack)  # items in flight: provisioning, running, ending

        receiver.stop()
        down_until = time.monotonic() + DOWN_S
        ended = run.finals()
        run.as_celery(6)
        run.over_http(4)
        stack.until(lambda: run.finals() > ended, "an item to end while the receiver is down")
        _kill_and_restart(stack)  # with events owed, and backing off
        time.sleep(max(0.0, down_until - time.monotonic()))  # the rest of the outage
        receiver.start()
        assert run.failed_tries() > 0  # the outage was felt: tries failed, logged

        items = stack.until(run.all_final, "every item to end", 90)
        stack.until(
            lambda: _events(receiver, secret).keys() >= items.keys(),
            "an event for every final item",
            90,
        )
        events = _events(receiver, secret)
        assert events.keys() == items.keys()
        for item_id, state in items.items():
            [event] = events[item_id]  # one event per item, however often it came
            assert (event["type"], event["data"]["state"]) == ("item.final", state)
        assert {"succeeded", "failed", "dispatch_error"} <= set(items.values()), items
        assert len(receiver.deliveries()) >= len(events)
    finally:
        run.db.dispose()
