"""Sharing one capacity between orgs by weight: starvation and weights (part of
:mod:`bench.fairness`).

Real processes (api, scheduler, a local provider worker, the maintenance worker, beat) on
PostgreSQL and Redis; two orgs, each with a local pool on one shared capacity of
``--shared-slots`` (8) slots (:mod:`corral.shared.store.shares`); every item a local
sandbox running ``sleep D``.

- **Starvation**: org A sends ``--flood`` items (1,000) spread over 50 projects; once its
  items hold every slot, org B sends one. B's wait for its sandbox, in item durations
  (target <= 2), beside first come first served: B's item behind every one of A's that
  waited when it came, that count times D over the slots.
- **Weights**: A (weight 3) and B (weight 1) send their items interleaved, each enough to
  fill the capacity alone for the whole window; over ``--window-s`` (300) s, each org's
  part of the slot-seconds held (from routed to finished; target within 10 % of 75/25),
  beside first come first served: the parts the same items would get in the order they
  arrived (interleaved: about 50/50, whatever the weights).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import func, select

from bench.dispatch import REDIS, fresh_database
from bench.harness import deployment_intervals, until
from corral.scheduler.admin.pools import ProfileCreate, create_profile
from corral.shared.store import shares
from corral.shared.store.db import Database, make_engine, utcnow
from corral.shared.store.models import AuthMode, Capacity, ItemState, Pool, WorkItem
from tests.acceptance.stack import Stack

A, B = "org-a", "org-b"


@dataclass(frozen=True)
class SharePlan:
    slots: int
    flood: int
    window_s: float
    duration_s: float


def _seed(db: Database, slots: int, weights: dict[str, int]) -> None:
    create_profile(db, ProfileCreate(name="default", model="m", auth_mode=AuthMode.BYOK))
    with db.session() as session:
        session.add(Capacity(id="cap-shared", name="shared", slots=slots))
        session.flush()
        for org in (A, B):
            session.add(
                Pool(
                    id=f"pool-{org}",
                    org_id=org,
                    name="pool",
                    provider_id="local",
                    max_concurrent=slots,
                    capacity_id="cap-shared",
                    share_limit=0,
                )
            )
            if org in weights:
                shares.set_weight(session, org, weights[org])


def _send(stack: Stack, org: str, number: int, duration_s: float, projects: int = 1) -> str:
    message = {
        "org": org,
        "project": f"p{number % projects}",
        "profile": "default",
        "work": {"kind": "shell", "command": f"sleep {duration_s:g}"},
    }
    status, body = stack.request("POST", "/v1/dispatch", message)
    if status != 202:
        raise RuntimeError(f"dispatch answered {status}: {body}")
    return str(body["id"])


def wait_claimed(stack: Stack, item_id: str, what: str, duration_s: float) -> None:
    """Wait until the item's runner has claimed it (its sandbox started)."""
    until(
        lambda: stack.request("GET", f"/v1/work-items/{item_id}")[1]["timestamps"]["claimed_at"],
        f"{what} claimed",
        timeout_s=60 * duration_s + 60,
        poll_s=0.05,
        check=stack.check_alive,
    )


def _running(db: Database, org: str) -> int:
    with db.session() as session:
        query = select(func.count()).where(
            WorkItem.org_id == org, WorkItem.state == ItemState.RUNNING.value
        )
        return int(session.scalar(query) or 0)


def _waiting(db: Database, org: str) -> int:
    with db.session() as session:
        query = select(func.count()).where(
            WorkItem.org_id == org, WorkItem.state == ItemState.WAITING_CAPACITY.value
        )
        return int(session.scalar(query) or 0)


def _run(plan: SharePlan, weights: dict[str, int], body: Any) -> Any:
    with fresh_database() as url:
        db = Database(make_engine(url))
        _seed(db, plan.slots, weights)
        stack = Stack(
            database_url=url,
            broker_url=REDIS,
            worker_concurrency=max(16, 2 * plan.slots),
            local_max_concurrent=2 * plan.slots,
            extra_env=deployment_intervals(),
        ).start()
        try:
            return body(stack, db)
        finally:
            stack.stop()
            db.dispose()


@dataclass(frozen=True)
class Starvation:
    waits: float  # B's wait for its sandbox, in item durations
    ahead: int  # A's items waiting when B's came
    fifo_waits: float  # first come first served: ahead * D / slots, in durations


