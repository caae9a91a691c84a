"""Admission (scheduler/admission.py), on SQLite and PostgreSQL: a freed slot goes to the
org's next waiting item in admission order (priority classes with aging), an item waiting
for full pools keeps its place while another that waits for a pool with room goes, and a
freed slot costs one routing whatever waits behind it."""

from __future__ import annotations

import re
import uuid
from collections import Counter
from datetime import timedelta
from typing import Any

import pytest
from sqlalchemy import event, select, text, update

from corral.cli import status
from corral.cli.inspect import render_text
from corral.scheduler import hand_on as hand_on_module
from corral.scheduler import intake
from corral.scheduler.admin import overview
from corral.scheduler.admin.views import load_item_view
from corral.scheduler.admission import next_waiting, queue_key
from corral.scheduler.batch import accept_batch
from corral.shared import runtime
from corral.shared.messages import DispatchRequest
from corral.shared.store import org_limits
from corral.shared.store.db import Database, utcnow
from corral.shared.store.lifecycle import transition
from corral.shared.store.models import ItemState, ModelProfile, Pool, WorkItem
from corral.worker import maintenance
from tests.seeding import SETTINGS, admitted_item

AGING_S = SETTINGS.priority_aging_s


def _org(db: Database, pools: dict[str, tuple[str, int]]) -> str:
    """A new org with ``pools``: name -> (provider, slots)."""
    org = f"adm{uuid.uuid4().hex[:8]}"
    with db.session() as session:
        if session.get(ModelProfile, "default") is None:
            session.add(ModelProfile(name="default", model="m", auth_mode="byok"))
        for name, (provider, slots) in pools.items():
            session.add(
                Pool(
                    id=f"pool-{org}-{name}",
                    org_id=org,
                    name=name,
                    provider_id=provider,
                    max_concurrent=slots,
                )
            )
    return org


def _dispatch(db: Database, org: str, **fields: Any) -> str:
    return admitted_item(db, org, **fields)


def _finish(db: Database, item_id: str) -> None:
    """The item ends: its slot is free."""
    with db.session() as session:
        item = session.get(WorkItem, item_id)
        assert item is not None
        transition(session, item, ItemState.SUCCEEDED, actor="test")


def _state(db: Database, item_id: str) -> str:
    with db.session() as session:
        state = session.scalar(select(WorkItem.state).where(WorkItem.id == item_id))
    assert state is not None
    return state


def _handed_on(db: Database) -> list[str]:
    """What the re-drive routes now (the test's database holds the test's orgs alone)."""
    rt = runtime.Runtime(settings=SETTINGS, db=db)
    report = maintenance.redrive(rt, actor="test")
    return [o.item_id for o in report.routed if o.state == ItemState.ROUTED]


def _count_routings(monkeypatch: pytest.MonkeyPatch) -> Counter[str]:
    """Counts the hand-on's routings (``route``) from now on."""
    calls: Counter[str] = Counter()
    real = intake.route_item

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls["route"] += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(hand_on_module, "route_item", counted)
    return calls


def test_a_freed_slot_goes_to_the_highest_class_then_by_arrival(own_db: Database) -> None:
    org = _org(own_db, {"one": ("local", 1)})
    running = _dispatch(own_db, org)
    low, normal, high, normal_2 = (
        _dispatch(own_db, org, priority=priority)
        for priority in ("low", "normal", "high", "normal")
    )
    assert {_state(own_db, i) for i in (low, normal, high, normal_2)} == {"waiting_capacity"}
    order = []
    for _ in range(4):
        _finish(own_db, running)
        [running] = _handed_on(own_db)
        order.append(running)
    assert order == [high, normal, normal_2, low]


def test_waiting_long_enough_outranks_a_higher_class(own_db: Database) -> None:
    org = _org(own_db, {"one": ("local", 1)})
    running = _dispatch(own_db, org)
    low = _dispatch(own_db, org, priority="low")
    with own_db.session() as session:  # it has waited two aging periods and a minute
        session.execute(
            update(WorkItem)
            .where(WorkItem.id == low)
            .values(queue_key=utcnow() - timedelta(seconds=2 * AGING_S + 60))
        )
    high = _dispatch(own_db, org, priority="high")
    _finish(own_db, running)
    assert _handed_on(own_db) == [low]
    _finish(own_db, low)
    assert _handed_on(own_db) == [high]


