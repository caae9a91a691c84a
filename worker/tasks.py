"""Provider-worker and maintenance tasks.

``corral.provision`` runs on ``provision.<provider>[.gpu]`` in ``corral worker --provider``
processes (a threads pool: provisioning waits on providers, so one process keeps many in
flight). ``corral.terminate``, ``corral.terminate_many``, ``corral.redrive``,
``corral.reaper.sweep`` and ``corral.outcomes.deliver`` run on ``maintenance``.
"""

from __future__ import annotations

import logging
import random
import threading
from collections.abc import Callable
from typing import Any

from celery import Task
from sqlalchemy.exc import InterfaceError, OperationalError
from sqlalchemy.exc import TimeoutError as PoolTimeoutError

from corral.providers.errors import TransientProviderError
from corral.scheduler.end_batches import MAX_BATCH
from corral.scheduler.hand_on import Coalesced
from corral.scheduler.publish import enqueue_all, request_redrive, send_provision
from corral.shared import runtime
from corral.shared.broker.celery_app import app
from corral.shared.broker.queues import provider_of_queue
from corral.shared.broker.redis_transport import DELIVERED_FROM
from corral.shared.store import warm
from corral.shared.store.models import TerminationReason
from corral.worker import pacing
from corral.worker.claims import Delivery
from corral.worker.maintenance import redrive
from corral.worker.outcome_delivery import deliver_due
from corral.worker.outcome_sinks.base import OutcomeSink
from corral.worker.outcome_sinks.celery_result import CeleryResultSink
from corral.worker.outcome_sinks.webhook import WebhookSink
from corral.worker.provision import Outcome, RetryLater, provision_item
from corral.worker.reaper import sweep
from corral.worker.sweep_lock import sweep_lock
from corral.worker.termination import Ended, EndRequest, end_sandboxes
from corral.worker.warm import provision_warm, warm_tick

log = logging.getLogger(__name__)


def backoff_s(retries: int, *, base: float, cap: float) -> float:
    """Exponential backoff with full jitter: uniform in [0, min(cap, base * 2^retries)]."""
    return random.uniform(0, min(cap, base * 2**retries))  # noqa: S311 - jitter, not crypto


# While the database is unreachable (or every connection of the process's pool stays busy)
# a task waits and tries again (with backoff) instead of failing: a lost provision would
# otherwise wait out its lease.
DATABASE_DOWN = {
    "autoretry_for": (OperationalError, InterfaceError, PoolTimeoutError),
    "retry_backoff": 1,
    "retry_backoff_max": 30,
    "retry_jitter": True,
}


@app.task(name="corral.provision", bind=True, max_retries=None, **DATABASE_DOWN)
def provision(self: Task, item_id: str) -> str:
    """Provision the sandbox for ``item_id`` (the only argument: no token ever travels here)."""
    rt = runtime.current()
    settings = rt.settings
    retries = self.request.retries or 0
    actor = f"worker:{self.request.hostname or 'local'}"
    # A retry (after a lost answer, say) takes over the lease an earlier try left.
    delivery = Delivery(self.request.id, retries) if self.request.id else None
    pace = pacing.admit(rt, item_id, provider_hint=provider_of_queue(_queue_of(self.request)))
    if isinstance(pace, pacing.Deferred):
        return _paced(pace, retries)
    outcome = None
    try:
        outcome = provision_item(
            rt,
            item_id,
            actor=actor,
            final_attempt=retries >= settings.provision_max_retries,
            delivery=delivery,
            pace=pace,
        )
    except pacing.Paced as exc:
        return _paced(exc.deferred, retries)
    except RetryLater as exc:
        delay = backoff_s(
            retries, base=settings.provision_backoff_s, cap=settings.provision_backoff_max_s
        )
        log.warning(
            "transient provider error, retrying",
            extra={"work_item_id": item_id, "code": exc.code, "retry_in_s": round(delay, 2)},
        )
        raise self.retry(countdown=delay, exc=exc) from exc
    finally:
        pacing.settle(rt, pace, succeeded=outcome in _MADE)
    if outcome is Outcome.FAILED_OVER:
        app.send_task("corral.route", args=[item_id])  # to the next qualifying pool, now
    if outcome in (Outcome.FAILED, Outcome.RAN, Outcome.FAILED_OVER, Outcome.WAITING):
        request_redrive()  # its slot is free again (a waiting item is the re-drive's, once due)
    elif outcome not in (Outcome.PROVISIONED, Outcome.WARM):
        # A delivery that found nothing to do (provider workers log no line per task).
        log.info("nothing to provision", extra={"work_item_id": item_id, "outcome": outcome.value})
    return outcome.value


