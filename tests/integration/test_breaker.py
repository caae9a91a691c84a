"""A pool's circuit breaker on PostgreSQL, through the real routing, provision, claim and
reaper paths: a provider that fails every provision opens it after the threshold, items
spill over to the next pool, after the cool-down one probe goes through, and its runner's
claim closes the breaker; a pool whose sandboxes are made but never claimed opens it too;
all of it in the lifecycle events, the api's metrics and `corral status`'s pools."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import select, update

from corral.providers.testing import InMemoryProvider
from corral.scheduler.admin.overview import pool_rows
from corral.scheduler.api import metrics as api_metrics
from corral.scheduler.batch import accept_batch
from corral.scheduler.intake import accept, route_item
from corral.shared.messages import DispatchRequest
from corral.shared.store.db import utcnow
from corral.shared.store.models import ItemState, LifecycleEvent, Pool
from corral.worker import maintenance
from corral.worker.provision import Outcome, provision_item
from tests.integration.reaping import Reaped, reaped_world

THRESHOLD = 3


@pytest.fixture
def reaped(fresh_pg_url: str, redis_url: str, tmp_path: Path) -> Iterator[Reaped]:
    provider = InMemoryProvider()
    settings = {"breaker_failures": THRESHOLD, "breaker_cooldown_s": 60, "max_attempts": 1}
    with reaped_world(fresh_pg_url, redis_url, tmp_path, provider, **settings) as world:
        world.add_spare_pool()  # "main" (priority 10) first, "spare" after it
        yield world


def _request(**fields: Any) -> DispatchRequest:
    message = {"org": "acme", "project": "web", "profile": "default", **fields}
    return DispatchRequest.model_validate(message | {"work": {"kind": "shell", "command": "true"}})


def _routed_to(reaped: Reaped, item_id: str) -> str | None:
    """Route the item: a new one at intake, a waiting one by the re-drive (which hands on
    the slots of the pools it waits for, closed to fresh arrivals meanwhile)."""
    if reaped.item(item_id).state == ItemState.WAITING_CAPACITY:
        maintenance.redrive(reaped.rt, actor="test")
        state = ItemState(reaped.item(item_id).state)
    else:
        state = route_item(reaped.db, item_id, actor="test", settings=reaped.rt.settings).state
    assert state in (ItemState.ROUTED, ItemState.WAITING_CAPACITY)
    return reaped.item(item_id).pool_id if state is ItemState.ROUTED else None


def _breaker(reaped: Reaped, pool_id: str) -> tuple[str, int]:
    with reaped.db.session() as session:
        pool = session.get(Pool, pool_id)
        assert pool is not None
        return pool.breaker_state, pool.breaker_failures


def _events(reaped: Reaped) -> list[tuple[str | None, str]]:
    with reaped.db.session() as session:
        rows = session.execute(
            select(LifecycleEvent.from_state, LifecycleEvent.to_state)
            .where(LifecycleEvent.entity == "pool")
            .order_by(LifecycleEvent.id)
        )
        return [(row.from_state, row.to_state) for row in rows]


def _open_main(reaped: Reaped, main: str) -> None:
    reaped.provider.fail_permanently("the provider is down")
    for number in range(THRESHOLD):
        item_id = accept(reaped.db, _request(), actor="test").item_id
        assert _routed_to(reaped, item_id) == main
        # The item goes on to the next qualifying pool (or fails when none is left).
        assert provision_item(reaped.rt, item_id, actor="test") is Outcome.FAILED_OVER
        expected = "open" if number == THRESHOLD - 1 else "closed"
        assert _breaker(reaped, main) == (expected, number + 1)


def test_failures_open_the_breaker_items_spill_over_and_a_probe_closes_it(reaped: Reaped) -> None:
    main = f"pool-{reaped.provider.id}"
    _open_main(reaped, main)
    assert _events(reaped) == [("breaker_closed", "breaker_open")]

    # Open: routing passes "main" by, the next pool takes the work.
    reaped.provider.recover()
    item_id = accept(reaped.db, _request(), actor="test").item_id
    assert _routed_to(reaped, item_id) == "pool-spare"
    assert provision_item(reaped.rt, item_id, actor="test") is Outcome.PROVISIONED

    # After the cool-down one item of a batch probes "main"; the others keep passing it by.
    with reaped.db.session() as session:
        session.execute(
            update(Pool)
            .where(Pool.id == main)
            .values(breaker_opened_at=utcnow() - timedelta(seconds=61))
        )
    taken = accept_batch(
        reaped.db, [_request(), _request(), _request()], actor="test", settings=reaped.rt.settings
    )
    pools = [reaped.item(t.item_id).pool_id for t in taken]
    assert sorted(pools) == [main, "pool-spare", "pool-spare"]
    assert _breaker(reaped, main)[0] == "half_open"
    later = accept(reaped.db, _request(), actor="test").item_id
    assert _routed_to(reaped, later) == "pool-spare"  # the probe is in flight

    probe = taken[pools.index(main)].item_id
    assert provision_item(reaped.rt, probe, actor="test") is Outcome.PROVISIONED
    assert _breaker(reaped, main)[0] == "half_open", "made, but no runner has claimed yet"
    reaped.claim(probe)
    assert _breaker(reaped, main) == ("closed", 0)
    assert _events(reaped) == [
        ("breaker_closed", "breaker_open"),
        ("breaker_half_open", "breaker_closed"),  # half open since the probe was routed
    ]


def test_a_failed_probe_opens_the_breaker_again_and_only_pool_has_items_wait(
    reaped: Reaped,
) -> None:
    main = f"pool-{reaped.provider.id}"
    with reaped.db.session() as session:
        session.execute(update(Pool).where(Pool.id == "pool-spare").values(active=False))
    _open_main(reaped, main)
    waiting = accept(reaped.db, _request(), actor="test").item_id
    assert _routed_to(reaped, waiting) is None  # no other pool: it waits, it does not fail
    assert reaped.item(waiting).state == "waiting_capacity"

    with reaped.db.session() as session:
        session.execute(
            update(Pool)
            .where(Pool.id == main)
            .values(breaker_opened_at=utcnow() - timedelta(seconds=61))
        )
    assert _routed_to(reaped, waiting) == main  # the probe
    assert provision_item(reaped.rt, waiting, actor="test") is Outcome.FAILED_OVER
    assert _breaker(reaped, main)[0] == "open"
    outcome = route_item(reaped.db, waiting, actor="test", settings=reaped.rt.settings)
    assert outcome.state is ItemState.FAILED  # no other pool to fail over to
    assert _events(reaped)[-1] == ("breaker_half_open", "breaker_open")


def test_an_open_breaker_shows_in_the_metrics_and_in_status(reaped: Reaped) -> None:
    main = f"pool-{reaped.provider.id}"
    _open_main(reaped, main)
    gauges = {
        tuple(sample.labels.values()): sample.value
        for metric in api_metrics.DatabaseCollector().collect()
        if metric.name == "corral_pool_breaker_open"
        for sample in metric.samples
    }
    assert gauges[(main, "main", "acme", reaped.provider.id)] == 1
    assert gauges[("pool-spare", "spare", "acme", reaped.provider.id)] == 0
    rows = {row["name"]: row["breaker"] for row in pool_rows(reaped.db)}
    assert rows == {"main": "open", "spare": "closed"}


def test_a_success_between_failures_restarts_the_count_and_item_faults_do_not_count(
    reaped: Reaped,
) -> None:
    main = f"pool-{reaped.provider.id}"
    for _ in range(THRESHOLD - 1):  # failures, then a success: "in a row" starts again
        reaped.provider.fail_permanently("down")
        item_id = accept(reaped.db, _request(), actor="test").item_id
        assert _routed_to(reaped, item_id) == main
        assert provision_item(reaped.rt, item_id, actor="test") is Outcome.FAILED_OVER
    reaped.provider.recover()
    assert _breaker(reaped, main) == ("closed", THRESHOLD - 1)
    item_id = accept(reaped.db, _request(), actor="test").item_id
    assert _routed_to(reaped, item_id) == main
    assert provision_item(reaped.rt, item_id, actor="test") is Outcome.PROVISIONED
    reaped.claim(item_id)
    assert _breaker(reaped, main) == ("closed", 0)

    # A pool option the provider refuses is the item's (or the pool's) fault, not an outage.
    with reaped.db.session() as session:
        session.execute(update(Pool).where(Pool.id == main).values(sandbox_config={"bogus": 1}))
    for _ in range(THRESHOLD):
        item_id = accept(reaped.db, _request(), actor="test").item_id
        assert _routed_to(reaped, item_id) == main
        assert provision_item(reaped.rt, item_id, actor="test") is Outcome.FAILED_OVER
        assert reaped.item(item_id).error_code == "invalid_config"
    assert _breaker(reaped, main) == ("closed", 0)


def test_sandboxes_made_but_never_claimed_open_the_breaker_and_their_items_go_elsewhere(
    reaped: Reaped,
) -> None:
    main = f"pool-{reaped.provider.id}"
    again = _request(lease={"max_attempts": 2})  # a sandbox never claimed: another attempt
    items = [accept(reaped.db, again, actor="test").item_id for _ in range(THRESHOLD)]
    for item_id in items:  # made, one after the other; no runner ever comes
        assert _routed_to(reaped, item_id) == main
        assert provision_item(reaped.rt, item_id, actor="test") is Outcome.PROVISIONED
    assert _breaker(reaped, main) == ("closed", 0)
    for item_id in items:
        reaped.backdate(reaped.sandbox(item_id).id, started_at=601)

    report = reaped.sweep()

    assert report.ended == {"never_claimed": THRESHOLD}
    assert sorted(report.requeued) == sorted(items)
    assert _breaker(reaped, main) == ("open", THRESHOLD)
    assert _events(reaped) == [("breaker_closed", "breaker_open")]
    assert {_routed_to(reaped, item_id) for item_id in items} == {"pool-spare"}