def test_the_place_is_kept_through_a_routing_that_waits_again(own_db: Database) -> None:
    org = _org(own_db, {"one": ("local", 1)})
    _dispatch(own_db, org)
    first, second = _dispatch(own_db, org), _dispatch(own_db, org)
    with own_db.session() as session:
        kept = session.scalar(select(WorkItem.queue_key).where(WorkItem.id == first))
    intake.route_item(own_db, first, actor="test", settings=SETTINGS)  # full: it waits again
    with own_db.session() as session:
        item = session.get(WorkItem, first)
        assert item is not None
        assert item.state == "waiting_capacity"
        assert item.queue_key == kept
        assert item.wait_reason == "pool_full"
        assert item.wait_pools == [f"pool-{org}-one"]
        later = session.scalar(select(WorkItem.queue_key).where(WorkItem.id == second))
    assert kept is not None and later is not None and kept < later


def test_an_item_waiting_for_a_pool_with_room_goes_before_earlier_ones_for_full_pools(
    own_db: Database,
) -> None:
    org = _org(own_db, {"a": ("local", 1), "b": ("docker", 1)})
    _dispatch(own_db, org, provider="local")
    on_b = _dispatch(own_db, org, provider="docker")
    waits_a = _dispatch(own_db, org, provider="local")
    waits_b = _dispatch(own_db, org, provider="docker")
    _finish(own_db, on_b)
    assert _handed_on(own_db) == [waits_b]
    assert _state(own_db, waits_a) == "waiting_capacity"


def test_both_intake_paths_record_the_same_wait(own_db: Database) -> None:
    """The batch writes a new item's wait; routing one item writes a waiting item's again:
    the same reason, pools and key for the same message."""
    org = _org(own_db, {"one": ("local", 1)})
    _dispatch(own_db, org)
    batched = _dispatch(own_db, org, priority="high")
    with own_db.session() as session:
        item = session.get(WorkItem, batched)
        assert item is not None
        written = (item.wait_reason, item.wait_pools, item.queue_key, item.created_at)
        item.queue_key = item.wait_reason = item.wait_pools = None  # as one-by-one meets it
    intake.route_item(own_db, batched, actor="test", settings=SETTINGS)
    with own_db.session() as session:
        again = session.get(WorkItem, batched)
        assert again is not None
        assert (
            (again.wait_reason, again.wait_pools)
            == written[:2]
            == ("pool_full", [f"pool-{org}-one"])
        )
        # Each path keys the item by when it began waiting, less the same head start.
        assert written[2] == queue_key("high", written[3], AGING_S)
        assert again.queue_key is not None and again.queue_key >= written[2]


def test_a_freed_slot_costs_one_routing_whatever_waits(
    own_db: Database, monkeypatch: pytest.MonkeyPatch
) -> None:
    org = _org(own_db, {"one": ("local", 2)})
    running = [_dispatch(own_db, org) for _ in range(2)]
    message = {
        "org": org,
        "project": "p",
        "profile": "default",
        "work": {"kind": "shell", "command": "true"},
    }
    accept_batch(
        own_db,
        [DispatchRequest.model_validate(message) for _ in range(300)],
        actor="test",
        settings=SETTINGS,
    )
    calls = _count_routings(monkeypatch)
    assert _handed_on(own_db) == []  # nothing free: nothing tried
    assert calls["route"] == 0
    _finish(own_db, running[0])
    assert len(_handed_on(own_db)) == 1
    assert calls["route"] == 1


def test_an_org_at_its_limit_is_handed_no_more_than_its_limit_leaves(
    own_db: Database, monkeypatch: pytest.MonkeyPatch
) -> None:
    org = _org(own_db, {"one": ("local", 5)})
    with own_db.session() as session:
        org_limits.set_limit(session, org, 2)
    running = [_dispatch(own_db, org) for _ in range(2)]
    waiting = [_dispatch(own_db, org) for _ in range(3)]
    assert [_state(own_db, item) for item in waiting] == ["waiting_capacity"] * 3
    calls = _count_routings(monkeypatch)
    with own_db.session() as session:  # at its limit: none is read, though its pool has room
        assert next_waiting(session, SETTINGS, limit=200) == []
    _finish(own_db, running[0])

    assert _handed_on(own_db) == waiting[:1]
    assert calls["route"] == 1  # not one per free slot of its pool, the others refused
    assert [_state(own_db, item) for item in waiting] == ["routed"] + ["waiting_capacity"] * 2


def test_a_hand_on_waits_for_no_lock_on_an_orgs_limit(own_db: Database) -> None:
    # Intake locks a limited org's limit while it routes; the hand-on only reads it.
    if own_db.engine.dialect.name != "postgresql":
        return  # SQLite has no row locks: one writer at a time
    org = _org(own_db, {"one": ("local", 5)})
    with own_db.session() as session:
        org_limits.set_limit(session, org, 1)
    running = _dispatch(own_db, org)
    waiting = [_dispatch(own_db, org) for _ in range(2)]
    _finish(own_db, running)
    with own_db.session() as holder:
        org_limits.OrgRoom.read(holder, [org])  # held until this block ends
        with own_db.session() as session:
            session.execute(text("SET LOCAL lock_timeout = '2s'"))
            chosen = next_waiting(session, SETTINGS, limit=200)
    assert chosen == waiting[:1]


