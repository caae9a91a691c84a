"""Provider pacing in the provision path (worker/pacing.py), on SQLite and PostgreSQL: creates
beyond a credential's pace wait routed with their slot held and say why, a reserved create
goes at its slot, a rate-limit answer paces its item instead of failing or counting it, one
pace is shared whatever asks, and a provider without limits costs a provision nothing."""

from __future__ import annotations

import threading
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from pydantic import SecretStr
from sqlalchemy import event, select

from corral.cli.inspect import render_text
from corral.providers.credentials import CredentialResolver
from corral.providers.pacing import PaceLimits
from corral.providers.testing import InMemoryProvider
from corral.scheduler.admin.views import load_item_view
from corral.scheduler.intake import accept, route_item
from corral.shared.messages import DispatchRequest
from corral.shared.runtime import Runtime
from corral.shared.settings import CoreSettings
from corral.shared.store import pacing as pace_store
from corral.shared.store.db import Database
from corral.shared.store.models import (
    ItemState,
    ModelProfile,
    Pool,
    ProviderPaceRow,
    Sandbox,
    WorkItem,
)
from corral.worker import pacing
from corral.worker.provision import Outcome, provision_item


@pytest.fixture(params=["postgresql", "sqlite"])
def db(request: pytest.FixtureRequest) -> Database:
    database: Database = request.getfixturevalue(
        "pg_db" if request.param == "postgresql" else "sqlite_db"
    )
    return database


class World:
    """An org with a pool of an in-memory provider paced by ``config``, whose credential is
    this world's own (so that its pace is too)."""

    def __init__(self, db: Database, state_dir: Path, **config: Any) -> None:
        self.db = db
        settings = CoreSettings(
            state_dir=state_dir, broker_url="memory://", admin_token=SecretStr("t" * 32)
        )
        self.rt = Runtime(settings=settings, db=db)
        self.provider = InMemoryProvider(config)
        credential = {"CORRAL_IN_MEMORY_API_KEY": uuid.uuid4().hex}
        self.provider.use_credentials(CredentialResolver(environ=credential))
        self.rt.use_provider(self.provider)
        self.org = f"pace{uuid.uuid4().hex[:8]}"
        self.pool_id = f"pool-{self.org}"
        with db.session() as session:
            if session.get(ModelProfile, "default") is None:
                session.add(ModelProfile(name="default", model="m", auth_mode="byok"))
            session.add(
                Pool(
                    id=self.pool_id,
                    org_id=self.org,
                    name="paced",
                    provider_id=self.provider.id,
                    max_concurrent=50,
                    sandbox_config={},
                )
            )

    def routed(self) -> str:
        message = {
            "org": self.org,
            "project": "web",
            "profile": "default",
            "work": {"kind": "shell", "command": "true"},
        }
        item_id = accept(self.db, DispatchRequest.model_validate(message), actor="test").item_id
        outcome = route_item(self.db, item_id, actor="test", settings=self.rt.settings)
        assert outcome.state is ItemState.ROUTED
        return item_id

    def item(self, item_id: str) -> WorkItem:
        with self.db.session() as session:
            item = session.get(WorkItem, item_id)
            assert item is not None
            return item

    def pace_row(self) -> ProviderPaceRow:
        key = pacing.pace_key(self.rt, self.provider.id, self.org)
        with self.db.session() as session:
            row = session.get(ProviderPaceRow, key)
            assert row is not None
            return row


@pytest.fixture
def world(db: Database, tmp_path: Path) -> Iterator[World]:
    yield World(db, tmp_path, creates_per_s=1.0, creates_in_flight=4)


def test_creates_beyond_the_pace_wait_routed_with_their_reason_and_slot(world: World) -> None:
    first, second, third = world.routed(), world.routed(), world.routed()
    granted = pacing.admit(world.rt, first, provider_hint=world.provider.id)
    assert isinstance(granted, pacing.Grant)
    held = [pacing.admit(world.rt, item_id) for item_id in (second, third)]
    assert all(isinstance(one, pacing.Deferred) for one in held)
    assert [one.reason for one in held] == ["provider_pace", "provider_pace"]
    assert held[1].until - held[0].until == pytest.approx(1.0, abs=0.05)  # one a second

    for item_id, ahead in ((second, 0), (third, 1)):
        item = world.item(item_id)
        assert item.state == ItemState.ROUTED.value  # admitted to its pool: its slot held
        view = load_item_view(world.db, item_id, max_attempts=3)
        waiting = view["waiting"]
        assert waiting["reason"] == "provider_pace" and waiting["pools"] == ["paced"]
        assert waiting["ahead"] == ahead and waiting["until"] is not None
        assert "provider_pace (paced) until" in render_text(view)

    # Back before its slot (a task delivered early): it waits again, the pace untouched.
    tat = world.pace_row().tat
    again = pacing.admit(world.rt, second)
    assert isinstance(again, pacing.Deferred) and again.until == pytest.approx(held[0].until)
    assert world.pace_row().tat == tat

    # At its slot (the pace's clock moved there: no test sleeps) it goes without taking
    # another: the pace is as it was.
    granted_second = pacing.admit(world.rt, second, now=held[0].until)
    assert isinstance(granted_second, pacing.Grant)
    assert world.pace_row().tat == tat
    assert provision_item(world.rt, second, actor="test", pace=granted_second) is (
        Outcome.PROVISIONED
    )
    item = world.item(second)
    assert (item.wait_reason, item.not_before) == (None, None)  # what held it is over
    assert load_item_view(world.db, second, max_attempts=3)["waiting"] is None
    pacing.settle(world.rt, granted_second, succeeded=True)
    assert list(world.pace_row().in_flight) == [first]  # the first is still in flight


