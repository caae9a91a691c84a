"""Provider pacing through real processes (api, scheduler, two ``corral worker --provider e2b``
processes, maintenance, beat) on PostgreSQL and Redis, against the E2B stand-in set to refuse
creates past 5 a second with 429, as E2B's Pro plan does: the two workers share one pace (the
e2b default, 0.9 of that rate), so the stand-in refuses nothing; an item the pace holds says
so; and a storm of rate-limit answers slows the pace and fails no item, counts no retry, and
the pace comes back as creates succeed."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from datetime import datetime
from typing import Any

import pytest
from sqlalchemy import select

from corral.providers.configs.e2b import E2BProviderConfig
from corral.shared.store.db import Database, make_engine
from corral.shared.store.models import ProviderPaceRow
from tests.acceptance.conftest import shell
from tests.acceptance.stack import Stack, e2b_stack
from tests.standins.e2b import E2BStandin

# A rate at the vendor and wall-clock bounds: not beside the parallel suite's load, under which
# the stand-in's own process (which counts each create when it gets to it) can stall and
# then count creates that arrived a second apart as arriving at once.
pytestmark = pytest.mark.alone

ORG = f"pace-{uuid.uuid4().hex[:6]}"
VENDOR_RATE = 5.0  # E2B Pro's sandbox creations a second, which the stand-in enforces
PACE = E2BProviderConfig().creates_per_s or 0.0
CREATES = ("POST", "/v2/sandboxes")


@pytest.fixture(scope="module")
def cloud() -> Iterator[E2BStandin]:
    with E2BStandin() as standin:
        standin.limit_creates(VENDOR_RATE)
        yield standin


@pytest.fixture(scope="module")
def paced_stack(cloud: E2BStandin, postgres_database_url: str, redis_url: str) -> Iterator[Stack]:
    running = e2b_stack(cloud, postgres_database_url, redis_url)
    try:
        running.start_only(
            ["api", "scheduler", "worker-e2b", "worker-e2b+2", "maintenance", "beat"]
        )
        running.make_org(ORG, max_concurrent=500, provider_id="e2b", name="cloud")
        yield running
    finally:
        running.stop()


def _dispatch(stack: Stack, count: int) -> list[str]:
    ids = []
    for _ in range(count):
        status, answer = stack.request("POST", "/v1/dispatch", shell(ORG, "true"))
        assert status == 202, answer
        ids.append(answer["id"])
    return ids


def _all_made(stack: Stack, ids: list[str], timeout_s: float) -> list[dict[str, Any]]:
    """The items' views once every one has its sandbox (or has ended)."""

    def made() -> list[dict[str, Any]] | None:
        views = [stack.request("GET", f"/v1/work-items/{i}")[1] for i in ids]
        done = all(v["state"] not in ("received", "routed", "provisioning") for v in views)
        return views if done else None

    found: list[dict[str, Any]] = stack.until(made, "every item's sandbox", timeout_s=timeout_s)
    return found


def _created_at(cloud: E2BStandin, ids: list[str]) -> list[float]:
    """When the stand-in made each of the items' sandboxes, in order (epoch seconds)."""
    wanted = set(ids)
    return sorted(
        sandbox.started_at.timestamp()
        for sandbox in cloud.sandboxes().values()
        if sandbox.metadata.get("corral.work-item-id") in wanted
    )


def _refused(cloud: E2BStandin) -> int:
    return sum(1 for r in cloud.requests(method=CREATES[0], path=CREATES[1]) if r.status == 429)


def _made_by(stack: Stack, worker: str) -> float:
    samples = stack.scrape(stack.worker_metrics_ports[worker])
    return sum(
        value
        for name, value in samples.items()
        if name.startswith("corral_provision_seconds_count")
        and 'outcome="ok"' in name
        and 'provider="e2b"' in name
    )


def test_two_workers_share_one_pace_and_a_paced_item_says_so(
    paced_stack: Stack, cloud: E2BStandin
) -> None:
    cloud.clear_requests()
    ids = _dispatch(paced_stack, 30)
    last = ids[-1]

    def paced() -> dict[str, Any] | None:
        view = paced_stack.request("GET", f"/v1/work-items/{last}")[1]
        return view if (view.get("waiting") or {}).get("reason") == "provider_pace" else None

    view = paced_stack.until(paced, "the last item to wait for the pace", timeout_s=60)
    assert view["state"] == "routed"  # admitted to its pool, its slot held
    assert view["waiting"]["pools"] == ["cloud"] and view["waiting"]["until"]
    assert datetime.fromisoformat(view["waiting"]["until"]).timestamp() > time.time() - 1

    views = _all_made(paced_stack, ids, timeout_s=120)
    assert {v["state"] for v in views} == {"awaiting_claim"}, views
    assert _refused(cloud) == 0  # one pace for both processes: never past the vendor's rate
    made = _created_at(cloud, ids)
    assert len(made) == len(ids)
    rate = (len(made) - 1) / (made[-1] - made[0])
    assert rate <= PACE * 1.1, rate
    assert _made_by(paced_stack, "worker-e2b") > 0 and _made_by(paced_stack, "worker-e2b+2") > 0


def test_a_storm_of_rate_limit_answers_paces_and_fails_no_item(
    paced_stack: Stack, cloud: E2BStandin
) -> None:
    cloud.clear_requests()
    cloud.fail_next(429, times=5, method=CREATES[0], path=CREATES[1])  # the vendor says stop
    started = time.monotonic()
    ids = _dispatch(paced_stack, 100)
    views = _all_made(paced_stack, ids, timeout_s=180)
    assert {v["state"] for v in views} == {"awaiting_claim"}, [
        (v["id"], v["state"], v["error"]) for v in views if v["state"] != "awaiting_claim"
    ]
    assert {v["attempts"] for v in views} == {1}  # no item requeued for the quota
    creates = cloud.requests(method=CREATES[0], path=CREATES[1])
    refused = _refused(cloud)
    assert len(creates) == len(ids) + refused  # each refusal asked again once, by the pace
    assert 5 <= refused <= 10, refused
    made = _created_at(cloud, ids)
    elapsed = made[-1] - made[0]
    ideal = len(ids) / VENDOR_RATE
    assert elapsed <= 1.5 * ideal, (elapsed, time.monotonic() - started)

    # Slowed by the refusals, the pace came back as the creates succeeded.
    db = Database(make_engine(paced_stack.database_url))
    try:
        with db.session() as session:
            rates = session.scalars(
                select(ProviderPaceRow.rate).where(ProviderPaceRow.provider_id == "e2b")
            ).all()
    finally:
        db.dispose()
    assert rates and all(rate is None for rate in rates), rates
