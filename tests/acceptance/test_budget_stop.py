"""A budget that stops running work, through real processes (issue 34): an org with a budget
``on_cap: stop`` runs two long items in local sandboxes (bubblewrap) billed by the second;
once their spend crosses the cap, the maintenance worker's reaper ends both within one
reaper period (plus the time the provider takes to stop them), with ``budget_exhausted``,
their items fail with that code, and the org's spend passes the cap by no more than what the
two run up in that time. Each threshold of the budget was warned of once, and the api's
metrics show the spend ratio, the reaper's last sweep, the intake's progress and the queues'
consumers."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from datetime import datetime, timedelta

import pytest
from sqlalchemy import func, select

from corral.shared.store.db import Database, utcnow
from corral.shared.store.models import CostEvent, LifecycleEvent, Sandbox
from tests.acceptance.conftest import shell
from tests.acceptance.stack import Stack, running_stack

REAPER_INTERVAL_S = 2.0
RATE = 100_000  # micro-units a second, per sandbox (wall-clock)
CAP = 600_000  # two sandboxes cross it about 3 s after they start
# Ending is not instant once the sweep decides: the provider stops the sandbox (SIGTERM, and
# SIGKILL after the local provider's grace period of 1 s in the stack) before the end is
# recorded; and beat's schedule and a loaded two-core machine add their part.
STOP_LATENCY_S = 1.5


@pytest.fixture(scope="module")
def stack(postgres_database_url: str, redis_url: str) -> Iterator[Stack]:
    """A stack of this module's own: a reaper period of 2 s, metrics with org labels."""
    with running_stack(
        postgres_database_url,
        redis_url,
        CORRAL_REAPER_INTERVAL_S=str(REAPER_INTERVAL_S),
        CORRAL_METRICS_ORG_LABELS="true",
    ) as running:
        yield running


def _org_with_a_stop_budget(stack: Stack) -> str:
    org = f"stop-{uuid.uuid4().hex[:8]}"
    profile = {"name": "default", "model": "m", "auth_mode": "byok"}
    assert stack.request("POST", "/v1/admin/profiles", profile)[0] in (201, 409)
    pool = {"org_id": org, "name": "local", "provider_id": "local", "max_concurrent": 4}
    pool |= {"billing_model": "wall-clock", "rate_micros": RATE}
    assert stack.request("POST", "/v1/admin/pools", pool)[0] == 201
    budget = {"org_id": org, "period": "day", "cap_micros": CAP, "on_cap": "stop"}
    status, body = stack.request("PUT", "/v1/admin/budgets", budget)
    assert status == 200 and body["on_cap"] == "stop", body
    return org


def _crossing(starts: list[datetime]) -> datetime:
    """When sandboxes started at ``starts``, each run up ``RATE`` a second, reached ``CAP``."""
    at = max(starts)
    run_up = sum(RATE * (at - start).total_seconds() for start in starts)
    return at + timedelta(seconds=(CAP - run_up) / (RATE * len(starts)))


@pytest.mark.alone  # a bound in wall-clock time: not beside the parallel suite's load
def test_a_stop_budget_ends_the_running_sandboxes_within_a_reaper_period(
    stack: Stack, db: Database
) -> None:
    org = _org_with_a_stop_budget(stack)
    items = []
    for _ in range(2):
        status, answer = stack.request("POST", "/v1/dispatch", shell(org, "sleep 300"))
        assert status == 202, answer
        items.append(answer["id"])

    views = stack.wait_final(items, timeout_s=60)

    assert [(v["state"], v["error"]["code"]) for v in views] == [("failed", "budget_exhausted")] * 2
    with db.session() as session:
        sandboxes = session.scalars(select(Sandbox).where(Sandbox.org_id == org)).all()
        spent = session.scalar(
            select(func.sum(CostEvent.amount_micros)).where(CostEvent.org_id == org)
        )
        warnings = session.execute(
            select(LifecycleEvent.from_state, LifecycleEvent.to_state)
            .where(LifecycleEvent.entity == "budget", LifecycleEvent.detail.contains(org))
            .order_by(LifecycleEvent.id)
        ).all()
    assert [s.termination_reason for s in sandboxes] == ["budget_exhausted"] * 2
    crossed = _crossing([s.started_at for s in sandboxes if s.started_at is not None])
    late = max((s.terminated_at - crossed).total_seconds() for s in sandboxes if s.terminated_at)
    assert late <= REAPER_INTERVAL_S + STOP_LATENCY_S, f"ended {late:.2f} s after the crossing"
    one_period = 2 * RATE * (REAPER_INTERVAL_S + STOP_LATENCY_S)
    assert CAP <= int(spent or 0) <= CAP + one_period, (spent, late)
    assert [tuple(w) for w in warnings] == [(None, "50%"), ("50%", "80%"), ("80%", "100%")]
    _the_api_metrics_show_it(stack, org)


def _the_api_metrics_show_it(stack: Stack, org: str) -> None:
    def scrape() -> dict[str, float]:
        return stack.scrape(stack.api_metrics_port)

    ratio = f'corral_budget_spend_ratio{{org="{org}",period="day",pool="",set_by="deployment"}}'
    metrics = stack.until(lambda: (m := scrape()).get(ratio, 0) >= 1 and m, "a spent ratio")
    now = utcnow().timestamp()
    assert now - metrics["corral_reaper_last_sweep_timestamp_seconds"] < 60
    assert now - metrics["corral_intake_last_progress_timestamp_seconds"] < 60
    assert metrics['corral_queue_consumers{queue="provision.local"}'] >= 1
    assert metrics['corral_queue_consumers{queue="maintenance"}'] >= 1
    assert metrics['corral_queue_consumers{queue="dispatch"}'] >= 1
    assert metrics['corral_queue_messages{queue="provision.local"}'] == 0
    assert metrics["corral_metrics_broker_up"] == 1