def test_creates_beyond_the_cap_in_flight_wait_without_a_slot_of_the_rate(
    db: Database, tmp_path: Path
) -> None:
    world = World(db, tmp_path, creates_in_flight=1)
    first, second = world.routed(), world.routed()
    granted = pacing.admit(world.rt, first)
    assert isinstance(granted, pacing.Grant)
    held = pacing.admit(world.rt, second)
    assert isinstance(held, pacing.Deferred) and held.reason == "provider_in_flight"
    waiting = load_item_view(world.db, second, max_attempts=3)["waiting"]
    assert waiting["reason"] == "provider_in_flight"
    pacing.settle(world.rt, granted, succeeded=True)
    assert isinstance(pacing.admit(world.rt, second, now=held.until), pacing.Grant)


def test_a_rate_limit_answer_paces_the_item_and_neither_fails_nor_counts_it(
    world: World,
) -> None:
    item_id = world.routed()
    granted = pacing.admit(world.rt, item_id)
    assert isinstance(granted, pacing.Grant)
    world.provider.rate_limit(1)
    with pytest.raises(pacing.Paced) as paced:
        provision_item(world.rt, item_id, actor="test", pace=granted)
    assert paced.value.deferred.reason == "provider_pace"

    item = world.item(item_id)
    assert item.state == ItemState.PROVISIONING.value and item.error_code is None
    assert item.wait_reason == "provider_pace" and item.not_before is not None
    view = load_item_view(world.db, item_id, max_attempts=3)
    assert view["waiting"]["reason"] == "provider_pace"
    row = world.pace_row()
    assert row.rate == pytest.approx(0.5) and row.in_flight == {}  # slowed, no longer in flight
    with world.db.session() as session:
        pool = session.get(Pool, world.pool_id)
        assert pool is not None and pool.breaker_failures == 0  # a pace, not a failure
        sandbox = session.scalars(select(Sandbox).where(Sandbox.work_item_id == item_id)).one()
        assert sandbox.lease_until is None  # the attempt is given back for the next try

    again = pacing.admit(world.rt, item_id, now=paced.value.deferred.until)
    assert isinstance(again, pacing.Grant)
    assert provision_item(world.rt, item_id, actor="test", pace=again) is Outcome.PROVISIONED
    pacing.settle(world.rt, again, succeeded=True)
    item = world.item(item_id)
    assert item.state == ItemState.AWAITING_CLAIM.value and item.attempts == 1
    assert (item.wait_reason, item.not_before) == (None, None)
    # One success: a step back up.
    assert world.pace_row().rate == pytest.approx(0.5 + pace_store.RECOVERY_SHARE)


def test_a_provider_without_limits_costs_a_provision_no_round_trip(
    db: Database, tmp_path: Path
) -> None:
    world = World(db, tmp_path)
    assert world.provider.config.pace() is None
    item_id = world.routed()
    statements: list[str] = []

    def count(*args: Any) -> None:
        statements.append(str(args[2]))

    event.listen(db.engine, "before_cursor_execute", count)
    try:
        assert pacing.admit(world.rt, item_id, provider_hint=world.provider.id) is None
    finally:
        event.remove(db.engine, "before_cursor_execute", count)
    assert statements == []


def test_one_pace_is_shared_by_concurrent_askers(pg_db: Database) -> None:
    """Forty creates asked at once from threads of their own: each gets a slot of its own,
    one interval apart (the row's lock serialises them)."""
    key, limits, now = f"in-memory:{uuid.uuid4().hex[:24]}", PaceLimits(creates_per_s=10.0), 50.0
    slots: list[float] = []
    lock = threading.Lock()

    def ask(holder: str) -> None:
        def change(state: pace_store.PaceState) -> tuple[pace_store.PaceState, float]:
            after, decided = pace_store.admit(state, limits, holder, now=now, lease_s=60)
            return after, decided.until if isinstance(decided, pace_store.Wait) else now

        with pg_db.session() as session:
            slot = pace_store.apply(session, key, "in-memory", change)
        with lock:
            slots.append(slot)

    threads = [threading.Thread(target=ask, args=(f"wi-{n}",)) for n in range(40)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sorted(slots) == pytest.approx([now + n / 10 for n in range(40)])
