"""The intake keeps the routing configuration it read between batches (PostgreSQL): a batch
of an org seen before is one statement, and a batch is never written on a pool, profile or
org limit that changed since it was kept, nor routed past a pool whose kept counter is stale."""

from __future__ import annotations

import importlib.util
import time
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import delete, select, update

from corral.scheduler import routing_cache
from corral.scheduler.batch import accept_batch
from corral.shared.store import org_policies
from corral.shared.store.db import Database, make_engine, utcnow
from corral.shared.store.models import ItemState, ModelProfile, Pool, RoutingConfigVersion, WorkItem
from corral.shared.store.org_limits import set_limit
from corral.shared.store.pools import ROUTING_COLUMNS
from tests.batches import in_use, requests_for, statements, states
from tests.seeding import SETTINGS, org_with_pool

ROUTED = ItemState.ROUTED.value


def _second_pool(db: Database, org: str, *, priority: int = -1, max_concurrent: int = 10) -> str:
    """Another local pool of ``org``, ``second``, below the first by default."""
    pool_id = f"pool2-{org}"
    with db.session() as session:
        session.add(
            Pool(
                id=pool_id,
                org_id=org,
                name="second",
                provider_id="local",
                priority=priority,
                max_concurrent=max_concurrent,
            )
        )
    return pool_id


def _pools_of(db: Database, org: str) -> list[str | None]:
    """The pool of each of ``org``'s items, oldest first."""
    with db.session() as session:
        query = select(WorkItem.pool_id).where(WorkItem.org_id == org)
        return list(session.scalars(query.order_by(WorkItem.created_at, WorkItem.id)))


def _version(db: Database) -> int:
    with db.session() as session:
        return int(session.scalars(select(RoutingConfigVersion.version)).one())


def _change(db: Database, pool_id: str, **values: Any) -> None:
    with db.session() as session:
        session.execute(update(Pool).where(Pool.id == pool_id).values(**values))


def test_a_batch_of_an_org_routed_before_is_one_statement(pg_db: Database) -> None:
    org = org_with_pool(pg_db, "k")
    accept_batch(pg_db, requests_for(org, 1), actor="test", settings=SETTINGS)  # read, and kept
    seen, taken = statements(pg_db, requests_for(org, 2))
    assert len(seen) == 1, [statement for statement, _ in seen]
    statement, autocommit = seen[0]
    assert "corral_slots_taken" in statement and "routing_config_version" in statement
    assert autocommit
    assert [one.outcome.state.value for one in taken] == [ROUTED, ROUTED]
    assert in_use(pg_db, f"pool-{org}") == 3


@pytest.mark.parametrize(
    "change",
    [
        {"active": False},
        {"priority": -5},
        {"breaker_state": "open", "breaker_opened_at": "now"},
        {"max_concurrent": 1},
    ],
    ids=["deactivated", "priority", "breaker-open", "limit"],
)
def test_a_pool_changed_after_it_was_kept_is_routed_by_its_change(
    pg_db: Database, change: dict[str, Any]
) -> None:
    org = org_with_pool(pg_db, "k")
    first, second = f"pool-{org}", _second_pool(pg_db, org)
    accept_batch(pg_db, requests_for(org, 1), actor="test", settings=SETTINGS)
    if change.get("breaker_opened_at") == "now":
        change = {**change, "breaker_opened_at": utcnow()}
    _change(pg_db, first, **change)
    taken = accept_batch(pg_db, requests_for(org, 1), actor="test", settings=SETTINGS)
    assert taken[0].outcome.state is ItemState.ROUTED
    assert _pools_of(pg_db, org) == [first, second]
    assert (in_use(pg_db, first), in_use(pg_db, second)) == (1, 1)


def test_a_pool_freed_since_its_counter_was_kept_is_not_passed_by(pg_db: Database) -> None:
    org = org_with_pool(pg_db, "k", max_concurrent=1)
    first, second = f"pool-{org}", _second_pool(pg_db, org)
    accept_batch(
        pg_db, requests_for(org, 1), actor="test", settings=SETTINGS
    )  # kept: the first pool full
    _change(pg_db, first, slots_in_use=0)  # its item ended elsewhere: no new version
    accept_batch(pg_db, requests_for(org, 1), actor="test", settings=SETTINGS)
    assert _pools_of(pg_db, org) == [first, first]
    assert (in_use(pg_db, first), in_use(pg_db, second)) == (1, 0)


