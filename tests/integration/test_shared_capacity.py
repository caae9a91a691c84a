"""A capacity shared by several orgs' pools (corral.shared.store.shares), on SQLite and
PostgreSQL, through the real intake and re-drive: a newcomer is not starved by a flood,
weights divide the slots, an org's projects are one org, and the capacity's slots are
never exceeded whichever routing path takes them."""

from __future__ import annotations

import threading
import uuid
from collections import Counter
from typing import Any

from sqlalchemy import func, select

from corral.scheduler import intake
from corral.scheduler.batch import accept_batch
from corral.shared import runtime
from corral.shared.messages import DispatchRequest
from corral.shared.store import shares
from corral.shared.store.db import Database, make_engine
from corral.shared.store.lifecycle import transition
from corral.shared.store.models import (
    Capacity,
    ItemState,
    LifecycleEvent,
    ModelProfile,
    Pool,
    WorkItem,
)
from corral.shared.store.slots import take_slots
from corral.worker import maintenance
from tests.seeding import SETTINGS


def _capacity(db: Database, slots: int, orgs: dict[str, int | None]) -> tuple[str, dict[str, str]]:
    """A capacity of ``slots`` and one pool on it for each of ``orgs`` (org -> its weight,
    None: the default), each pool allowed far more than the capacity on its own."""
    tag = uuid.uuid4().hex[:8]
    capacity_id = f"cap-{tag}"
    pools = {}
    with db.session() as session:
        if session.get(ModelProfile, "default") is None:
            session.add(ModelProfile(name="default", model="m", auth_mode="byok"))
        session.add(Capacity(id=capacity_id, name=f"shared-{tag}", slots=slots))
        session.flush()
        for org, weight in orgs.items():
            pools[org] = f"pool-{org}-{tag}"
            session.add(
                Pool(
                    id=pools[org],
                    org_id=org,
                    name="shared",
                    provider_id="local",
                    max_concurrent=100,
                    capacity_id=capacity_id,
                    share_limit=0,
                )
            )
            if weight is not None:
                shares.set_weight(session, org, weight)
    return capacity_id, pools


def _message(org: str, project: str = "p") -> DispatchRequest:
    return DispatchRequest.model_validate(
        {
            "org": org,
            "project": project,
            "profile": "default",
            "work": {"kind": "shell", "command": "true"},
        }
    )


def _send(db: Database, org: str, count: int, *, projects: int = 1) -> list[str]:
    requests = [_message(org, f"p{n % projects}") for n in range(count)]
    return [t.item_id for t in accept_batch(db, requests, actor="test", settings=SETTINGS)]


def _redrive(db: Database) -> list[str]:
    rt = runtime.Runtime(settings=SETTINGS, db=db)
    return [o.item_id for o in maintenance.redrive(rt, actor="test").routed]


def _running(db: Database, org: str | None = None) -> list[str]:
    with db.session() as session:
        query = select(WorkItem.id).where(WorkItem.state == ItemState.ROUTED.value)
        if org is not None:
            query = query.where(WorkItem.org_id == org)
        return list(session.scalars(query.order_by(WorkItem.id)))


def _finish(db: Database, item_ids: list[str]) -> None:
    with db.session() as session:
        for item_id in item_ids:
            item = session.get(WorkItem, item_id)
            assert item is not None
            transition(session, item, ItemState.SUCCEEDED, actor="test")


def _held(db: Database, capacity_id: str) -> int:
    with db.session() as session:
        query = select(func.sum(Pool.slots_in_use)).where(Pool.capacity_id == capacity_id)
        return int(session.scalar(query) or 0)


def _orgs() -> tuple[str, str]:
    tag = uuid.uuid4().hex[:6]
    return f"flood{tag}", f"lone{tag}"


def test_a_lone_item_takes_the_next_freed_slot_not_the_floods(own_db: Database) -> None:
    flood, lone = _orgs()
    capacity_id, _ = _capacity(own_db, 4, {flood: None, lone: None})
    _redrive(own_db)  # the shares as headroom: 2 and 2
    _send(own_db, flood, 40, projects=20)
    _redrive(own_db)  # nobody else wants any: the flood gets all four
    assert len(_running(own_db, flood)) == 4
    [item] = _send(own_db, lone, 1)
    assert _state(own_db, item) == ItemState.WAITING_CAPACITY.value  # all four are held
    _finish(own_db, _running(own_db, flood)[:1])
    assert _redrive(own_db) == [item]  # the freed slot is the newcomer's
    assert _held(own_db, capacity_id) == 4


def test_weights_divide_the_slots_three_to_one(own_db: Database) -> None:
    heavy, light = _orgs()
    capacity_id, _ = _capacity(own_db, 8, {heavy: 3, light: None})
    _redrive(own_db)
    _send(own_db, heavy, 60)
    _send(own_db, light, 60, projects=30)  # its projects make it no bigger
    ran: Counter[str] = Counter()
    for _ in range(5):  # five turns of the whole capacity
        _redrive(own_db)
        running = {org: _running(own_db, org) for org in (heavy, light)}
        assert _held(own_db, capacity_id) <= 8
        ran.update({org: len(ids) for org, ids in running.items()})
        _finish(own_db, running[heavy] + running[light])
    _redrive(own_db)
    assert ran[heavy] + ran[light] >= 5 * 7
    assert abs(ran[heavy] / (ran[heavy] + ran[light]) - 0.75) <= 0.1, ran


def test_an_org_over_many_projects_gets_one_orgs_share(own_db: Database) -> None:
    sybil, honest = _orgs()
    _capacity(own_db, 6, {sybil: None, honest: None})
    _redrive(own_db)
    _send(own_db, sybil, 50, projects=50)
    _send(own_db, honest, 50)
    for _ in range(3):
        _redrive(own_db)
        _finish(own_db, _running(own_db))
    _redrive(own_db)
    assert len(_running(own_db, sybil)) == len(_running(own_db, honest)) == 3


