"""The reaper ends its sandboxes a batch at a time (corral.worker.termination.end_sandboxes), on
real PostgreSQL: what one sandbox's failure leaves for the next sweep, rows that change
between the batch's read and its transaction, a batch that requeues some items and fails
others, and a statement count that does not grow with the batch.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from celery.exceptions import Retry
from sqlalchemy import delete, event, func, select, text, update

from corral.providers.base import SandboxHandle
from corral.providers.errors import CredentialMissingError, ProviderUnavailableError
from corral.providers.testing import InMemoryProvider
from corral.shared.store.db import utcnow
from corral.shared.store.ledger import record_costs
from corral.shared.store.models import (
    SLOT_HOLDING_STATES,
    CostEvent,
    LifecycleEvent,
    Pool,
    Sandbox,
    TerminationReason,
    WorkItem,
)
from corral.worker.reaper import find_stale
from corral.worker.tasks import terminate, terminate_many
from corral.worker.termination import end_sandbox, end_sandboxes
from tests.integration.reaping import Reaped, reaped_world


class SteeredTerminate(InMemoryProvider):
    """The in-memory provider, whose terminate fails for the sandboxes told, and runs a
    hook first (to change rows while a batch is under way)."""

    def __init__(self) -> None:
        super().__init__()
        self.refuse: dict[str, Exception] = {}
        self.before_terminate: Callable[[str], None] = lambda sandbox_id: None

    def terminate(self, handle: SandboxHandle) -> None:
        self.before_terminate(handle.external_id)
        refused = self.refuse.get(handle.external_id)
        if refused is not None:
            self._record("terminate", handle.external_id)
            raise refused
        super().terminate(handle)


@pytest.fixture
def reaped(fresh_pg_url: str, redis_url: str, tmp_path: Path) -> Iterator[Reaped]:
    with reaped_world(fresh_pg_url, redis_url, tmp_path, InMemoryProvider()) as world:
        yield world


@pytest.fixture
def steered(fresh_pg_url: str, redis_url: str, tmp_path: Path) -> Iterator[Reaped]:
    with reaped_world(fresh_pg_url, redis_url, tmp_path, SteeredTerminate()) as world:
        yield world


def _row(reaped: Reaped, sandbox_id: str) -> Sandbox:
    with reaped.db.session() as session:
        return session.get_one(Sandbox, sandbox_id)


def _live(reaped: Reaped, sandbox_id: str) -> bool:
    return _row(reaped, sandbox_id).terminated_at is None


# -- one sandbox's failure ----------------------------------------------------------------


def test_a_transient_terminate_failure_leaves_only_that_sandbox_for_the_next_sweep(
    steered: Reaped,
) -> None:
    stale = steered.stale(3)
    flaky = stale[1]
    steered.provider.refuse[flaky] = ProviderUnavailableError("the provider is down")

    first = steered.sweep()

    assert first.ended == {"never_claimed": 2} and first.errors == 1
    assert _live(steered, flaky) and flaky in steered.provider.boxes
    assert steered.costs(flaky) == []
    assert _row(steered, flaky).status == "ready"
    steered.assert_ended_and_billed_once([s for s in stale if s != flaky])

    del steered.provider.refuse[flaky]
    second = steered.sweep()

    assert second.ended == {"never_claimed": 1} and second.errors == 0
    assert flaky not in steered.provider.boxes
    steered.assert_ended_and_billed_once(stale)


def test_end_sandbox_raises_a_transient_failure_and_records_nothing(steered: Reaped) -> None:
    [sandbox_id] = steered.stale(1)
    steered.provider.refuse[sandbox_id] = ProviderUnavailableError("the provider is down")

    with pytest.raises(ProviderUnavailableError):
        end_sandbox(steered.rt, sandbox_id, reason=TerminationReason.CANCELLED, actor="test")

    assert _live(steered, sandbox_id) and steered.costs() == []


def test_a_permanent_terminate_failure_is_recorded_with_the_end(steered: Reaped) -> None:
    stale = steered.stale(2)
    steered.provider.refuse[stale[0]] = CredentialMissingError("no credential for in-memory")

    report = steered.sweep()

    assert report.ended == {"never_claimed": 2} and report.errors == 0
    with steered.db.session() as session:
        detail = session.scalar(
            select(LifecycleEvent.detail).where(
                LifecycleEvent.entity_id == stale[0], LifecycleEvent.to_state == "terminated"
            )
        )
    assert detail is not None
    assert detail.startswith("never_claimed: its runner did not claim the work")
    assert detail.endswith("; the provider could not terminate it: no credential for in-memory")
    steered.assert_ended_and_billed_once(stale)


def test_a_database_failure_leaves_the_whole_batch_for_the_next_sweep(steered: Reaped) -> None:
    stale = steered.stale(3)
    with steered.db.session() as session:  # the audit log refuses writes for a while
        session.execute(
            text(
                "CREATE FUNCTION refuse_events() RETURNS trigger LANGUAGE plpgsql AS "
                "$$ BEGIN RAISE EXCEPTION 'the audit log is unavailable'; END $$"
            )
        )
        session.execute(
            text(
                "CREATE TRIGGER refuse_events BEFORE INSERT ON lifecycle_events "
                "FOR EACH ROW EXECUTE FUNCTION refuse_events()"
            )
        )

    first = steered.sweep()

    assert first.ended == {} and first.errors == 3
    assert all(_live(steered, sandbox_id) for sandbox_id in stale)
    assert steered.costs() == []
    with steered.db.session() as session:
        session.execute(text("DROP TRIGGER refuse_events ON lifecycle_events"))

    second = steered.sweep()

    assert second.ended == {"never_claimed": 3} and second.errors == 0
    steered.assert_ended_and_billed_once(stale)


def test_a_lost_lease_stops_the_kills_and_records_those_made(reaped: Reaped) -> None:
    stale = sorted(reaped.stale(4))
    candidates = find_stale(reaped.rt, utcnow())
    answers = iter([True, True, True])  # the batch, then its first two sandboxes

    endings = end_sandboxes(
        reaped.rt, candidates, actor="reaper", renew=lambda: next(answers, False)
    )

    assert sorted(endings.ended) == stale[:2] and endings.errors == {}
    assert set(reaped.terminate_calls()) == set(stale[:2])
    assert all(_live(reaped, sandbox_id) for sandbox_id in stale[2:])
    assert reaped.sweep().ended == {"never_claimed": 2}
    reaped.assert_ended_and_billed_once(stale)


# -- rows that change under a batch -------------------------------------------------------


def test_a_sandbox_ended_after_the_batch_read_it_is_left_alone_and_billed_once(
    steered: Reaped,
) -> None:
    stale = sorted(steered.stale(3))
    first, second, third = stale

    def cancel_second(sandbox_id: str) -> None:
        # The api's cancel lands while the sweep is at the provider, after its read.
        if sandbox_id == first:
            end_sandbox(
                steered.rt, second, reason=TerminationReason.CANCELLED, actor="api", kill=False
            )

    steered.provider.before_terminate = cancel_second

    report = steered.sweep()

    items = {sandbox_id: _row(steered, sandbox_id).work_item_id for sandbox_id in stale}
    assert report.ended == {"never_claimed": 2}
    assert report.requeued == [items[first], items[third]]
    assert _row(steered, second).termination_reason == "cancelled"
    assert steered.item(items[second]).state == "awaiting_claim"  # a cancel leaves it be
    assert [c.termination_reason for c in steered.costs(second)] == ["cancelled"]
    steered.assert_ended_and_billed_once([first, second, third])
    assert steered.sweep().costs_written == 0


def test_a_requeue_and_a_failure_in_one_batch_each_settle_their_item(reaped: Reaped) -> None:
    requeued = reaped.dispatch()
    last = reaped.dispatch()  # its first sandbox is reaped first: its second is its last
    reaped.backdate(reaped.sandbox(last).id, started_at=601)
    assert reaped.sweep().requeued == [last]
    reaped.route_and_provision(last)
    silent, late = reaped.dispatch(), reaped.dispatch(resources={"timeout_s": 60})
    reaped.claim(silent)
    reaped.claim(late)
    reaped.backdate(reaped.sandbox(requeued).id, started_at=601)
    reaped.backdate(reaped.sandbox(last).id, started_at=601)
    reaped.backdate(reaped.sandbox(silent).id, last_heartbeat_at=61)
    reaped.backdate(reaped.sandbox(late).id, started_at=61, deadline_at=1)
    assert _slots_in_use(reaped) == 4

    report = reaped.sweep()

    assert report.ended == {"never_claimed": 2, "heartbeat_lost": 1, "deadline": 1}
    assert report.requeued == [requeued] and sorted(report.failed) == sorted([last, silent, late])
    outcomes = {item_id: _outcome(reaped, item_id) for item_id in (requeued, last, silent, late)}
    assert outcomes == {
        requeued: ("received", None, "awaiting_claim", "received"),
        last: ("failed", "never_claimed", "awaiting_claim", "failed"),
        silent: ("failed", "heartbeat_lost", "running", "failed"),
        late: ("failed", "deadline", "running", "failed"),
    }
    assert str(reaped.item(last).error_message).endswith("; gave up after 2 attempts")
    assert reaped.item(late).error_message == "it ran past its deadline (60 s after start)"
    assert _slots_in_use(reaped) == 0  # every item gave its slot back, each once
    ended = [reaped.sandbox(item_id).id for item_id in (requeued, last, silent, late)]
    reaped.assert_ended_and_billed_once([reaped.sandbox(last, attempt=1).id, *ended])


@pytest.fixture
def unbroken(fresh_pg_url: str, redis_url: str, tmp_path: Path) -> Iterator[Reaped]:
    """A world whose pool's breaker never opens: its ends are counted, as always, but no
    sweep adds the opening's event to what it writes."""
    provider = InMemoryProvider()
    with reaped_world(fresh_pg_url, redis_url, tmp_path, provider, breaker_failures=1000) as world:
        yield world


