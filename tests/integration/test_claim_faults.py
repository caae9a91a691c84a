"""The provider worker's claim (one statement, run as driver SQL: corral.worker.claims) when
its database connection fails, on real PostgreSQL: nothing is provisioned without a claim
the database kept, and the task's retry provisions the item once.

Each failure is reached for certain. Its answer lost: the worker reaches PostgreSQL through
a loopback proxy that passes the claim on and loses its answer, so the claim is committed
and the worker sees its connection fail. Its backend terminated: the worker's pooled
connection, used a moment before (so not pinged), has its backend ended from outside, as a
database restart or an operator's ``pg_terminate_backend`` does. The worker's pool is large
enough that its claims keep a connection of their own: that one fails.

A lost answer leaves the attempt held by a claim its worker does not know it made: the task's
retry (a later try of the same task) takes it over at once; any other delivery waits for
that claim's lease (``CORRAL_PROVISION_LEASE_S``), as for a worker that died holding it,
after which the item is provisioned once (docs/operations.md, "Processes that fail").
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import pytest
from sqlalchemy import func, select, text, update
from sqlalchemy.exc import OperationalError

from corral.providers.testing import InMemoryProvider
from corral.scheduler.batch import accept_batch
from corral.shared.messages import DispatchRequest
from corral.shared.runtime import Runtime
from corral.shared.settings import CoreSettings
from corral.shared.store.db import HOLD_FROM_POOL_SIZE, Database, make_engine, utcnow
from corral.shared.store.models import RegistrationToken, Sandbox, WorkItem
from corral.worker.claims import Delivery
from corral.worker.maintenance import redrive
from corral.worker.provision import Outcome, provision_item
from tests.pg_proxy import PostgresProxy
from tests.seeding import SETTINGS, in_memory_pool

CLAIM_MARKER = b"FOR UPDATE SKIP LOCKED"  # the claim's lock on the items it takes


@dataclass
class World:
    db: Database  # the test's own view of the database
    url: str
    provider: InMemoryProvider
    tmp_path: Path

    def worker(self, url: str | None = None) -> Runtime:
        """A provider worker's runtime (its own engine), on ``url`` or the database."""
        # A pool large enough that the claims keep a connection of their own (HeldConnection).
        settings = CoreSettings(state_dir=self.tmp_path, db_pool_size=HOLD_FROM_POOL_SIZE)
        engine = make_engine(url or self.url, settings=settings)
        rt = Runtime(settings=settings, db=Database(engine))
        rt.use_provider(self.provider)
        return rt

    def routed(self) -> str:
        request = DispatchRequest.model_validate(
            {
                "org": "acme",
                "project": "web",
                "profile": "default",
                "work": {"kind": "shell", "command": "echo hi"},
            }
        )
        [taken] = accept_batch(self.db, [request], actor="test", settings=SETTINGS)
        assert taken.outcome.queue == "provision.in-memory"
        return taken.item_id

    def state(self, item_id: str) -> tuple[str, int, int]:
        """The item's state, its sandbox rows and the tokens that could still be redeemed."""
        with self.db.session() as session:
            item = session.get_one(WorkItem, item_id)
            sandboxes = session.scalar(
                select(func.count()).select_from(Sandbox).where(Sandbox.work_item_id == item_id)
            )
            tokens = session.scalar(
                select(func.count())
                .select_from(RegistrationToken)
                .where(
                    RegistrationToken.work_item_id == item_id,
                    RegistrationToken.redeemed_at.is_(None),
                    RegistrationToken.expires_at > utcnow(),
                )
            )
        return item.state, sandboxes or 0, tokens or 0


@pytest.fixture
def world(fresh_pg_url: str, tmp_path: Path) -> Iterator[World]:
    db = Database(make_engine(fresh_pg_url))
    in_memory_pool(db)
    yield World(db, fresh_pg_url, InMemoryProvider(), tmp_path)
    db.dispose()


