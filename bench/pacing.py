"""Provider pacing: items sent at once onto a provider that refuses creates past its rate.

A case of ``bench.fairness``. Real processes (api, scheduler, a ``corral worker --provider
e2b``, the maintenance worker, beat) on PostgreSQL and Redis, against the E2B stand-in
(tests/standins/e2b.py) in this process, set to refuse creates past 5 a second with 429
(E2B Pro's rate; a token bucket holding a second's worth). ``items`` (100) are sent at once
onto a pool with room for all of them, twice:

- **anchor**, pacing off (``creates_per_s`` and ``creates_in_flight`` null), as before:
  the 429s are retried (the SDK's own retries, then the provision task's), and an item whose
  retries run out is requeued or failed;
- **paced**, e2b's defaults (0.9 of 5 a second, one at a time, 20 in flight).

Each run says how many create calls the stand-in answered and how many it refused, how
many items failed or were requeued, and when the last sandbox was made after the first
dispatch, against the ideal ``items / 5`` s (20 s; target for the paced run: no item fails
or is retried for the quota, the last sandbox within 1.2x the ideal).

And what the pace costs a provision (:func:`pace_cost`): the gate's admission and its
settling, in this process on PostgreSQL, for a provider paced so fast that every create
goes (the pace's work alone), beside one without limits (its statements: none).
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass

from sqlalchemy import event, func, select

from bench.dispatch import REDIS, fresh_database
from bench.harness import WaitTimeoutError, until
from corral.providers.testing import InMemoryProvider
from corral.scheduler.admin.pools import PoolCreate, ProfileCreate, create_pool, create_profile
from corral.scheduler.intake import accept, route_item
from corral.shared.messages import DispatchRequest
from corral.shared.runtime import Runtime
from corral.shared.settings import CoreSettings
from corral.shared.store.db import Database, make_engine
from corral.shared.store.models import AuthMode, ItemState, Pool, WorkItem
from corral.worker import pacing as pacing_gate
from tests.acceptance.stack import Stack, e2b_stack
from tests.standins.e2b import E2BStandin

ORG = "paced"
VENDOR_RATE = 5.0  # the stand-in's creates a second, as E2B Pro's
UNPACED = {"creates_per_s": None, "creates_in_flight": None}
_WORK = {"kind": "shell", "command": "true"}


@dataclass(frozen=True)
class PacingRun:
    """What one run of ``items`` saw."""

    items: int
    made: int  # items whose sandbox was made within the run's deadline
    creates: int  # create calls the stand-in answered
    refused: int  # ... with 429
    failed: int  # items failed
    requeued: int  # items routed again (their provision gave up after its retries)
    last_s: float  # from the first dispatch to the last sandbox made

    @property
    def ideal_s(self) -> float:
        return self.items / VENDOR_RATE

    def line(self, name: str) -> str:
        return (
            f"pacing, {name}: {self.made} of {self.items} sandboxes made, the last "
            f"{self.last_s:.1f} s after the first dispatch ({self.last_s / self.ideal_s:.2f}x "
            f"the ideal {self.ideal_s:.0f} s); {self.creates} create calls, {self.refused} "
            f"refused (429); {self.failed} items failed, {self.requeued} requeued"
        )


def run(items: int, *, paced: bool) -> PacingRun:
    """Send ``items`` at once onto the stand-in, paced or not (the anchor)."""
    with E2BStandin() as cloud, fresh_database() as url:
        cloud.limit_creates(VENDOR_RATE)
        db = Database(make_engine(url))
        create_profile(db, ProfileCreate(name="default", model="m", auth_mode=AuthMode.BYOK))
        create_pool(
            db, PoolCreate(org_id=ORG, name="cloud", provider_id="e2b", max_concurrent=items)
        )
        stack = e2b_stack(cloud, url, REDIS, **({} if paced else UNPACED))
        try:
            stack.start_only(["api", "scheduler", "worker-e2b", "maintenance", "beat"])
            return _measure(stack, db, cloud, items)
        finally:
            stack.stop()
            db.dispose()


def _measure(stack: Stack, db: Database, cloud: E2BStandin, items: int) -> PacingRun:
    started = time.time()
    for _ in range(items):
        message = {"org": ORG, "project": "web", "profile": "default", "work": _WORK}
        status, body = stack.request("POST", "/v1/dispatch", message)
        if status != 202:
            raise RuntimeError(f"dispatch answered {status}: {body}")
    ideal = items / VENDOR_RATE
    # The anchor may not make them all in time: what it made by then is its figure.
    with contextlib.suppress(WaitTimeoutError):
        until(
            lambda: len(cloud.sandboxes()) >= items,
            f"{items} sandboxes made",
            timeout_s=4 * ideal + 30,
            poll_s=0.2,
            check=stack.check_alive,
        )
    made_at = [sandbox.started_at.timestamp() for sandbox in cloud.sandboxes().values()]
    creates = cloud.requests(method="POST", path="/v2/sandboxes")
    with db.session() as session:
        failed = session.scalar(
            select(func.count()).where(WorkItem.state == ItemState.FAILED.value)
        )
        requeued = session.scalar(select(func.count()).where(WorkItem.attempts > 1))
    return PacingRun(
        items=items,
        made=len(made_at),
        creates=len(creates),
        refused=sum(1 for request in creates if request.status == 429),
        failed=int(failed or 0),
        requeued=int(requeued or 0),
        last_s=(max(made_at) - started) if made_at else float("nan"),
    )


def pace_cost(rounds: int) -> tuple[float, int]:
    """(milliseconds a provision spends in the pace when its provider is paced, statements
    run for one that is not)."""
    with fresh_database() as url:
        db = Database(make_engine(url))
        try:
            return _pace_cost(db, rounds)
        finally:
            db.dispose()


def _pace_cost(db: Database, rounds: int) -> tuple[float, int]:
    settings = CoreSettings(broker_url="memory://")
    rt = Runtime(settings=settings, db=db)
    fast = InMemoryProvider({"creates_per_s": 10_000.0, "creates_in_flight": 10_000})
    rt.use_provider(fast)
    create_profile(db, ProfileCreate(name="default", model="m", auth_mode=AuthMode.BYOK))
    with db.session() as session:  # create_pool knows only the registered providers
        session.add(
            Pool(
                id="pool-mem",
                org_id=ORG,
                name="mem",
                provider_id=fast.id,
                max_concurrent=rounds,
                sandbox_config={},
            )
        )
    ids = []
    for _ in range(rounds):
        message = {"org": ORG, "project": "web", "profile": "default", "work": _WORK}
        item_id = accept(db, DispatchRequest.model_validate(message), actor="bench").item_id
        route_item(db, item_id, actor="bench", settings=settings)
        ids.append(item_id)
    started = time.perf_counter()
    for item_id in ids:
        grant = pacing_gate.admit(rt, item_id, provider_hint=fast.id)
        assert isinstance(grant, pacing_gate.Grant)
        pacing_gate.settle(rt, grant, succeeded=True)
    paced_ms = 1000 * (time.perf_counter() - started) / rounds
    statements: list[object] = []
    rt.use_provider(InMemoryProvider())  # no limits
    event.listen(db.engine, "before_cursor_execute", lambda *_: statements.append(1))
    pacing_gate.admit(rt, ids[0], provider_hint=fast.id)
    return paced_ms, len(statements)


def report(*, smoke: bool) -> None:
    """Print the paced run beside its anchor, measured in the same run."""
    paced_ms, unpaced = pace_cost(20 if smoke else 500)
    print(
        f"pacing, its cost: {paced_ms:.2f} ms a provision of a paced provider (admitted and "
        f"settled, PostgreSQL), {unpaced} statements for one without limits",
        flush=True,
    )
    items = 6 if smoke else 100
    anchor = run(items, paced=False)
    print(anchor.line("anchor (no pacing)"), flush=True)
    paced = run(items, paced=True)
    print(
        f"{paced.line('paced (e2b defaults)')} (target: none failed or retried for the "
        "quota, the last within 1.2x the ideal)",
        flush=True,
    )