def test_a_sweeps_statements_do_not_grow_with_its_stale_sandboxes(unbroken: Reaped) -> None:
    reaped = unbroken
    counts = []
    for stale in (2, 9):
        reaped.stale(stale)
        statements: list[str] = []

        def count(*args: Any, into: list[str] = statements) -> None:
            into.append(args[2])

        event.listen(reaped.db.engine, "before_cursor_execute", count)
        try:
            assert reaped.sweep().ended == {"never_claimed": stale}
        finally:
            event.remove(reaped.db.engine, "before_cursor_execute", count)
        counts.append(len(statements))

    # What a sweep writes besides its ends: the budgets read, the sweep's clock, each pool's
    # breaker count, read and written once whatever its ends, the webhook endpoints the
    # billed ends owe sandbox.ended events to, read once, the items' messages the end logs
    # are redacted with, read once, the named secrets those items used (for the same), read
    # once, the expiry rule's read of the items past their own expires_at, and the savepoint
    # the cost events are written under in the ends' transaction (38 in all).
    assert counts[0] == counts[1] and counts[0] <= 38, counts


# -- helpers ------------------------------------------------------------------------------


def _slots_in_use(reaped: Reaped) -> int:
    with reaped.db.session() as session:
        counter = session.get_one(Pool, "pool-in-memory").slots_in_use
        real = session.scalar(
            select(func.count())
            .select_from(WorkItem)
            .where(WorkItem.state.in_([state.value for state in SLOT_HOLDING_STATES]))
        )
    assert counter == real
    return counter