def test_no_routing_path_takes_a_slot_past_the_share(own_db: Database) -> None:
    """The one-item path and the batch path both refuse a slot the pool's share does not
    give, whatever its own max_concurrent says: the capacity is never exceeded."""
    flood, lone = _orgs()
    capacity_id, pools = _capacity(own_db, 3, {flood: None, lone: None})
    _redrive(own_db)
    _send(own_db, flood, 10)
    _redrive(own_db)
    assert _held(own_db, capacity_id) == 3
    batch = _send(own_db, lone, 2)  # the batch path
    assert {_state(own_db, item) for item in batch} == {ItemState.WAITING_CAPACITY.value}
    outcome = intake.route_item(own_db, batch[0], actor="test", settings=SETTINGS)
    assert outcome.state == ItemState.WAITING_CAPACITY  # the one-item path
    assert _held(own_db, capacity_id) == 3
    # A router that read the pool before its share fell (a kept configuration) asks with
    # the pool's own limit: the guarded update checks the share as it is now.
    with own_db.session() as session:
        assert not take_slots(session, pools[lone], 1, limit=100)
    assert _held(own_db, capacity_id) == 3


def test_an_ended_item_gives_its_share_back_and_a_pool_off_capacity_has_none(
    own_db: Database,
) -> None:
    flood, _ = _orgs()
    _, pools = _capacity(own_db, 2, {flood: None})
    with own_db.session() as session:
        session.add(
            Pool(
                id=f"own-{flood}",
                org_id=flood,
                name="own",
                provider_id="local",
                priority=-1,
                max_concurrent=5,
            )
        )
    _redrive(own_db)
    _send(own_db, flood, 3)
    assert _counters(own_db, pools[flood]) == (2, 2)
    assert _counters(own_db, f"own-{flood}") == (1, None)
    _finish(own_db, _running(own_db, flood))
    assert _counters(own_db, pools[flood]) == (0, 0)
    assert _counters(own_db, f"own-{flood}") == (0, None)


def _counters(db: Database, pool_id: str) -> tuple[int, int | None]:
    """A pool's slots in use and its share."""
    with db.session() as session:
        pool = session.get(Pool, pool_id)
        assert pool is not None
        return pool.slots_in_use, pool.share_limit


def _state(db: Database, item_id: str) -> Any:
    with db.session() as session:
        return session.scalar(select(WorkItem.state).where(WorkItem.id == item_id))


def test_re_drives_racing_never_exceed_the_capacity_nor_route_an_item_twice(
    own_db: Database,
) -> None:
    """Four re-drives at once, while items end under them: the capacity's row lock makes
    the divisions take turns, and the guarded updates keep every pool within its share."""
    orgs = _orgs()
    capacity_id, _ = _capacity(own_db, 5, {orgs[0]: 2, orgs[1]: None})
    items = _send(own_db, orgs[0], 30, projects=7) + _send(own_db, orgs[1], 30)
    errors: list[BaseException] = []
    over: list[int] = []

    def race() -> None:
        try:
            for _ in range(15):
                _redrive(own_db)
                held = _held(own_db, capacity_id)
                if held > 5:
                    over.append(held)
                running = _running(own_db)
                if running:
                    _finish_quietly(own_db, running[:2])
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=race) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=300)
    assert not errors, errors
    assert not over, over
    with own_db.session() as session:
        routed = Counter(
            session.scalars(
                select(LifecycleEvent.work_item_id).where(
                    LifecycleEvent.to_state == ItemState.ROUTED.value,
                    LifecycleEvent.work_item_id.in_(items),
                )
            )
        )
    assert routed and max(routed.values()) == 1, routed


def _finish_quietly(db: Database, item_ids: list[str]) -> None:
    """End those of ``item_ids`` still routed (another thread may have ended them)."""
    with db.session() as session:
        for item_id in item_ids:
            item = session.get(WorkItem, item_id, with_for_update=True)
            if item is not None and item.state == ItemState.ROUTED.value:
                transition(session, item, ItemState.SUCCEEDED, actor="test")


def test_a_division_never_waits_for_a_pool_a_router_holds(fresh_pg_url: str) -> None:
    """A pool row locked by a router (or an ending item) that may be waiting for another
    pool is not waited for: the capacity is divided at the next re-drive instead.
    (PostgreSQL: SQLite has one writer at a time and no row locks.)"""
    db = Database(make_engine(fresh_pg_url))
    try:
        flood, lone = _orgs()
        _, pools = _capacity(db, 4, {flood: None, lone: None})
        with db.engine.connect() as router:
            router.execute(select(Pool.id).where(Pool.id == pools[lone]).with_for_update())
            with db.session() as session:
                assert shares.allocate(session) == {}  # at once, nothing divided
        with db.session() as session:
            assert shares.allocate(session) != {}
        assert {_counters(db, pool_id)[1] for pool_id in pools.values()} == {2}
    finally:
        db.dispose()


def test_a_disabled_pools_running_items_keep_their_slots_of_the_capacity(
    own_db: Database,
) -> None:
    gone, busy = _orgs()
    capacity_id, pools = _capacity(own_db, 4, {gone: None, busy: None})
    _redrive(own_db)
    _send(own_db, gone, 2)
    with own_db.session() as session:
        pool = session.get(Pool, pools[gone])
        assert pool is not None
        pool.active = False  # its two items run on
    _send(own_db, busy, 10)
    _redrive(own_db)
    assert len(_running(own_db, busy)) == 2
    assert _held(own_db, capacity_id) == 4
