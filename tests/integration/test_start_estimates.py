"""A waiting item's estimated start (shared/store/estimates.py), on SQLite and PostgreSQL:
those ahead and its own turn at the rate its pool's items ended in the last ten minutes,
unknown when none ended, a lower bound when its place is counted to the cap; the api's
answer, ``corral show`` and the console's item page carry it."""

from __future__ import annotations

from datetime import datetime, timedelta
from pathlib import Path

import pytest
from sqlalchemy import update

from corral.cli.inspect import render_text
from corral.scheduler.admin.views import load_item_view
from corral.scheduler.batch import accept_batch
from corral.shared.store import estimates, places
from corral.shared.store.db import Database, utcnow
from corral.shared.store.lifecycle import transition
from corral.shared.store.models import ItemState, Pool, WorkItem
from corral.worker import pacing
from corral.worker.provision import Outcome, provision_item
from tests.batches import requests_for
from tests.integration.api_clients import ClientFactory
from tests.integration.test_api import admin_headers
from tests.integration.test_console import logged_in, text_of
from tests.integration.test_pacing import World
from tests.seeding import SETTINGS, org_with_pool


def _dispatch(db: Database, org: str) -> str:
    [taken] = accept_batch(db, requests_for(org, 1), actor="test", settings=SETTINGS)
    return taken.item_id


def _ended(db: Database, org: str, *seconds_ago: float) -> None:
    """One item of ``org``'s pool (its one slot free) run and ended that long ago each."""
    now = utcnow()
    for ago in seconds_ago:
        item_id = _dispatch(db, org)
        with db.session() as session:
            item = session.get_one(WorkItem, item_id)
            assert item.state == ItemState.ROUTED.value
            transition(session, item, ItemState.SUCCEEDED, actor="test")
            item.updated_at = now - timedelta(seconds=ago)


def _queue(db: Database, org: str, waiting: int) -> list[str]:
    """One item holding the pool's one slot, then ``waiting`` items waiting behind it."""
    _dispatch(db, org)
    return [_dispatch(db, org) for _ in range(waiting)]


def _waiting(db: Database, item_id: str) -> dict[str, object]:
    view = load_item_view(db, item_id, max_attempts=3)["waiting"]
    assert view is not None
    return dict(view)


def _shown(db: Database, item_id: str) -> str:
    """What ``corral show`` prints of the item."""
    return render_text({**load_item_view(db, item_id, max_attempts=3), "logs": []})


def _start_at(waiting: dict[str, object]) -> datetime:
    assert isinstance(waiting["estimated_start_at"], str)
    return datetime.fromisoformat(waiting["estimated_start_at"])


def test_an_item_waits_for_those_ahead_and_its_own_turn_at_its_pools_recent_rate(
    own_db: Database,
) -> None:
    org = org_with_pool(own_db, "est", max_concurrent=1)
    other = org_with_pool(own_db, "est", max_concurrent=1)
    _ended(own_db, org, 30, 90, 200, 300, 450, 590)  # six in the last ten minutes
    _ended(own_db, org, 700)  # before the window
    _ended(own_db, other, 10, 20, 30)  # another pool's
    *_, last = _queue(own_db, org, 3)
    before = utcnow()
    waiting = _waiting(own_db, last)
    after = utcnow()
    assert waiting["ahead"] == 2 and waiting["estimate"] == "about"
    # One item handed on every 600 / 6 = 100 s: the two ahead, then its own turn.
    assert waiting["estimated_wait_s"] == 300.0
    assert before + timedelta(seconds=300) <= _start_at(waiting) <= after + timedelta(seconds=300)
    assert "starts     in about 5 min (" in _shown(own_db, last)

    # A slot free now (the next re-drive hands it on): its own turn costs no wait.
    with own_db.session() as session:
        session.execute(update(Pool).where(Pool.id == f"pool-{org}").values(max_concurrent=2))
    assert _waiting(own_db, last)["estimated_wait_s"] == 200.0