def test_no_room_reads_no_waiting_item(own_db: Database) -> None:
    org = _org(own_db, {"one": ("local", 1)})
    _dispatch(own_db, org)
    _dispatch(own_db, org)
    with own_db.session() as session:
        assert next_waiting(session, SETTINGS, limit=200) == []


def test_a_waiting_item_says_what_holds_it_and_its_place(own_db: Database) -> None:
    org = _org(own_db, {"one": ("local", 1)})
    running = _dispatch(own_db, org)
    first, second = _dispatch(own_db, org), _dispatch(own_db, org)
    urgent = _dispatch(own_db, org, priority="high")
    views = {i: load_item_view(own_db, i, max_attempts=3) for i in (first, second, urgent)}
    assert views[urgent]["waiting"] == {
        "reason": "pool_full",
        "pools": ["one"],
        "priority": "high",
        "ahead": 0,
        # Nothing of its pool ended lately: when it may start is unknown.
        "estimated_start_at": None,
        "estimated_wait_s": None,
        "estimate": None,
    }
    assert views[first]["waiting"]["ahead"] == 1  # the high item came before it
    assert views[second]["waiting"]["ahead"] == 2
    assert "waiting    pool_full (one); 2 of its org's items ahead" in render_text(
        {**views[second], "logs": []}
    )
    assert load_item_view(own_db, running, max_attempts=3)["waiting"] is None


def test_an_orgs_projects_take_turns_within_a_class(own_db: Database) -> None:
    """A project that floods its org's pool holds it no longer than its turn: a freed slot
    goes to the project of the org holding fewer slots, though its item came later."""
    org = _org(own_db, {"one": ("local", 2)})
    flood = [_dispatch(own_db, org, project="flood") for _ in range(6)]
    lone = _dispatch(own_db, org, project="lone")
    assert _state(own_db, lone) == "waiting_capacity"
    _finish(own_db, flood[0])
    assert _handed_on(own_db) == [lone]
    _finish(own_db, flood[1])
    assert _handed_on(own_db) == [flood[2]]  # the lone project has nothing more waiting


def test_a_higher_class_goes_before_another_projects_turn(own_db: Database) -> None:
    org = _org(own_db, {"one": ("local", 2)})
    busy = [_dispatch(own_db, org, project="busy") for _ in range(2)]
    normal = _dispatch(own_db, org, project="idle")
    high = _dispatch(own_db, org, project="busy", priority="high")
    _finish(own_db, busy[0])
    assert _handed_on(own_db) == [high]  # its project holds a slot, but it is a class above
    _finish(own_db, busy[1])
    assert _handed_on(own_db) == [normal]


def test_turns_read_each_project_once_whatever_waits_behind(own_db: Database) -> None:
    """The hand-on reads the first item of each project with waiting items, then only the
    next item of the projects chosen: a project's backlog costs it nothing."""
    org = _org(own_db, {"one": ("local", 1)})
    running = _dispatch(own_db, org, project="p0")
    for number in range(40):
        _dispatch(own_db, org, project=f"p{number % 4}")
    _finish(own_db, running)
    statements: list[str] = []

    def seen(*args: Any) -> None:
        statements.append(args[2])

    event.listen(own_db.engine, "before_cursor_execute", seen)
    try:
        with own_db.session() as session:
            assert len(next_waiting(session, SETTINGS, limit=200)) == 1
    finally:
        event.remove(own_db.engine, "before_cursor_execute", seen)
    reads = [s for s in statements if "work_items" in s]
    assert len(reads) <= 3, reads  # the heads, the slots held per project, one next item


def test_a_fresh_arrival_does_not_take_the_slot_a_waiting_item_is_owed(own_db: Database) -> None:
    """A slot freed while items wait is the re-drive's to hand on: an item arriving before
    the re-drive runs waits behind them, on both intake paths; once none waits, the pool
    takes arrivals at intake again."""
    org = _org(own_db, {"one": ("local", 1)})
    _arrivals_wait_behind_the_owed_item(own_db, org)
    _handed_on(own_db)  # nothing waits: the pool is open again
    assert _state(own_db, _dispatch(own_db, org)) == "routed"


