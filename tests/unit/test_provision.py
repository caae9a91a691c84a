"""corral.provision's logic with the in-memory provider on SQLite: idempotency, retries,
permanent failures, lease take-over, and where the token goes."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from datetime import timedelta

import pytest
from sqlalchemy import func, inspect, select, text, update

from corral.providers.testing import InMemoryProvider
from corral.scheduler.intake import accept, route_item
from corral.shared.messages import DispatchRequest
from corral.shared.runtime import Runtime
from corral.shared.settings import CoreSettings
from corral.shared.store.db import Database, utcnow
from corral.shared.store.lifecycle import transition
from corral.shared.store.models import (
    CostEvent,
    ItemState,
    Pool,
    RegistrationToken,
    Sandbox,
    WorkItem,
)
from corral.shared.store.tokens import hash_token
from corral.worker.claims import Delivery
from corral.worker.provision import Outcome, RetryLater, provision_item
from corral.worker.tasks import backoff_s
from tests.seeding import in_memory_pool


@pytest.fixture
def provider() -> InMemoryProvider:
    return InMemoryProvider()


@pytest.fixture
def rt(sqlite_db: Database, provider: InMemoryProvider, tmp_path) -> Iterator[Runtime]:  # type: ignore[no-untyped-def]
    runtime = Runtime(settings=CoreSettings(state_dir=tmp_path), db=sqlite_db)
    runtime.use_provider(provider)
    in_memory_pool(sqlite_db)
    yield runtime


def routed_item(rt: Runtime, **fields: object) -> str:
    request = DispatchRequest.model_validate(
        {
            "org": "acme",
            "project": "web",
            "profile": "default",
            "work": {"kind": "shell", "command": "echo hi"},
            **fields,
        }
    )
    item_id = accept(rt.db, request, actor="test").item_id
    assert (
        route_item(rt.db, item_id, actor="test", settings=rt.settings).queue
        == "provision.in-memory"
    )
    return item_id


def item_and_sandboxes(rt: Runtime, item_id: str) -> tuple[WorkItem, list[Sandbox]]:
    with rt.db.session() as session:
        item = session.get(WorkItem, item_id)
        sandboxes = list(session.scalars(select(Sandbox).where(Sandbox.work_item_id == item_id)))
    assert item is not None
    return item, sandboxes


def test_provision_stores_the_handle_and_hands_the_token_only_to_the_provider(
    rt: Runtime, provider: InMemoryProvider
) -> None:
    item_id = routed_item(rt)
    assert provision_item(rt, item_id, actor="test") is Outcome.PROVISIONED

    item, [sandbox] = item_and_sandboxes(rt, item_id)
    assert item.state == "awaiting_claim"
    assert sandbox.status == "ready"
    assert sandbox.external_id == sandbox.id
    assert sandbox.handle_metadata["org_id"] == "acme"
    token = provider.boxes[sandbox.id].spec.registration_token.get_secret_value()
    assert token.startswith("crt_")
    tables = inspect(rt.db.engine).get_table_names()
    with rt.db.session() as session:
        stored = session.scalars(select(RegistrationToken)).one()
        assert stored.token_hash == hash_token(token)
        # The plain token is in no column of any table.
        for table in tables:
            for row in session.execute(text(f'select * from "{table}"')):
                assert token not in str(tuple(row))


def test_a_second_delivery_reconciles_instead_of_provisioning_again(
    rt: Runtime, provider: InMemoryProvider
) -> None:
    item_id = routed_item(rt)
    assert provision_item(rt, item_id, actor="test") is Outcome.PROVISIONED
    assert provision_item(rt, item_id, actor="test") is Outcome.ALREADY_PROVISIONED
    assert provider.methods().count("provision") == 1
    assert len(item_and_sandboxes(rt, item_id)[1]) == 1


def test_transient_errors_retry_then_succeed_on_the_same_sandbox_row(
    rt: Runtime, provider: InMemoryProvider
) -> None:
    item_id = routed_item(rt)
    provider.fail_transiently(1)
    with pytest.raises(RetryLater) as raised:
        provision_item(rt, item_id, actor="test")
    assert raised.value.cause.code == "provider_unavailable"
    with rt.db.session() as session:
        first = session.scalars(select(RegistrationToken)).one()
        assert first.redeemed_at is not None  # revoked: the retry mints a new one
    assert provision_item(rt, item_id, actor="test") is Outcome.PROVISIONED
    item, sandboxes = item_and_sandboxes(rt, item_id)
    assert item.state == "awaiting_claim"
    assert len(sandboxes) == 1


def test_transient_errors_on_the_final_attempt_fail_an_item_without_failover(
    rt: Runtime, provider: InMemoryProvider
) -> None:
    item_id = routed_item(rt, failover=False)  # with it, the item waits (test_failover.py)
    provider.fail_transiently(1)
    assert provision_item(rt, item_id, actor="test", final_attempt=True) is Outcome.FAILED
    item, [sandbox] = item_and_sandboxes(rt, item_id)
    assert item.state == "failed"
    assert item.error_code == "provider_unavailable"
    assert "gave up after retrying" in (item.error_message or "")
    assert sandbox.status == "failed"


def test_permanent_errors_fail_the_item_with_the_providers_message_and_clean_up(
    rt: Runtime, provider: InMemoryProvider
) -> None:
    item_id = routed_item(rt, failover=False)  # with it, the next pool's turn (test_failover.py)
    provider.fail_permanently("image acme/runner:9 does not exist")
    assert provision_item(rt, item_id, actor="test") is Outcome.FAILED
    item, [sandbox] = item_and_sandboxes(rt, item_id)
    assert (item.state, item.error_code) == ("failed", "create_failed")
    assert item.error_message == "image acme/runner:9 does not exist"
    assert sandbox.status == "failed"
    assert provider.methods()[-1] == "terminate"  # whatever was partly made is cleaned up
    with rt.db.session() as session:
        assert session.scalars(select(RegistrationToken)).one().redeemed_at is not None


def test_a_live_lease_means_in_flight_and_an_expired_one_is_taken_over(
    rt: Runtime, provider: InMemoryProvider
) -> None:
    item_id = routed_item(rt)
    provider.fail_transiently(1)
    with pytest.raises(RetryLater):
        provision_item(rt, item_id, actor="test")
    with rt.db.session() as session:  # another worker holds it now
        session.execute(update(Sandbox).values(lease_until=utcnow() + timedelta(minutes=5)))
    assert provision_item(rt, item_id, actor="test") is Outcome.IN_FLIGHT
    with rt.db.session() as session:  # ... and died
        session.execute(update(Sandbox).values(lease_until=utcnow() - timedelta(seconds=1)))
    calls_before = len(provider.calls)
    assert provision_item(rt, item_id, actor="test") is Outcome.PROVISIONED
    assert provider.methods()[calls_before:] == ["terminate", "provision"]


def test_an_item_that_is_no_longer_routed_is_skipped(
    rt: Runtime, provider: InMemoryProvider
) -> None:
    item_id = routed_item(rt)
    with rt.db.session() as session:
        session.execute(update(WorkItem).values(state="cancelled"))
    assert provision_item(rt, item_id, actor="test") is Outcome.SKIPPED
    assert provider.calls == []


def test_backoff_is_bounded_and_jittered() -> None:
    delays = [backoff_s(retries, base=1.0, cap=30.0) for retries in range(10) for _ in range(50)]
    assert all(0 <= d <= 30.0 for d in delays)
    assert max(backoff_s(0, base=1.0, cap=30.0) for _ in range(50)) <= 1.0
    assert len({round(d, 6) for d in delays}) > 100  # jitter: not a fixed schedule


def test_an_item_cancelled_while_its_sandbox_is_made_leaves_no_sandbox_running(
    rt: Runtime, provider: InMemoryProvider
) -> None:
    item_id = routed_item(rt)
    provider.hang()
    outcome: list[Outcome] = []
    worker = threading.Thread(target=lambda: outcome.append(provision_item(rt, item_id, actor="t")))
    worker.start()
    deadline = time.monotonic() + 5
    while "provision" not in provider.methods() and time.monotonic() < deadline:
        time.sleep(0.01)
    with rt.db.session() as session:  # cancelled from the api meanwhile
        item = session.get(WorkItem, item_id)
        assert item is not None
        transition(session, item, ItemState.CANCELLED, actor="test")
    provider.release()
    worker.join(10)
    assert outcome == [Outcome.SKIPPED]
    assert provider.boxes == {}  # made, then terminated at once
    item, [sandbox] = item_and_sandboxes(rt, item_id)
    assert item.state == "cancelled"
    # Its end is recorded (and billed) by the worker that made it: nothing waits on it.
    assert (sandbox.status, sandbox.termination_reason) == ("terminated", "cancelled")
    assert sandbox.terminated_at is not None and sandbox.cost_due_at is None
    with rt.db.session() as session:
        assert (
            session.scalar(
                select(func.count())
                .select_from(CostEvent)
                .where(CostEvent.sandbox_id == sandbox.id)
            )
            == 1
        )


@pytest.mark.parametrize(
    ("fields", "gpus"),
    [
        ({"agent_card": {"requires": [{"kind": "gpu"}]}}, 1),  # a GPU, no count: one
        ({"resources": {"gpu": 2}}, 2),
        ({"agent_card": {"requires": [{"kind": "gpu"}]}, "resources": {"gpu": 4}}, 4),
    ],
)
def test_work_routed_for_a_gpu_asks_the_provider_for_its_gpus(
    rt: Runtime, provider: InMemoryProvider, fields: dict[str, object], gpus: int
) -> None:
    with rt.db.session() as session:
        session.execute(update(Pool).values(capabilities={"supports_gpu": True}))
    request = DispatchRequest.model_validate(
        {
            "org": "acme",
            "project": "web",
            "profile": "default",
            "work": {"kind": "shell", "command": "nvidia-smi"},
            **fields,
        }
    )
    item_id = accept(rt.db, request, actor="test").item_id
    assert (
        route_item(rt.db, item_id, actor="test", settings=rt.settings).queue
        == "provision.in-memory.gpu"
    )
    assert provision_item(rt, item_id, actor="test") is Outcome.PROVISIONED
    _, [sandbox] = item_and_sandboxes(rt, item_id)
    assert provider.boxes[sandbox.id].spec.resources.gpu == gpus


def test_a_deliverys_holder_fits_its_column_whatever_the_task_id_and_retries() -> None:
    for task_id, attempt in (("x" * 100_000, 10**40), ("\udcff", -3), ("", 0)):
        holder = Delivery(task_id, attempt).holder
        assert len(holder) <= 64, holder
    assert Delivery("t", 10**40).follows(Delivery("t", 5).holder)
    assert not Delivery("t", -1).follows(Delivery("t", 0).holder)
    assert not Delivery("t", 1).follows("garbage") and not Delivery("t", 1).follows(None)
