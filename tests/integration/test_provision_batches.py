"""The provision path on real PostgreSQL: batched claims and handle writes keep every
guarantee of one-by-one provisioning (one sandbox per attempt, the fence, cancellation),
and a process keeps many provisions in flight on a small, bounded pool, holding no database
connection while a provider works."""

from __future__ import annotations

import shutil
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import event, func, select, update

from corral.providers.base import SandboxHandle, SandboxSpec
from corral.providers.testing import InMemoryProvider
from corral.scheduler.batch import accept_batch
from corral.shared.messages import DispatchRequest
from corral.shared.runtime import Runtime
from corral.shared.settings import CoreSettings
from corral.shared.store import org_policies
from corral.shared.store.db import Database, make_engine, utcnow
from corral.shared.store.lifecycle import transition
from corral.shared.store.models import (
    ItemState,
    LifecycleEvent,
    Pool,
    RegistrationToken,
    Sandbox,
    WorkItem,
)
from corral.shared.store.tokens import hash_token
from corral.worker.claims import (
    ClaimRequest,
    Delivery,
    HandleWrite,
    batches,
    claim_routed,
    record_handles,
    sandbox_id_for,
)
from corral.worker.provision import Outcome, provision_item
from tests.seeding import in_memory_pool


class CountingProvider(InMemoryProvider):
    """The in-memory provider, slowed down, noting how many provisions run at once and
    whether the calling thread held a database connection meanwhile."""

    def __init__(self, delay_s: float = 0.0) -> None:
        super().__init__()
        self.delay_s = delay_s
        self.lock = threading.Lock()
        self.running = self.most = 0
        self.held_by_caller: list[int] = []
        self.connections: Callable[[], int] = lambda: 0

    def provision(self, spec: SandboxSpec) -> SandboxHandle:
        with self.lock:
            self.running += 1
            self.most = max(self.most, self.running)
            self.held_by_caller.append(self.connections())
        try:
            time.sleep(self.delay_s)
            return super().provision(spec)
        finally:
            with self.lock:
                self.running -= 1


@dataclass
class World:
    url: str
    db: Database
    rt: Runtime
    provider: CountingProvider

    def runtime(self, **settings: Any) -> Runtime:
        """Another process's runtime on the same database (its own pool and batches)."""
        resolved = CoreSettings(state_dir=self.rt.settings.state_dir, **settings)
        rt = Runtime(settings=resolved, db=Database(make_engine(self.url, settings=resolved)))
        rt.use_provider(self.provider)
        return rt

    def routed(self, count: int = 1) -> list[str]:
        requests = [
            DispatchRequest.model_validate(
                {
                    "org": "acme",
                    "project": "web",
                    "profile": "default",
                    "work": {"kind": "shell", "command": f"echo {number}"},
                }
            )
            for number in range(count)
        ]
        taken = accept_batch(self.db, requests, actor="test", settings=self.rt.settings)
        assert all(t.outcome.queue == "provision.in-memory" for t in taken)
        return [t.item_id for t in taken]

    def sandboxes(self, item_id: str) -> list[Sandbox]:
        with self.db.session() as session:
            return list(session.scalars(select(Sandbox).where(Sandbox.work_item_id == item_id)))

    def count(self, model: Any, *where: Any) -> int:
        with self.db.session() as session:
            return session.scalar(select(func.count()).select_from(model).where(*where)) or 0

    def wait_for_provision_call(self) -> None:
        deadline = time.monotonic() + 10
        while "provision" not in self.provider.methods():
            assert time.monotonic() < deadline, "the provider was never called"
            time.sleep(0.01)