@contextmanager
def claim_answer_lost(world: World, item_id: str, delivery: Delivery) -> Iterator[Runtime]:
    """A worker whose claim of ``item_id`` (by ``delivery``) committed and lost its answer:
    it raised, as its task does before Celery retries it."""
    proxy = PostgresProxy()
    worker = world.worker(proxy.url(world.url))
    try:
        proxy.lose_next_answer_to(CLAIM_MARKER)
        with pytest.raises(OperationalError):
            provision_item(worker, item_id, actor="worker-1", delivery=delivery)
        assert proxy.lost.is_set()
        # The claim was committed: the item is the worker's, with its row and a token.
        assert world.state(item_id) == ("provisioning", 1, 1)
        assert world.provider.methods() == []  # nothing made without a claim it saw
        yield worker
    finally:
        worker.db.dispose()
        proxy.close()


def test_a_claim_whose_answer_is_lost_is_taken_over_by_its_tasks_retry_at_once(
    world: World,
) -> None:
    item_id = world.routed()
    first = Delivery("task-1", 0)
    with claim_answer_lost(world, item_id, first) as worker:
        # Any other delivery leaves that lease alone: one of the same try (the broker
        # handing it out again) or of another task may run beside a live holder.
        for other in (first, Delivery("task-2", 3)):
            assert provision_item(worker, item_id, actor="w", delivery=other) == Outcome.IN_FLIGHT
        assert world.provider.methods() == []
        # The task's retry (autoretry_for OperationalError): the try before it has ended.
        retry = Delivery("task-1", 1)
        assert provision_item(worker, item_id, actor="w", delivery=retry) == Outcome.PROVISIONED
    assert world.provider.methods().count("provision") == 1
    assert len(world.provider.boxes) == 1
    # The lost claim's token is revoked: the one left is the retry's.
    assert world.state(item_id) == ("awaiting_claim", 1, 1)


def test_a_lost_claim_no_retry_can_tell_is_provisioned_once_when_its_lease_ends(
    world: World,
) -> None:
    item_id = world.routed()
    first = Delivery("task-1", 0)
    with claim_answer_lost(world, item_id, first) as worker:
        # The same try handed out again (the worker died, say): it waits out the lease.
        assert provision_item(worker, item_id, actor="w", delivery=first) == Outcome.IN_FLIGHT
        # The lease runs out (CORRAL_PROVISION_LEASE_S later): the re-drive sends the task
        # again, and that delivery takes the attempt over and provisions it.
        past = utcnow() - timedelta(seconds=worker.settings.provision_lease_s + 1)
        with world.db.session() as session:
            session.execute(update(Sandbox).values(lease_until=past))
            session.execute(update(WorkItem).values(updated_at=past))
        assert redrive(worker, actor="test").resend == [(item_id, "provision.in-memory")]
        again = Delivery("task-3", 0)
        assert provision_item(worker, item_id, actor="w", delivery=again) == Outcome.PROVISIONED
    assert world.provider.methods().count("provision") == 1
    assert world.state(item_id) == ("awaiting_claim", 1, 1)


def test_a_claim_on_a_connection_whose_backend_was_ended_fails_once_then_provisions_once(
    world: World,
) -> None:
    worker = world.worker()
    try:
        with worker.db.held("claim").use() as connection:  # the connection the claims keep
            pid = connection.execute(text("SELECT pg_backend_pid()")).scalar_one()
        with world.db.engine.connect() as connection:
            assert connection.execute(text("SELECT pg_terminate_backend(:p)"), {"p": pid}).scalar()
        item_id = world.routed()
        with pytest.raises(OperationalError):  # used a moment ago: not pinged, so it fails
            provision_item(worker, item_id, actor="worker-1")
        assert world.state(item_id) == ("routed", 0, 0)  # nothing was written
        assert world.provider.methods() == []
        assert provision_item(worker, item_id, actor="worker-1") == Outcome.PROVISIONED
    finally:
        worker.db.dispose()
    assert world.provider.methods().count("provision") == 1
    assert world.state(item_id) == ("awaiting_claim", 1, 1)