def _outcome(reaped: Reaped, item_id: str) -> tuple[str, str | None, str | None, str]:
    """The item's state and error code, and its last lifecycle move (from, to)."""
    item = reaped.item(item_id)
    with reaped.db.session() as session:
        last = session.scalars(
            select(LifecycleEvent)
            .where(LifecycleEvent.entity == "work_item", LifecycleEvent.entity_id == item_id)
            .order_by(LifecycleEvent.id.desc())
        ).first()
    assert last is not None and last.actor == "reaper"
    return item.state, item.error_code, last.from_state, last.to_state


# -- the ledger, a batch at a time --------------------------------------------------------


def test_one_sandbox_whose_cost_event_cannot_be_written_holds_up_no_other(
    reaped: Reaped,
) -> None:
    stale = sorted(reaped.stale(3))
    poisoned = stale[1]
    with reaped.db.session() as session:  # the ledger refuses this one sandbox's event
        session.execute(
            text(
                "CREATE FUNCTION refuse_cost() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN "
                f"IF NEW.sandbox_id = '{poisoned}' THEN RAISE EXCEPTION 'refused'; END IF; "
                "RETURN NEW; END $$"
            )
        )
        session.execute(
            text(
                "CREATE TRIGGER refuse_cost BEFORE INSERT ON cost_events "
                "FOR EACH ROW EXECUTE FUNCTION refuse_cost()"
            )
        )

    first = reaped.sweep()

    assert first.ended == {"never_claimed": 3}
    assert (first.costs_written, first.errors) == (2, 1)  # the sweep's retry, one at a time
    assert sorted(c.sandbox_id for c in reaped.costs()) == [stale[0], stale[2]]
    with reaped.db.session() as session:
        session.execute(text("DROP TRIGGER refuse_cost ON cost_events"))

    assert reaped.sweep().costs_written == 1
    reaped.assert_ended_and_billed_once(stale)