_MADE = frozenset({Outcome.PROVISIONED, Outcome.RAN})  # a create the provider took


def _queue_of(request: Any) -> str | None:
    """The queue a task was delivered from, as its delivery info says (None: unknown)."""
    info = request.delivery_info if isinstance(request.delivery_info, dict) else {}
    queue = info.get(DELIVERED_FROM) or info.get("routing_key")
    return queue if isinstance(queue, str) else None


def _paced(deferred: pacing.Deferred, retries: int) -> str:
    """Send the provision again for when its provider's pace lets it go: a fresh message
    that keeps the retries made so far (a pace counts none)."""
    send_provision(
        deferred.item_id, deferred.queue, countdown=deferred.countdown_s, retries=retries
    )
    return Outcome.PACED.value


@app.task(name="corral.terminate", bind=True, max_retries=10, **DATABASE_DOWN)
def terminate(self: Task, sandbox_id: str, reason: str) -> bool:
    """End ``sandbox_id`` for ``reason`` (a :class:`TerminationReason` value); safe to deliver
    more than once."""
    return _end(self, [sandbox_id], reason, again=lambda _: [sandbox_id, reason]) == 1


@app.task(name="corral.terminate_many", bind=True, max_retries=10, **DATABASE_DOWN)
def terminate_many(self: Task, sandbox_ids: list[str], reason: str) -> int:
    """End ``sandbox_ids`` for ``reason`` as one batch (the sandboxes whose work finished,
    gathered by the api: corral.scheduler.end_batches); safe to deliver more than once.
    Those whose provider could not be reached are sent again, alone. How many ended."""
    if not (
        isinstance(sandbox_ids, list)
        and len(sandbox_ids) <= MAX_BATCH
        and all(isinstance(one, str) for one in sandbox_ids)
    ):
        raise ValueError(f"sandbox_ids must be a list of at most {MAX_BATCH} sandbox ids")
    return _end(self, sandbox_ids, reason, again=lambda unreached: [unreached, reason])


def _end(
    task: Task, sandbox_ids: list[str], reason: str, *, again: Callable[[list[str]], list[Any]]
) -> int:
    """End ``sandbox_ids`` as one batch and follow each end up; how many this ended. Those
    whose provider could not be reached are retried with the arguments ``again`` gives for
    them (a database error, or a fault of ours, retries or fails the whole task)."""
    cause = TerminationReason(reason)
    requests = [EndRequest(sandbox_id, cause) for sandbox_id in sandbox_ids]
    endings = end_sandboxes(runtime.current(), requests, actor="maintenance")
    for outcome in endings.ended.values():
        follow_up(outcome)
    errors = endings.errors
    unreached = sorted(one for one, exc in errors.items() if isinstance(exc, _UNREACHED))
    if len(unreached) < len(errors):
        raise next(exc for exc in errors.values() if not isinstance(exc, _UNREACHED))
    if unreached:
        countdown = backoff_s(task.request.retries or 0, base=1, cap=60)
        raise task.retry(args=again(unreached), countdown=countdown)
    return sum(1 for outcome in endings.ended.values() if outcome.ended)


_UNREACHED = TransientProviderError  # a provider away: its sandboxes are sent again alone


def follow_up(outcome: Ended) -> None:
    """After a sandbox ended: route its item again if it was requeued (one backing off is
    the re-drive's, once its time has come); hand its slot on when this end freed one (its
    item requeued or failed, or its work cancelled). Work that finished freed its slot as
    its runner reported, and that report asked for the hand-on."""
    if outcome.requeued and outcome.not_before is None:
        app.send_task("corral.route", args=[outcome.requeued])
    freed = outcome.requeued or outcome.failed or outcome.reason != TerminationReason.FINISHED
    if outcome.ended and freed:
        request_redrive()


