"""The scheduler's Celery tasks, consumed by ``corral scheduler`` on queue ``dispatch``."""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

from celery import Task
from celery.worker.request import Request

from corral.scheduler.intake import route_item, take_dispatch
from corral.scheduler.publish import enqueue
from corral.shared import runtime
from corral.shared.broker.celery_app import app

ACTOR = "scheduler"

# -- what task events and inspection show of a dispatch message ----------------------------
#
# A dispatch message may carry secrets (env values, commands), and Celery copies a task's
# arguments into its events ("task-sent", "task-received"), into `celery inspect` answers
# and into failure logs, from where Flower and any other event consumer would show them.
# For corral.dispatch they are replaced by a summary of ids, on the worker (upstream
# senders do not set `argsrepr`) and wherever corral's code sends or retries the task.

SUMMARY_FIELDS = ("org", "project", "profile", "work", "idempotency_key")  # work: its kind
_SAFE_VALUE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:-]{0,127}")  # ids, `celery:<task id>`
_SUMMARY_VALUE = r"[A-Za-z0-9._:?-]+"
# Only the names dispatch_summary writes: an upstream argsrepr like `api_key=sk-...` is no
# summary, however it is shaped.
_SUMMARY_KEY = (
    "(?:" + "|".join((*SUMMARY_FIELDS, "invalid", "positional", "keyword", "type", "fields")) + ")"
)
SUMMARY = re.compile(rf"{_SUMMARY_KEY}={_SUMMARY_VALUE}(?: {_SUMMARY_KEY}={_SUMMARY_VALUE})*")
"""What :func:`dispatch_summary` writes; ``corral flower`` drops dispatch arguments that
are anything else."""
KWARGSREPR = "{}"  # the summary describes the whole call, keyword fields included


def dispatch_summary(args: Sequence[Any], kwargs: Mapping[str, Any]) -> str:
    """The ids of a ``corral.dispatch`` call, as ``org=acme project=web ...``.

    Only identifier-shaped values are shown (anything else becomes ``?``), so a secret put
    in the wrong field does not come through either; a call of the wrong shape is
    described by its shape alone.
    """
    if len(args) == 1 and not kwargs:
        message = args[0]
    elif kwargs and not args:
        message = kwargs
    else:
        return f"invalid=call positional={len(args)} keyword={len(kwargs)}"
    if not isinstance(message, Mapping):
        return f"invalid=message type={type(message).__name__}"
    fields = dict(message)
    if isinstance(fields.get("work"), Mapping):
        fields["work"] = fields["work"].get("kind")
    parts = [f"{name}={_safe(fields[name])}" for name in SUMMARY_FIELDS if name in fields]
    return " ".join(parts) or "invalid=message fields=none"


def _safe(value: Any) -> str:
    return value if isinstance(value, str) and _SAFE_VALUE.fullmatch(value) else "?"


class DispatchTaskRequest(Request):  # type: ignore[misc]  # celery ships no types
    """A received ``corral.dispatch`` whose ``argsrepr`` is the summary, whoever sent it.

    Celery takes ``argsrepr``/``kwargsrepr`` from the message headers, which the sender
    writes (``repr`` of the arguments, secrets and all, unless it set them itself); the
    worker puts them in its "task-received" event, its log context and failure logs (read
    from the request dict). ``info()`` backs ``inspect active/reserved/scheduled`` (Flower's
    worker page) and would return the arguments themselves, so it always gives the reprs.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._argsrepr = dispatch_summary(self.args, self.kwargs)
        self._kwargsrepr = KWARGSREPR
        self.request_dict["argsrepr"] = self._argsrepr
        self.request_dict["kwargsrepr"] = self._kwargsrepr

    def info(self, safe: bool = False) -> dict[str, Any]:
        info: dict[str, Any] = super().info(safe=True)
        return info


class DispatchTask(Task):  # type: ignore[misc]  # celery ships no types
    """``corral.dispatch``: received through :class:`DispatchTaskRequest`; sent (by
    ``delay``, ``apply_async`` and the retries of ``autoretry_for``) with the summary as
    ``argsrepr``, so its "task-sent" event and message headers hold ids only too."""

    Request = DispatchTaskRequest

    def apply_async(
        self,
        args: Sequence[Any] | None = None,
        kwargs: Mapping[str, Any] | None = None,
        *rest: Any,
        **options: Any,
    ) -> Any:
        options["argsrepr"] = dispatch_summary(args or (), kwargs or {})
        options["kwargsrepr"] = KWARGSREPR
        return super().apply_async(args, kwargs, *rest, **options)


@app.task(name="corral.dispatch", base=DispatchTask, bind=True)
def dispatch(self: Task, *args: Any, **kwargs: Any) -> str:
    """Validate, persist and route one dispatch message (the message is the one argument).

    ``corral scheduler`` reads the ``dispatch`` queue itself, in batches
    (:mod:`corral.scheduler.consumer`); this task is what senders address, and runs the same
    one-message path should a Celery worker ever consume the queue.
    """
    rt = runtime.current()
    callbacks, errbacks = self.request.callbacks, self.request.errbacks
    # The message's link and link_error are the item's to answer, when it ends: Celery
    # must not call them now, with the item's id.
    self.request.callbacks = self.request.errbacks = None
    return take_dispatch(
        rt.db,
        args,
        kwargs,
        task_id=self.request.id,
        actor=ACTOR,
        settings=rt.settings,
        callbacks=callbacks,
        errbacks=errbacks,
    )


@app.task(name="corral.route")
def route_task(item_id: str) -> str:
    """Route an item the api accepted."""
    rt = runtime.current()
    outcome = route_item(rt.db, item_id, actor=ACTOR, settings=rt.settings)
    enqueue(outcome)
    return outcome.state.value