def starvation(plan: SharePlan) -> Starvation:
    def body(stack: Stack, db: Database) -> Starvation:
        for number in range(plan.flood):
            _send(stack, A, number, plan.duration_s, projects=50)
        until(
            lambda: _running(db, A) >= plan.slots,
            "org A's items in every slot",
            timeout_s=300,
            poll_s=0.2,
            check=stack.check_alive,
        )
        ahead = _waiting(db, A)
        sent = time.monotonic()
        item = _send(stack, B, 0, plan.duration_s)
        wait_claimed(stack, item, "org B's item", plan.duration_s)
        waited = time.monotonic() - sent
        return Starvation(waited / plan.duration_s, ahead, ahead / plan.slots)

    return _run(plan, {}, body)  # type: ignore[no-any-return]


@dataclass(frozen=True)
class Weights:
    parts: dict[str, float]  # each org's part of the slot-seconds held in the window
    fifo_parts: dict[str, float]  # the parts in arrival order (first come first served)
    slot_seconds: float


def weights(plan: SharePlan) -> Weights:
    # Each org sends enough to fill the capacity alone for the whole window, and more.
    each = int(1.2 * plan.slots * plan.window_s / plan.duration_s) + plan.slots

    def body(stack: Stack, db: Database) -> Weights:
        for number in range(each):
            _send(stack, A, number, plan.duration_s, projects=50)
            _send(stack, B, number, plan.duration_s)
        until(
            lambda: _running(db, A) > 0 and _running(db, B) > 0,
            "both orgs running",
            timeout_s=300,
            poll_s=0.2,
            check=stack.check_alive,
        )
        start = utcnow() + timedelta(seconds=2 * plan.duration_s)  # past the first turn
        end = start + timedelta(seconds=plan.window_s)
        until(
            lambda: utcnow() > end + timedelta(seconds=plan.duration_s),
            "the window over",
            timeout_s=plan.window_s + 10 * plan.duration_s + 60,
            poll_s=1.0,
            check=stack.check_alive,
        )
        if _waiting(db, A) == 0 or _waiting(db, B) == 0:
            raise RuntimeError("an org ran out of waiting items inside the window")
        held = _slot_seconds(db, start, end)
        total = sum(held.values())
        return Weights(
            {org: held.get(org, 0.0) / total for org in (A, B)},
            _arrival_parts(db, start, end),
            total,
        )

    return _run(plan, {A: 3}, body)  # type: ignore[no-any-return]


def _slot_seconds(db: Database, start: datetime, end: datetime) -> dict[str, float]:
    """Each org's slot-seconds (routed to finished, or to now) inside ``[start, end]``."""
    held: dict[str, float] = {}
    with db.session() as session:
        rows = session.execute(
            select(WorkItem.org_id, WorkItem.routed_at, WorkItem.finished_at).where(
                WorkItem.routed_at.is_not(None), WorkItem.routed_at < end
            )
        ).all()
    for org, routed, finished in rows:
        assert routed is not None  # the query's
        begin, until_ = max(routed, start), min(finished or end, end)
        if until_ > begin:
            held[org] = held.get(org, 0.0) + (until_ - begin).total_seconds()
    return held


def _arrival_parts(db: Database, start: datetime, end: datetime) -> dict[str, float]:
    """The parts first come first served would give: the items routed before ``end``, as
    many as there were, taken in the order they arrived."""
    with db.session() as session:
        taken = int(
            session.scalar(
                select(func.count()).where(
                    WorkItem.routed_at.is_not(None), WorkItem.routed_at < end
                )
            )
            or 0
        )
        orgs = session.scalars(
            select(WorkItem.org_id).order_by(WorkItem.created_at, WorkItem.id).limit(taken)
        ).all()
    return {org: orgs.count(org) / max(1, len(orgs)) for org in (A, B)}


def report(*, smoke: bool, slots: int = 8, flood: int = 1000, window_s: float = 300.0) -> None:
    plan = SharePlan(slots, flood, window_s, 2.0)
    if smoke:
        plan = SharePlan(slots=4, flood=16, window_s=8.0, duration_s=1.0)
    found = starvation(plan)
    print(
        f"starvation: org A sent {plan.flood} items over 50 projects onto a capacity of "
        f"{plan.slots} slots shared with org B; B's one item started after "
        f"{found.waits:.2f} item durations (target <= 2); first come first served, behind "
        f"the {found.ahead} of A's waiting: {found.fifo_waits:.0f} item durations",
        flush=True,
    )
    split = weights(plan)
    print(
        f"weights 3:1: over {plan.window_s:g} s both orgs saturating {plan.slots} slots "
        f"({split.slot_seconds:.0f} slot-seconds): A {100 * split.parts[A]:.1f} %, "
        f"B {100 * split.parts[B]:.1f} % (target 75/25 within 10 %); first come first "
        f"served in the same arrival order: A {100 * split.fifo_parts[A]:.1f} %, "
        f"B {100 * split.fifo_parts[B]:.1f} %",
        flush=True,
    )