# One re-drive at a time per process: a second one would route the same items, and while
# it waited on the first it would hold a worker slot the reaper's sweep needs. A request
# that finds one running is not lost: it asks the running one to go round once more (the
# slot that request is about may have been freed after that one read the pools).
_redrives = Coalesced()
_sweep_due = threading.Event()  # a request asked for the sweep's part too


# The periodic tasks send no task events: every few seconds each, they would bury the
# work's tasks in Flower. What they do is in the logs and the metrics (corral_sandboxes_reaped).
@app.task(name="corral.redrive", max_retries=5, send_events=False, **DATABASE_DOWN)
def redrive_task(sweep: bool = True) -> int:
    """Route waiting items; with ``sweep`` (beat's), stranded ones too, and re-send lost
    provision tasks (a hand-on a freed slot asks for is ``sweep=False``). Returns at once
    when another re-drive runs in this process, which then goes round once more (sweeping
    if any request asked to)."""
    if sweep:
        _sweep_due.set()
    done = 0

    def step() -> None:
        nonlocal done
        sweeping = _sweep_due.is_set()
        _sweep_due.clear()
        report = redrive(runtime.current(), actor="maintenance", sweep=sweeping)
        enqueue_all(report.routed)
        for item_id, queue in report.resend:
            send_provision(item_id, queue)
        done += len(report.routed) + len(report.resend)

    _redrives.run(step)
    return done


@app.task(name="corral.reaper.sweep", max_retries=5, send_events=False, **DATABASE_DOWN)
def reaper_sweep() -> dict[str, object]:
    """End stale, orphaned and gone sandboxes; write the cost events still owed."""
    rt = runtime.current()
    report = sweep(rt, sweep_lock(rt.db, rt.settings))
    for item_id in report.requeued:
        if item_id not in report.backing_off:  # those are the re-drive's once due
            app.send_task("corral.route", args=[item_id])
    if report.ended or report.expired:  # slots given back
        request_redrive()
    return report.summary()


# One delivery run at a time per process (another would claim nothing: the rows are
# claimed); the sinks are built once per process, from its settings.
_delivering = threading.Lock()


def _sinks(rt: runtime.Runtime) -> dict[str, OutcomeSink]:
    """The process's sinks, built once per runtime (a runtime is not hashable: it is kept
    as one of the runtime's parts)."""
    return rt.part("outcome-sinks", _build_sinks)


def _build_sinks(rt: runtime.Runtime) -> dict[str, OutcomeSink]:
    sinks: dict[str, OutcomeSink] = {WebhookSink.name: WebhookSink(rt.db, rt.settings)}
    if rt.settings.result_backend is not None:
        sinks[CeleryResultSink.name] = CeleryResultSink.from_url(app, rt.settings.result_backend)
    return sinks


@app.task(name="corral.outcomes.deliver", max_retries=5, send_events=False, **DATABASE_DOWN)
def deliver_outcomes() -> dict[str, int]:
    """Deliver the outcomes ended items owe (their results stored, callbacks sent, webhook
    events POSTed)."""
    if not _delivering.acquire(blocking=False):
        return {}
    try:
        rt = runtime.current()
        report = deliver_due(rt.db, _sinks(rt), rt.settings)
    finally:
        _delivering.release()
    return report.summary()


@app.task(name="corral.warm.provision", max_retries=None, **DATABASE_DOWN)
def warm_provision(warm_id: str) -> str:
    """Make warm sandbox ``warm_id`` (its id is all the task carries: the enrolment
    credential is minted here and goes to the provider alone)."""
    return provision_warm(runtime.current(), warm_id).value


@app.task(name="corral.warm.tick", max_retries=5, send_events=False, **DATABASE_DOWN)
def warm_tick_task() -> dict[str, int]:
    """End stale and surplus warm sandboxes; send a provision for each one missing, and again
    for each one an earlier tick wrote but did not note as sent (it failed after its commit).
    The sends are noted once made; the next tick sends again those this one did not note."""
    rt = runtime.current()
    result = warm_tick(rt)
    for warm_id, queue in result.to_send:
        app.send_task("corral.warm.provision", args=[warm_id], queue=queue)
    warm.mark_sent(rt.db, [warm_id for warm_id, _ in result.to_send])
    return {"ended": len(result.ended), "made": len(result.made), "resent": len(result.unsent)}
