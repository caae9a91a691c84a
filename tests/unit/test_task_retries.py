"""Worker tasks wait out a database outage instead of failing or being dropped."""

from __future__ import annotations

from typing import Any

import pytest
from celery.exceptions import Retry
from sqlalchemy.exc import OperationalError
from sqlalchemy.exc import TimeoutError as PoolTimeoutError

from corral.shared import runtime
from corral.shared.broker.celery_app import app
from corral.shared.settings import CoreSettings
from corral.shared.store.db import make_engine
from corral.worker import tasks
from corral.worker.claims import Delivery
from corral.worker.provision import Outcome


class _DownDatabase:
    # A PostgreSQL nobody listens on: what the sweep lock connects to.
    engine = make_engine("postgresql+psycopg://nobody@127.0.0.1:1/none")
    is_postgres = True

    def session(self) -> object:
        raise OperationalError("SELECT 1", {}, Exception("connection refused"))

    connection = autocommit = use = session

    def held(self, _name: str) -> object:
        return self


@pytest.mark.parametrize(
    ("task", "args"),
    [
        (tasks.provision, ["wi-1"]),
        (tasks.terminate, ["sb-1", "finished"]),
        (tasks.terminate_many, [["sb-1", "sb-2"], "finished"]),
        (tasks.redrive_task, []),
        (tasks.reaper_sweep, []),
    ],
)
def test_a_database_outage_retries_the_task(task: object, args: list[str]) -> None:
    down: Any = _DownDatabase()
    runtime.install(runtime.Runtime(settings=CoreSettings(), db=down))
    app.conf.task_eager_propagates = True
    try:
        with pytest.raises(Retry):
            task.apply(args=args, throw=True)  # type: ignore[attr-defined]
    finally:
        app.conf.task_eager_propagates = False
        runtime.reset()


class _BusyPool:
    """Every connection of the process's pool stays checked out."""

    is_postgres = True

    def session(self) -> object:
        raise PoolTimeoutError("QueuePool limit of size 2 overflow 0 reached")

    connection = autocommit = use = session

    def held(self, _name: str) -> object:
        return self


def test_a_provision_that_finds_no_free_connection_retries() -> None:
    busy: Any = _BusyPool()
    runtime.install(runtime.Runtime(settings=CoreSettings(), db=busy))
    app.conf.task_eager_propagates = True
    try:
        with pytest.raises(Retry):
            tasks.provision.apply(args=["wi-1"], throw=True)
    finally:
        app.conf.task_eager_propagates = False
        runtime.reset()


def test_redrive_requests_are_coalesced_and_expire(monkeypatch: pytest.MonkeyPatch) -> None:
    from corral.scheduler import publish

    sent: list[dict[str, Any]] = []
    monkeypatch.setattr(publish.app, "send_task", lambda name, **options: sent.append(options))
    monkeypatch.setattr(publish, "_last_redrive", [float("-inf")])
    assert [publish.request_redrive() for _ in range(50)].count(True) == 1
    assert sent == [{"kwargs": {"sweep": False}, "expires": publish.REDRIVE_EXPIRES_S}]
    publish._last_redrive[0] -= publish.REDRIVE_GAP_S
    assert publish.request_redrive()
    assert len(sent) == 2


def test_a_provision_task_claims_as_its_own_try_so_that_its_retry_takes_over(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    asked: list[Delivery | None] = []

    def provision_item(*_: Any, delivery: Delivery | None = None, **__: Any) -> Outcome:
        asked.append(delivery)
        return Outcome.PROVISIONED

    monkeypatch.setattr(tasks, "provision_item", provision_item)
    monkeypatch.setattr(tasks.pacing, "admit", lambda *_, **__: None)  # a provider not paced
    monkeypatch.setattr(tasks.pacing, "settle", lambda *_, **__: None)
    unused: Any = _DownDatabase()  # the task reaches no database here
    runtime.install(runtime.Runtime(settings=CoreSettings(), db=unused))
    try:
        tasks.provision.apply(args=["wi-1"], task_id="task-1", retries=2)
    finally:
        runtime.reset()
    assert asked == [Delivery("task-1", 2)]


def test_a_redrive_asked_for_while_one_runs_makes_it_go_round_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The second request comes while the first re-drive reads the pools: it returns at once,
    and the running one goes round once more, so the slot it was about is not left free."""
    import threading

    from corral.worker.maintenance import RedriveReport

    inside, release = threading.Event(), threading.Event()
    rounds: list[int] = []

    def redrive(*_: Any, **__: Any) -> RedriveReport:
        rounds.append(len(rounds))
        if len(rounds) == 1:
            inside.set()
            assert release.wait(10)
        return RedriveReport(routed=[], resend=[])

    monkeypatch.setattr(tasks, "redrive", redrive)
    monkeypatch.setattr(runtime, "current", lambda: None)
    first = threading.Thread(target=tasks.redrive_task.run)
    first.start()
    assert inside.wait(10)
    assert tasks.redrive_task.run() == 0  # the running one does it
    release.set()
    first.join(10)
    assert rounds == [0, 1]
    tasks.redrive_task.run()  # nothing running: one round of its own
    assert rounds == [0, 1, 2]


@pytest.mark.parametrize(
    ("ended", "asks"),
    [
        # Finished work freed its slot as its runner reported (that report asked).
        ({"ended": True, "reason": "finished"}, False),
        ({"ended": True, "reason": "finished", "failed": "wi-1"}, True),
        ({"ended": True, "reason": "cancelled"}, True),
        ({"ended": True, "reason": "never_claimed", "requeued": "wi-1", "not_before": 1}, True),
        ({"ended": False, "reason": "cancelled"}, False),
    ],
)
def test_an_end_asks_for_a_hand_on_only_when_it_freed_a_slot(
    monkeypatch: pytest.MonkeyPatch, ended: dict[str, Any], asks: bool
) -> None:
    from corral.shared.store.models import TerminationReason
    from corral.worker import tasks
    from corral.worker.termination import Ended

    asked: list[bool] = []
    monkeypatch.setattr(tasks, "request_redrive", lambda: asked.append(True) or True)
    monkeypatch.setattr(tasks.app, "send_task", lambda *args, **kwargs: None)
    fields = {**ended, "reason": TerminationReason(ended["reason"])}
    tasks.follow_up(Ended(**fields))
    assert bool(asked) is asks