def test_slots_another_router_took_since_they_were_kept_are_not_taken_again(
    pg_db: Database,
) -> None:
    org = org_with_pool(pg_db, "k", max_concurrent=4)
    pool_id = f"pool-{org}"
    accept_batch(pg_db, requests_for(org, 1), actor="test", settings=SETTINGS)  # kept: 1 of 4
    _change(pg_db, pool_id, slots_in_use=4)  # another scheduler filled it
    # By the kept counter 1 + 2 < 4: written on it, refused by the slot guard, read again.
    seen, taken = statements(pg_db, requests_for(org, 2))
    assert "corral_slots_taken" in seen[0][0]
    assert [one.outcome.state for one in taken] == [ItemState.WAITING_CAPACITY] * 2
    assert in_use(pg_db, pool_id) == 4


def test_a_pool_added_after_the_orgs_pools_were_kept_takes_the_work(pg_db: Database) -> None:
    org = org_with_pool(pg_db, "k")
    accept_batch(pg_db, requests_for(org, 1), actor="test", settings=SETTINGS)
    added = _second_pool(pg_db, org, priority=5)
    accept_batch(pg_db, requests_for(org, 1), actor="test", settings=SETTINGS)
    assert _pools_of(pg_db, org) == [f"pool-{org}", added]


@pytest.fixture
def own_db(fresh_pg_url: str) -> Iterator[Database]:
    """A database of the test's own: for a test that changes the version row itself."""
    db = Database(make_engine(fresh_pg_url))
    yield db
    db.dispose()


def test_without_the_version_row_every_batch_is_read_and_routed(own_db: Database) -> None:
    org = org_with_pool(own_db, "k")
    with own_db.session() as session:
        session.execute(delete(RoutingConfigVersion))
    accept_batch(
        own_db, requests_for(org, 1), actor="test", settings=SETTINGS
    )  # budgets read once, kept apart
    for _ in range(2):
        seen, taken = statements(own_db, requests_for(org, 1))
        assert len(seen) == 2, [statement for statement, _ in seen]  # read, write: no keeping
        assert taken[0].outcome.state is ItemState.ROUTED
    assert in_use(own_db, f"pool-{org}") == 3


def test_a_database_restored_to_an_older_version_moves_past_the_clock(own_db: Database) -> None:
    org = org_with_pool(own_db, "k")
    with own_db.session() as session:
        session.execute(update(RoutingConfigVersion).values(version=5))  # as restored
    before = int(time.time() * 1_000_000)
    _change(own_db, f"pool-{org}", priority=2)
    assert _version(own_db) >= before


def test_an_org_limit_set_after_its_pools_were_kept_holds(pg_db: Database) -> None:
    org = org_with_pool(pg_db, "k")
    accept_batch(pg_db, requests_for(org, 1), actor="test", settings=SETTINGS)
    with pg_db.session() as session:
        set_limit(session, org, 1)
    taken = accept_batch(pg_db, requests_for(org, 1), actor="test", settings=SETTINGS)
    assert taken[0].outcome.state is ItemState.WAITING_CAPACITY
    assert states(pg_db, org) == [ROUTED, ItemState.WAITING_CAPACITY.value]


def test_a_profile_removed_after_it_was_kept_is_unknown(pg_db: Database) -> None:
    org = org_with_pool(pg_db, "k")
    accept_batch(pg_db, requests_for(org, 1), actor="test", settings=SETTINGS)
    with pg_db.session() as session:
        session.execute(delete(ModelProfile).where(ModelProfile.name == "default"))
    taken = accept_batch(pg_db, requests_for(org, 1), actor="test", settings=SETTINGS)
    assert taken[0].outcome.state is ItemState.DISPATCH_ERROR
    assert in_use(pg_db, f"pool-{org}") == 1


