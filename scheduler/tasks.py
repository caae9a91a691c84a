"""The scheduler's Celery tasks, consumed by ``corral scheduler`` on queue ``dispatch``."""

from __future__ import annotations

import logging
from typing import Any

from celery import Task
from pydantic import ValidationError
from sqlalchemy.exc import DBAPIError

from scheduler.intake import RouteOutcome, accept, record_invalid, route_item
from shared import runtime
from shared.celery_app import app
from shared.messages import DispatchRequest

log = logging.getLogger(__name__)
ACTOR = "scheduler"


@app.task(
    name="corral.dispatch", bind=True, autoretry_for=(DBAPIError,), retry_backoff=True,
    retry_backoff_max=60, max_retries=None,
)  # fmt: skip
def dispatch(self: Task, *args: Any, **kwargs: Any) -> str:
    """Validate, persist and route one dispatch message (the message is the one argument).

    Any other call shape is recorded as an invalid message too: a malformed message becomes
    a work item in ``dispatch_error``, never a crashed worker or a silent drop. While the
    database is unreachable the task retries with backoff rather than dropping the message.
    A message without an idempotency key gets the Celery task id as its key, so a
    redelivery of the same message does not create a second item.
    """
    db = runtime.current().db
    if len(args) == 1 and not kwargs:
        message: Any = args[0]
    elif kwargs and not args:
        message = kwargs  # sent as keyword arguments: the fields themselves
    else:
        item_id = record_invalid(
            db, None, "corral.dispatch takes exactly one argument, the message", actor=ACTOR
        )
        return item_id
    try:
        request = DispatchRequest.model_validate(message)
    except ValidationError as exc:
        item_id = record_invalid(db, message, exc, actor=ACTOR)
        log.warning("invalid dispatch message recorded", extra={"work_item_id": item_id})
        return item_id
    if request.idempotency_key is None and self.request.id:
        request = request.model_copy(update={"idempotency_key": f"celery:{self.request.id}"})
    accepted = accept(db, request, actor=ACTOR)
    if accepted.created:
        enqueue(route_item(db, accepted.item_id, actor=ACTOR))
    return accepted.item_id


@app.task(name="corral.route")
def route_task(item_id: str) -> str:
    """Route an item the api accepted."""
    outcome = route_item(runtime.current().db, item_id, actor=ACTOR)
    enqueue(outcome)
    return outcome.state.value


def enqueue(outcome: RouteOutcome) -> None:
    """Send the provision task a routing decision asks for (after its commit)."""
    if outcome.queue is None:
        return
    send_provision(outcome.item_id, outcome.queue)
    log.info("routed", extra={"work_item_id": outcome.item_id, "queue": outcome.queue})


def send_provision(item_id: str, queue: str) -> None:
    """``corral.provision`` for ``item_id`` on its capability queue; the id is all it carries."""
    app.send_task("corral.provision", args=[item_id], queue=queue)