@pytest.fixture(params=["postgresql"])
def world(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[World]:
    """PostgreSQL (whose claim is one statement); a test may ask for SQLite too (the claim
    in steps) with ``@pytest.mark.parametrize("world", BOTH, indirect=True)``."""
    if request.param == "sqlite":
        path = tmp_path / "corral.db"
        shutil.copyfile(request.getfixturevalue("sqlite_template"), path)
        url = f"sqlite:///{path}"
    else:
        url = request.getfixturevalue("fresh_pg_url")
    settings = CoreSettings(state_dir=tmp_path, db_pool_size=2)
    db = Database(make_engine(url, settings=settings))
    in_memory_pool(db, max_concurrent=1000)
    rt = Runtime(settings=settings, db=db)
    provider = CountingProvider()
    rt.use_provider(provider)
    yield World(url, db, rt, provider)
    db.dispose()


BOTH = ["postgresql", "sqlite"]


def _at_once(*calls: Callable[[], Outcome]) -> list[Outcome]:
    barrier = threading.Barrier(len(calls))

    def run(call: Callable[[], Outcome]) -> Outcome:
        barrier.wait(5)
        return call()

    with ThreadPoolExecutor(len(calls)) as pool:
        return [future.result(30) for future in [pool.submit(run, call) for call in calls]]


def test_two_workers_given_the_same_item_at_once_make_one_sandbox(world: World) -> None:
    [item_id] = world.routed()
    world.provider.delay_s = 0.3
    other = world.runtime()
    try:
        outcomes = _at_once(
            lambda: provision_item(world.rt, item_id, actor="worker:a"),
            lambda: provision_item(other, item_id, actor="worker:b"),
        )
    finally:
        other.db.dispose()
    made, other_outcome = sorted(outcomes, key=lambda o: o is not Outcome.PROVISIONED)
    assert made is Outcome.PROVISIONED
    assert other_outcome in (Outcome.IN_FLIGHT, Outcome.ALREADY_PROVISIONED)
    assert world.provider.methods().count("provision") == 1
    [sandbox] = world.sandboxes(item_id)
    assert (sandbox.status, sandbox.external_id, sandbox.lease_until) == ("ready", sandbox.id, None)
    assert world.count(RegistrationToken, RegistrationToken.sandbox_id == sandbox.id) == 1


@pytest.mark.parametrize("world", BOTH, indirect=True)
def test_a_batch_given_one_item_twice_claims_it_once(world: World) -> None:
    [item_id] = world.routed()
    request = ClaimRequest(item_id, "worker:a")
    first, second = claim_routed(world.db, [request, request], lease_s=60, token_ttl_s=60)
    assert first is not None and second is None
    assert first.token.startswith("crt_") and first.lease_until > utcnow()
    assert first.token not in repr(first)  # a logged claim shows no token
    # The claim's writes: the item moved on, one sandbox row, the hash of its token, and
    # both audit rows.
    with world.db.session() as session:
        assert session.get_one(WorkItem, item_id).state == "provisioning"
        stored = session.scalars(select(RegistrationToken)).one()
        assert stored.sandbox_id == first.sandbox_id and first.token not in stored.token_hash
        events = session.execute(
            select(LifecycleEvent.entity, LifecycleEvent.from_state, LifecycleEvent.to_state)
            .where(LifecycleEvent.work_item_id == item_id)
            .order_by(LifecycleEvent.id)
        ).all()
    assert events[-2:] == [
        ("sandbox", None, "provisioning"),
        ("work_item", "routed", "provisioning"),
    ]
    # A later delivery is not the common case: the one-by-one path finds the live lease.
    assert provision_item(world.rt, item_id, actor="worker:b") is Outcome.IN_FLIGHT
    assert world.provider.methods() == []


@pytest.mark.parametrize("world", BOTH, indirect=True)
def test_a_claim_writes_each_items_row_token_hash_and_events(world: World) -> None:
    items = world.routed(3)
    requests = [ClaimRequest(item_id, f"worker:{n}") for n, item_id in enumerate(items)]
    before = utcnow()
    claimed = claim_routed(world.db, requests, lease_s=60, token_ttl_s=90)
    with world.db.session() as session:
        for request, fresh in zip(requests, claimed, strict=True):
            assert fresh is not None and fresh.item.id == request.item_id
            assert (fresh.item.attempts, fresh.pool.id) == (1, "pool-mem")
            assert fresh.item.payload["work"]["command"].startswith("echo ")
            sandbox = session.get_one(Sandbox, fresh.sandbox_id)
            assert sandbox.id == sandbox_id_for(request.item_id, 1)
            assert (sandbox.work_item_id, sandbox.attempt, sandbox.status) == (
                request.item_id,
                1,
                "provisioning",
            )
            assert (sandbox.org_id, sandbox.pool_id, sandbox.provider_id) == (
                "acme",
                "pool-mem",
                "in-memory",
            )
            assert sandbox.lease_until == fresh.lease_until
            assert sandbox.handle_metadata == {}
            assert before <= sandbox.created_at <= fresh.lease_until - timedelta(seconds=59)
            token = session.scalars(
                select(RegistrationToken).where(RegistrationToken.sandbox_id == sandbox.id)
            ).one()
            assert token.token_hash == hash_token(fresh.token)
            assert token.work_item_id == request.item_id and token.redeemed_at is None
            assert token.expires_at == sandbox.created_at + timedelta(seconds=90)
            events = session.execute(
                select(
                    LifecycleEvent.entity,
                    LifecycleEvent.entity_id,
                    LifecycleEvent.from_state,
                    LifecycleEvent.to_state,
                    LifecycleEvent.actor,
                    LifecycleEvent.created_at,
                )
                .where(LifecycleEvent.work_item_id == request.item_id)
                .order_by(LifecycleEvent.id)
            ).all()
            assert events[-2:] == [
                ("sandbox", sandbox.id, None, "provisioning", request.actor, sandbox.created_at),
                (
                    "work_item",
                    request.item_id,
                    "routed",
                    "provisioning",
                    request.actor,
                    sandbox.created_at,
                ),
            ]
            assert session.get_one(WorkItem, request.item_id).state == "provisioning"
    assert world.count(RegistrationToken) == 3


@pytest.mark.parametrize("world", BOTH, indirect=True)
def test_an_attempt_that_has_its_row_already_is_moved_on_and_left_to_the_one_by_one_path(
    world: World,
) -> None:
    # The item's state rules this out in a consistent database; the claim still never
    # makes a second row or a token for it.
    [item_id] = world.routed()
    with world.db.session() as session:
        session.add(
            Sandbox(
                id=sandbox_id_for(item_id, 1),
                work_item_id=item_id,
                attempt=1,
                org_id="acme",
                pool_id="pool-mem",
                provider_id="in-memory",
                status="provisioning",
            )
        )
    assert claim_routed(world.db, [ClaimRequest(item_id, "w")], lease_s=60, token_ttl_s=60) == [
        None
    ]
    assert len(world.sandboxes(item_id)) == 1
    assert world.count(RegistrationToken) == 0
    with world.db.session() as session:
        assert session.get_one(WorkItem, item_id).state == "provisioning"
        last = session.scalars(
            select(LifecycleEvent)
            .where(LifecycleEvent.work_item_id == item_id)
            .order_by(LifecycleEvent.id.desc())
            .limit(2)
        ).all()
    # The item's move, right after its routing: no sandbox event.
    assert [(e.entity, e.from_state, e.to_state) for e in last] == [
        ("work_item", "routed", "provisioning"),
        ("work_item", "received", "routed"),
    ]


@pytest.mark.parametrize("world", BOTH, indirect=True)
def test_items_that_are_not_routed_are_left_to_the_one_by_one_path(world: World) -> None:
    routed, cancelled = world.routed(2)
    with world.db.session() as session:
        transition(session, session.get_one(WorkItem, cancelled), ItemState.CANCELLED, actor="test")
    requests = [ClaimRequest(i, "w") for i in (routed, cancelled, "wi-missing")]
    claimed = claim_routed(world.db, requests, lease_s=60, token_ttl_s=60)
    assert [c is not None for c in claimed] == [True, False, False]
    assert provision_item(world.rt, cancelled, actor="w") is Outcome.SKIPPED
    assert provision_item(world.rt, "wi-missing", actor="w") is Outcome.SKIPPED
    assert world.sandboxes(cancelled) == []


@contextmanager
def _row_locked(world: World, model: Any, row_id: str) -> Iterator[None]:
    """``row_id``'s row locked by another transaction (an api request, a reaper sweep)."""
    with world.db.session() as session:
        session.get_one(model, row_id, with_for_update=True)
        yield


def _without_waiting(call: Callable[[], Any]) -> Any:
    """``call()``'s result, which must come within 5 s (a batch waiting on the lock would
    not: it fails then, and finishes once the lock is released)."""
    pool = ThreadPoolExecutor(1)
    try:
        return pool.submit(call).result(timeout=5)
    finally:
        pool.shutdown(wait=False)


def test_a_claim_batch_skips_an_item_another_transaction_holds(world: World) -> None:
    held, free = world.routed(2)
    requests = [ClaimRequest(i, "w") for i in (held, free)]
    with _row_locked(world, WorkItem, held):
        claimed = _without_waiting(
            lambda: claim_routed(world.db, requests, lease_s=60, token_ttl_s=60)
        )
    assert [c is not None for c in claimed] == [False, True]
    # The one-by-one path takes the held item once the lock is gone.
    assert provision_item(world.rt, held, actor="w") is Outcome.PROVISIONED


def test_a_handle_batch_skips_a_sandbox_another_transaction_holds(world: World) -> None:
    [item_id] = world.routed()
    [fresh] = claim_routed(world.db, [ClaimRequest(item_id, "w")], lease_s=60, token_ttl_s=60)
    assert fresh is not None
    handle = SandboxHandle(
        provider_id="in-memory",
        external_id=fresh.sandbox_id,
        metadata={"org_id": "acme", "sandbox_id": fresh.sandbox_id},
    )
    write = HandleWrite(item_id, fresh.sandbox_id, fresh.lease_until, handle, None, "w")
    with _row_locked(world, Sandbox, fresh.sandbox_id):
        # Left to the one-by-one path, which waits for that lock.
        assert _without_waiting(lambda: record_handles(world.db, [write])) == [None]
    assert record_handles(world.db, [write]) == [True]
    [sandbox] = world.sandboxes(item_id)
    assert (sandbox.status, sandbox.external_id) == ("ready", fresh.sandbox_id)


def _provision_in_background(world: World, item_id: str) -> tuple[threading.Thread, list[Outcome]]:
    world.provider.hang()
    outcome: list[Outcome] = []
    thread = threading.Thread(
        target=lambda: outcome.append(provision_item(world.rt, item_id, actor="worker:a"))
    )
    thread.start()
    world.wait_for_provision_call()
    return thread, outcome


def test_a_handle_is_not_recorded_once_another_worker_holds_the_lease(world: World) -> None:
    [item_id] = world.routed()
    thread, outcome = _provision_in_background(world, item_id)
    with world.db.session() as session:  # the lease ran out and another worker took over
        session.execute(update(Sandbox).values(lease_until=utcnow() + timedelta(minutes=5)))
    world.provider.release()
    thread.join(10)
    assert outcome == [Outcome.SKIPPED]
    [sandbox] = world.sandboxes(item_id)
    assert (sandbox.status, sandbox.external_id) == ("provisioning", None)
    assert world.provider.boxes == {}  # what this attempt made was terminated at once
    assert world.count(WorkItem, WorkItem.state == "provisioning") == 1


def test_an_item_cancelled_while_its_sandbox_is_made_ends_that_sandbox(world: World) -> None:
    [item_id] = world.routed()
    thread, outcome = _provision_in_background(world, item_id)
    with world.db.session() as session:
        transition(session, session.get_one(WorkItem, item_id), ItemState.CANCELLED, actor="api")
    world.provider.release()
    thread.join(10)
    assert outcome == [Outcome.SKIPPED]
    assert world.provider.boxes == {}
    [sandbox] = world.sandboxes(item_id)
    assert (sandbox.status, sandbox.termination_reason) == ("terminated", "cancelled")


def _track_connections(db: Database) -> tuple[Callable[[], int], Callable[[], int]]:
    """(connections the calling thread holds now, most held at once by the process)."""
    lock = threading.Lock()
    held: Counter[int] = Counter()
    most = [0]

    def checkout(*_: Any) -> None:
        with lock:
            held[threading.get_ident()] += 1
            most[0] = max(most[0], sum(held.values()))

    def checkin(*_: Any) -> None:
        with lock:
            held[threading.get_ident()] -= 1

    event.listen(db.engine, "checkout", checkout)
    event.listen(db.engine, "checkin", checkin)
    return (lambda: held[threading.get_ident()]), (lambda: most[0])


def test_many_provisions_in_flight_share_a_pool_of_two_and_hold_none_during_the_call(
    world: World,
) -> None:
    items = world.routed(60)
    world.provider.delay_s = 0.3
    mine, most = _track_connections(world.db)
    world.provider.connections = mine

    with ThreadPoolExecutor(len(items)) as pool:
        outcomes = list(pool.map(lambda i: provision_item(world.rt, i, actor="w"), items))

    assert outcomes == [Outcome.PROVISIONED] * len(items)
    assert world.count(WorkItem, WorkItem.state == "awaiting_claim") == len(items)
    assert world.provider.most >= 30  # many in flight at once ...
    assert most() <= 2  # ... on a pool of two
    assert world.db.engine.pool.size() == 2  # type: ignore[attr-defined]
    assert set(world.provider.held_by_caller) == {0}  # no connection during the call
    claims = batches(world.rt).claims.batches
    assert claims < len(items) / 3, f"{claims} claim batches for {len(items)} items"


def test_a_claim_reads_the_rows_it_claims_not_every_routed_item(world: World) -> None:
    # A fresh table has no statistics, and psycopg prepares a statement after a few runs
    # (PostgreSQL then plans it once for any ids): the claim must still look its ids up
    # instead of walking every routed item. Counted in the claim's own transaction.
    items = world.routed(300)
    work_items_read: list[int] = []
    read_before: list[int] = []

    def read_so_far(cursor: Any) -> int:
        # Not yet flushed to the cumulative views: this connection's count since its last flush.
        row = cursor.connection.execute(
            "SELECT coalesce(idx_tup_fetch, 0) + coalesce(seq_tup_read, 0) "
            "FROM pg_stat_xact_user_tables WHERE relname = 'work_items'"
        ).fetchone()
        return int(row[0]) if row else 0

    @event.listens_for(world.db.engine, "before_cursor_execute")
    def before(conn: Any, cursor: Any, statement: str, *_: Any) -> None:
        if statement.lstrip().startswith("WITH locked AS"):
            read_before.append(read_so_far(cursor))

    @event.listens_for(world.db.engine, "after_cursor_execute")
    def after(conn: Any, cursor: Any, statement: str, *_: Any) -> None:
        if statement.lstrip().startswith("WITH locked AS"):
            work_items_read.append(read_so_far(cursor) - read_before[-1])

    settings = world.rt.settings
    for item_id in items[:12]:
        [fresh] = claim_routed(
            world.db,
            [ClaimRequest(item_id, "test")],
            lease_s=settings.provision_lease_s,
            token_ttl_s=settings.token_ttl_s,
        )
        assert fresh is not None
    event.remove(world.db.engine, "before_cursor_execute", before)
    event.remove(world.db.engine, "after_cursor_execute", after)
    assert len(work_items_read) == 12
    assert max(work_items_read) <= 4, work_items_read


def test_the_pools_sandbox_config_and_the_items_image_reach_the_provider(world: World) -> None:
    with world.db.session() as session:
        pool = session.get_one(Pool, "pool-mem")
        pool.sandbox_config = {"log_lines": ["from the pool"]}
        pool.capabilities = {"supports_item_image": True}  # as docker and kubernetes declare
        # The deployment lets the org's items name the image.
        org_policies.set_policy(session, "acme", item_images=["registry.local/*"], regions=None)
    [plain] = world.routed()
    [with_image] = accept_batch(
        world.db,
        [
            DispatchRequest.model_validate(
                {
                    "org": "acme",
                    "project": "web",
                    "profile": "default",
                    "image": "registry.local/work:1",
                    "work": {"kind": "shell", "command": "true"},
                }
            )
        ],
        actor="test",
        settings=world.rt.settings,
    )
    assert with_image.outcome.queue == "provision.in-memory"

    for item_id in (plain, with_image.item_id):
        assert provision_item(world.rt, item_id, actor="test") == Outcome.PROVISIONED
    specs = {box.spec.work_item_id: box.spec for box in world.provider.boxes.values()}
    assert specs[plain].provider_options == {"log_lines": ["from the pool"]}
    assert specs[plain].image is None
    assert specs[with_image.item_id].image == "registry.local/work:1"
    assert specs[with_image.item_id].provider_options == {"log_lines": ["from the pool"]}


@pytest.mark.parametrize("world", BOTH, indirect=True)
def test_a_claim_notes_which_try_of_which_task_holds_the_lease(world: World) -> None:
    first, second = world.routed(2)
    delivery = Delivery("task-a", 2)
    claimed = claim_routed(
        world.db,
        [ClaimRequest(first, "w", delivery.holder), ClaimRequest(second, "w")],
        lease_s=60,
        token_ttl_s=60,
    )
    assert all(claimed)
    [held] = world.sandboxes(first)
    [unnamed] = world.sandboxes(second)
    assert (held.lease_holder, unnamed.lease_holder) == (delivery.holder, None)
    assert Delivery("task-a", 3).follows(held.lease_holder)  # its retry
    assert not Delivery("task-a", 2).follows(held.lease_holder)  # the same try again
    assert not Delivery("task-a", 1).follows(held.lease_holder)  # an earlier try
    assert not Delivery("task-b", 3).follows(held.lease_holder)  # another task
    assert not Delivery("task-a", 3).follows(unnamed.lease_holder)