def test_an_org_policy_set_after_its_pools_were_kept_holds(pg_db: Database) -> None:
    org = org_with_pool(pg_db, "k")
    region = [
        request.model_copy(update={"region": "us-east-1"}) for request in requests_for(org, 1)
    ]
    accept_batch(pg_db, region, actor="test", settings=SETTINGS)  # kept: no policy
    with pg_db.session() as session:
        org_policies.set_policy(session, org, item_images=None, regions=["eu-*"])
    taken = accept_batch(pg_db, region, actor="test", settings=SETTINGS)
    assert taken[0].outcome.state is ItemState.DISPATCH_ERROR
    assert "region" in (taken[0].outcome.detail or "")
    assert in_use(pg_db, f"pool-{org}") == 1


def _migration() -> Any:
    path = Path(routing_cache.__file__).parents[1] / "shared/store/migrations/versions"
    spec = importlib.util.spec_from_file_location("m0018", path / "0018_routing_config_version.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_triggers_watch_every_column_routing_reads_but_the_counters() -> None:
    # The slot counter and the share (corral.shared.store.shares) move all the time; the
    # guarded updates check both as they are, whatever a kept configuration says.
    watched = {column.removesuffix("::text") for column in _migration().POOL_ROUTING_COLUMNS}
    assert watched == set(ROUTING_COLUMNS) - {"slots_in_use", "share_limit"} | {"active"}


def test_every_change_routing_reads_bumps_the_version_and_a_counter_does_not(
    pg_db: Database,
) -> None:
    org = org_with_pool(pg_db, "k")
    pool_id = f"pool-{org}"
    before = _version(pg_db)
    _change(pg_db, pool_id, slots_in_use=4)
    assert _version(pg_db) == before
    changes: list[dict[str, Any]] = [
        {"name": "renamed"},
        {"priority": 3},
        {"active": False},
        {"max_concurrent": 4},
        {"capabilities": {"max_concurrent": 2}},
        {"runtime_provides": {"runtimeKinds": ["python-pip"]}},
        {"breaker_state": "half_open", "breaker_probe_at": utcnow()},
        {"breaker_opened_at": utcnow() - timedelta(seconds=5)},
        {"lease": {"max_attempts": 2}},
    ]
    for values in changes:
        now = _version(pg_db)
        _change(pg_db, pool_id, **values)
        assert _version(pg_db) > now, values
    now = _version(pg_db)
    with pg_db.session() as session:
        set_limit(session, org, 5)
    assert _version(pg_db) > now
    now = _version(pg_db)
    with pg_db.session() as session:
        session.add(ModelProfile(name="other", model="m", auth_mode="byok"))
    assert _version(pg_db) > now
    now = _version(pg_db)
    _second_pool(pg_db, org)
    assert _version(pg_db) > now


def test_a_read_older_than_what_is_kept_is_dropped() -> None:
    class Row:
        def __init__(self, org: str, pool_id: str) -> None:
            self.id, self.org_id, self.name, self.provider_id = pool_id, org, "p", "local"
            self.priority, self.max_concurrent, self.slots_in_use = 0, 10, 0
            self.runtime_provides = self.capabilities = self.share_limit = None

    cache = routing_cache.RoutingCache(max_orgs=2)
    cache.remember(5, {"default": "byok"}, ["a"], [Row("a", "pa")], {})
    cache.remember(4, {"default": "byok"}, ["b"], [Row("b", "pb")], {})  # older: dropped
    assert cache.kept({"default"}, {"b"}) is None
    kept = cache.kept({"default"}, {"a"})
    assert kept is not None and kept.version == 5 and [row.id for row in kept.pools] == ["pa"]
    cache.remember(6, {"default": "byok"}, ["b"], [Row("b", "pb")], {})  # newer: replaces all
    assert cache.kept({"default"}, {"a"}) is None
    cache.remember(6, {"default": "byok"}, ["c"], [Row("c", "pc")], {})
    cache.remember(6, {"default": "byok"}, ["d"], [Row("d", "pd")], {})  # past max_orgs: anew
    assert cache.kept({"default"}, {"b"}) is None and cache.kept({"default"}, {"d"})