def _arrivals_wait_behind_the_owed_item(db: Database, org: str) -> None:
    """One item of ``org`` runs, one waits; the running one ends, and before the re-drive
    runs, an item arrives on each intake path: each waits, and the re-drive hands on the
    owed item, then each arrival in turn as the one before it ends; the last ends too."""
    running = _dispatch(db, org)
    owed = _dispatch(db, org)
    assert _state(db, owed) == "waiting_capacity"
    _finish(db, running)
    batch_fresh = _dispatch(db, org)  # the batch path
    one_fresh = intake.accept(db, _request(org), actor="test")
    routed = intake.route_item(db, one_fresh.item_id, actor="test", settings=SETTINGS)
    assert routed.state == ItemState.WAITING_CAPACITY  # the one-item path
    assert _state(db, batch_fresh) == "waiting_capacity"
    assert _handed_on(db) == [owed]
    for waiting in (batch_fresh, one_fresh.item_id):
        _finish(db, _routed_of(db, org))
        assert _handed_on(db) == [waiting]
    _finish(db, one_fresh.item_id)


def test_a_fresh_arrival_does_not_take_the_room_its_orgs_waiting_items_are_owed(
    own_db: Database,
) -> None:
    """The same for an org at its limit across pools: the room an ending item gives its org
    is the re-drive's to hand to the org's waiting items, on both intake paths; an org
    whose items wait for a full pool instead takes arrivals on a pool with room."""
    org = _org(own_db, {"one": ("local", 5)})
    with own_db.session() as session:
        org_limits.set_limit(session, org, 1)
    _arrivals_wait_behind_the_owed_item(own_db, org)
    assert _state(own_db, _dispatch(own_db, org)) == "routed"  # nothing waits: room again

    # Waiting for a full pool is not waiting for the org's room.
    other = _org(own_db, {"small": ("local", 1), "big": ("docker", 5)})
    with own_db.session() as session:
        org_limits.set_limit(session, other, 3)
    pinned = {"provider": "local"}
    _dispatch(own_db, other, **pinned)
    assert _state(own_db, _dispatch(own_db, other, **pinned)) == "waiting_capacity"
    assert _state(own_db, _dispatch(own_db, other)) == "routed"


def _request(org: str) -> DispatchRequest:
    return DispatchRequest.model_validate(
        {
            "org": org,
            "project": "p",
            "profile": "default",
            "work": {"kind": "shell", "command": "true"},
        }
    )


def _routed_of(db: Database, org: str) -> str:
    with db.session() as session:
        [item_id] = session.scalars(
            select(WorkItem.id).where(WorkItem.org_id == org, WorkItem.state == "routed")
        )
    return item_id


def test_status_shows_each_pools_waiting_items_and_its_own_limit(own_db: Database) -> None:
    org = _org(own_db, {"one": ("local", 2)})
    for _ in range(5):
        _dispatch(own_db, org)
    _finish(own_db, _routed_of_any(own_db, org))  # closed to intake: a share of 1 held
    [row] = [row for row in overview.pool_rows(own_db) if row["org"] == org]
    assert (row["slots_in_use"], row["slot_limit"], row["waiting"]) == (1, 2, "3")
    text = "\n".join(status.render(_status_document(row)))
    assert re.search(rf"{org}\s+one\s+local\s+active\s+1/2\s+3\s", text), text


def _routed_of_any(db: Database, org: str) -> str:
    with db.session() as session:
        return str(
            session.scalars(
                select(WorkItem.id).where(WorkItem.org_id == org, WorkItem.state == "routed")
            ).first()
        )


def _status_document(row: dict[str, Any]) -> dict[str, Any]:
    return {
        "processes": {"nodes": {}},
        "api": {"url": "http://127.0.0.1:1", "from": "test", "answered": False},
        "queues": {"note": "not read"},
        "unserved": [],
        "pools": [row],
        "capacities": [],
        "items": {},
        "failures": {"since_hours": 24, "codes": {}},
    }


def test_a_hand_on_leaves_stranded_items_to_the_periodic_sweep(own_db: Database) -> None:
    """A re-drive a freed slot asks for hands slots on and nothing else; beat's, every
    CORRAL_REDRIVE_INTERVAL_S, also routes an item whose route task was lost."""
    org = _org(own_db, {"one": ("local", 1)})
    stranded = intake.accept(own_db, _request(org), actor="test").item_id  # never routed
    with own_db.session() as session:
        session.execute(
            update(WorkItem)
            .where(WorkItem.id == stranded)
            .values(updated_at=utcnow() - timedelta(seconds=60))
        )
    rt = runtime.Runtime(settings=SETTINGS, db=own_db)
    assert maintenance.redrive(rt, actor="test", sweep=False).routed == []
    assert [o.item_id for o in maintenance.redrive(rt, actor="test").routed] == [stranded]
