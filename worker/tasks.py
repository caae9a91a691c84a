"""Provider-worker and maintenance tasks.

``corral.provision`` runs on ``provision.<provider>[.gpu]`` in ``corral worker --provider``
processes (a threads pool: provisioning waits on providers, so one process keeps many in
flight). ``corral.terminate``, ``corral.redrive`` and ``corral.reaper.sweep`` run on
``maintenance``.
"""

from __future__ import annotations

import logging
import random

from celery import Task

from providers.errors import TransientProviderError
from scheduler.tasks import enqueue, send_provision
from shared import runtime
from shared.celery_app import app
from shared.models import TerminationReason
from worker.maintenance import redrive
from worker.provision import Outcome, RetryLater, provision_item
from worker.reaper import sweep
from worker.sweep_lock import sweep_lock
from worker.termination import Ended, end_sandbox

log = logging.getLogger(__name__)


def backoff_s(retries: int, *, base: float, cap: float) -> float:
    """Exponential backoff with full jitter: uniform in [0, min(cap, base * 2^retries)]."""
    return random.uniform(0, min(cap, base * 2**retries))  # noqa: S311 - jitter, not crypto


@app.task(name="corral.provision", bind=True, max_retries=None)
def provision(self: Task, item_id: str) -> str:
    """Provision the sandbox for ``item_id`` (the only argument: no token ever travels here)."""
    rt = runtime.current()
    settings = rt.settings
    retries = self.request.retries or 0
    actor = f"worker:{self.request.hostname or 'local'}"
    try:
        outcome = provision_item(
            rt, item_id, actor=actor, final_attempt=retries >= settings.provision_max_retries
        )
    except RetryLater as exc:
        delay = backoff_s(
            retries, base=settings.provision_backoff_s, cap=settings.provision_backoff_max_s
        )
        log.warning(
            "transient provider error, retrying",
            extra={"work_item_id": item_id, "code": exc.code, "retry_in_s": round(delay, 2)},
        )
        raise self.retry(countdown=delay, exc=exc) from exc
    if outcome is Outcome.FAILED:
        app.send_task("corral.redrive")  # its slot is free again
    return outcome.value


@app.task(name="corral.terminate", bind=True, max_retries=10)
def terminate(self: Task, sandbox_id: str, reason: str) -> bool:
    """End ``sandbox_id`` for ``reason`` (a :class:`TerminationReason` value); safe to deliver
    more than once."""
    try:
        outcome = end_sandbox(
            runtime.current(), sandbox_id, reason=TerminationReason(reason), actor="maintenance"
        )
    except TransientProviderError as exc:
        raise self.retry(countdown=backoff_s(self.request.retries or 0, base=1, cap=60)) from exc
    follow_up(outcome)
    return outcome.ended


def follow_up(outcome: Ended) -> None:
    """After a sandbox ended: route its item again if it was requeued; free its slot."""
    if outcome.requeued:
        app.send_task("corral.route", args=[outcome.requeued])
    if outcome.ended:
        app.send_task("corral.redrive")


@app.task(name="corral.redrive")
def redrive_task() -> int:
    """Route waiting and stranded items; re-send lost provision tasks."""
    report = redrive(runtime.current(), actor="maintenance")
    for outcome in report.routed:
        enqueue(outcome)
    for item_id, queue in report.resend:
        send_provision(item_id, queue)
    return len(report.routed) + len(report.resend)


@app.task(name="corral.reaper.sweep")
def reaper_sweep() -> dict[str, object]:
    """End stale, orphaned and gone sandboxes; write the cost events still owed."""
    rt = runtime.current()
    report = sweep(rt, sweep_lock(rt.settings))
    for item_id in report.requeued:
        app.send_task("corral.route", args=[item_id])
    if report.ended:
        app.send_task("corral.redrive")
    return report.summary()