def test_nothing_handed_on_lately_leaves_the_start_unknown(own_db: Database) -> None:
    org = org_with_pool(own_db, "est", max_concurrent=1)
    _ended(own_db, org, 601, 3600)
    [waits] = _queue(own_db, org, 1)
    waiting = _waiting(own_db, waits)
    assert waiting["ahead"] == 0
    assert (waiting["estimated_start_at"], waiting["estimated_wait_s"], waiting["estimate"]) == (
        None,
        None,
        None,
    )
    assert "starts     unknown: nothing handed on in the last 10 min" in _shown(own_db, waits)


def test_a_place_counted_to_its_cap_gives_a_lower_bound(
    own_db: Database, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(places, "MAX_AHEAD", 2)
    org = org_with_pool(own_db, "est", max_concurrent=1)
    _ended(own_db, org, 60, 120, 180)
    *_, last = _queue(own_db, org, 4)
    waiting = _waiting(own_db, last)
    assert waiting["ahead"] == 2  # three are, counted to the cap
    assert waiting["estimate"] == "at_least"
    assert waiting["estimated_wait_s"] == 600.0  # (2 + 1) x 200 s, at least
    assert "starts     in at least 10 min (" in _shown(own_db, last)


def test_a_busy_pools_rate_is_read_from_its_newest_ends(
    own_db: Database, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(estimates, "RATE_SAMPLE", 3)
    org = org_with_pool(own_db, "est", max_concurrent=1)
    _ended(own_db, org, 70, 80, 90, 100, 500)
    [waits] = _queue(own_db, org, 1)
    waiting = _waiting(own_db, waits)
    # The newest three span 90 s: one every 30 s (not five in ten minutes, one every 120 s).
    assert waiting["estimated_wait_s"] == pytest.approx(30.0, abs=0.5)


def test_a_paced_create_waits_for_its_pools_recent_creates(
    own_db: Database, tmp_path: Path
) -> None:
    world = World(own_db, tmp_path, creates_per_s=1.0, creates_in_flight=4)
    first, second, third = world.routed(), world.routed(), world.routed()
    granted = pacing.admit(world.rt, first)
    assert isinstance(granted, pacing.Grant)
    assert provision_item(world.rt, first, actor="test", pace=granted) is Outcome.PROVISIONED
    pacing.settle(world.rt, granted, succeeded=True)
    for item_id in (second, third):
        assert isinstance(pacing.admit(world.rt, item_id), pacing.Deferred)
    waiting = _waiting(own_db, third)
    assert waiting["reason"] == "provider_pace" and waiting["ahead"] == 1
    # One create in the last ten minutes: the one ahead, then its own, 600 s each (its
    # pace's slot, a second or two away, is sooner: the estimate reads throughput alone).
    assert waiting["estimate"] == "about"
    assert waiting["estimated_wait_s"] == pytest.approx(1200.0)


def test_the_api_and_the_console_say_when_a_waiting_item_may_start(
    make_client: ClientFactory, pg_db: Database
) -> None:
    org = org_with_pool(pg_db, "est", max_concurrent=1)
    _ended(pg_db, org, 100, 200)
    *_, last = _queue(pg_db, org, 2)
    client = make_client()
    answer = client.get(f"/v1/work-items/{last}", headers=admin_headers())
    assert answer.status_code == 200, answer.text
    waiting = answer.json()["waiting"]
    assert waiting["ahead"] == 1 and waiting["estimate"] == "about"
    assert waiting["estimated_wait_s"] == 600.0  # two turns, one every 300 s
    assert _start_at(waiting) > utcnow() + timedelta(seconds=590)

    logged_in(client)
    page = client.get(f"/console/items/{last}")
    assert page.status_code == 200
    assert "starts in about 10 min (" in " ".join(text_of(page.text).split())