def test_a_sandbox_billed_but_still_marked_due_is_only_unmarked(reaped: Reaped) -> None:
    stale = sorted(reaped.stale(2))
    assert reaped.sweep().costs_written == 0  # both billed as they ended
    [billed] = reaped.costs(stale[0])
    with reaped.db.session() as session:  # as if a writer had died between the two
        session.execute(update(Sandbox).where(Sandbox.id.in_(stale)).values(cost_due_at=utcnow()))
        session.execute(delete(CostEvent).where(CostEvent.sandbox_id == stale[1]))

    written = record_costs(reaped.db, stale)

    assert [event.sandbox_id for event in written] == [stale[1]]
    assert [c.id for c in reaped.costs(stale[0])] == [billed.id]
    assert all(_row(reaped, sandbox_id).cost_due_at is None for sandbox_id in stale)
    reaped.assert_ended_and_billed_once(stale)


# -- the api's batches of finished sandboxes (corral.terminate_many) ----------------------


def _retries_of(task: Any, monkeypatch: pytest.MonkeyPatch) -> list[list[Any]]:
    """The arguments ``task`` is sent again with, each time it retries (raising Retry)."""
    again: list[list[Any]] = []

    def retry(*, args: list[Any], countdown: float) -> Retry:
        again.append(args)
        return Retry()

    monkeypatch.setattr(task, "retry", retry)
    return again


def test_a_batch_of_ends_ends_each_and_sends_only_the_unreached_again(
    steered: Reaped, monkeypatch: pytest.MonkeyPatch
) -> None:
    stale = steered.stale(3)
    flaky = stale[1]
    steered.provider.refuse[flaky] = ProviderUnavailableError("the provider is down")
    again = _retries_of(terminate_many, monkeypatch)
    with pytest.raises(Retry):
        terminate_many.run(stale, "finished")

    assert again == [[[flaky], "finished"]]  # the others are not ended twice
    assert _live(steered, flaky) and steered.costs(flaky) == []
    steered.assert_ended_and_billed_once([s for s in stale if s != flaky])

    del steered.provider.refuse[flaky]
    assert terminate_many.run([flaky], "finished") == 1
    assert terminate_many.run(stale, "finished") == 0  # delivered again: nothing twice
    steered.assert_ended_and_billed_once(stale)


@pytest.mark.parametrize("ids", ["sb-1", [1, 2], ["sb"] * 201])
def test_a_malformed_batch_is_refused_naming_its_argument(reaped: Reaped, ids: Any) -> None:
    with pytest.raises(ValueError, match="sandbox_ids must be a list of at most 200"):
        terminate_many.run(ids, "finished")


def test_a_single_end_whose_provider_is_away_is_sent_again_as_it_came(
    steered: Reaped, monkeypatch: pytest.MonkeyPatch
) -> None:
    [sandbox_id] = steered.stale(1)
    steered.provider.refuse[sandbox_id] = ProviderUnavailableError("the provider is down")
    again = _retries_of(terminate, monkeypatch)
    with pytest.raises(Retry):
        terminate.run(sandbox_id, "cancelled")

    assert again == [[sandbox_id, "cancelled"]] and _live(steered, sandbox_id)
    del steered.provider.refuse[sandbox_id]
    assert terminate.run(sandbox_id, "cancelled") is True
    assert terminate.run(sandbox_id, "cancelled") is False  # delivered again: nothing twice
    steered.assert_ended_and_billed_once([sandbox_id])
