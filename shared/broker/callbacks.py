"""What a Celery sender of ``corral.dispatch`` is owed: its result, and its callbacks.

A message's ``link`` and ``link_error`` signatures (protocol 2: the ``callbacks`` and
``errbacks`` of the body's embed; protocol 1: of the body) are read here into a
:class:`Reply`, which the item keeps until it ends (corral.shared.store.outbox). corral never
runs a callback: when the item ends it sends it, as a task message, to the deployment's
broker, as Celery's worker does for a task it ran (``link`` with the final record
prepended to its arguments, ``link_error`` with the task id; an ``immutable`` one with its
own arguments alone).

Every signature comes from a sender corral does not trust, so a callback is refused (the
message becomes an ``invalid_message`` item) unless it is a plain task call: a task name,
JSON arguments and keyword arguments, at most a ``queue`` option; no chain, group or chord;
at most :data:`MAX_CALLBACKS` of each kind, each at most :data:`MAX_CALLBACK_BYTES` of JSON.
It may not name a task of corral's (``corral.*``) or of Celery's own (``celery.*``), nor a
queue corral's processes or Celery's control plane read; and its queue must be one the
deployment lets callbacks go to (``CORRAL_CALLBACK_QUEUES``, globs; ``celery`` by default):
a sender must not get corral to send, later and with corral's broker credentials, what its
own credentials may not (to the workers of another system sharing the broker, say).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from fnmatch import fnmatchcase
from typing import Any

from corral.shared.broker.queues import DISPATCH_QUEUE, MAINTENANCE_QUEUE, PROVISION_PREFIX
from corral.shared.errors import CorralError
from corral.shared.text import storable_line

MAX_CALLBACKS = 4
MAX_CALLBACK_BYTES = 16 * 1024
DEFAULT_CALLBACK_QUEUE = "celery"  # Celery's task_default_queue: where a plain worker reads
# The queues callbacks may go to unless the deployment says otherwise (CORRAL_CALLBACK_QUEUES).
DEFAULT_ALLOWED_QUEUES: tuple[str, ...] = (DEFAULT_CALLBACK_QUEUE,)
# The signature keys Celery writes (celery.canvas.Signature); any other is refused.
_SIGNATURE_KEYS = frozenset(
    {"task", "args", "kwargs", "options", "subtask_type", "immutable", "chord_size"}
)
_TASK_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_.:-]{0,199}")
_QUEUE_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.:-]{0,199}")
_REFUSED_TASK_PREFIXES = ("corral.", "celery.")
# corral's queues, and Celery's events and remote-control queues.
_REFUSED_QUEUES = (DISPATCH_QUEUE, MAINTENANCE_QUEUE, "corral", "celeryev")
_REFUSED_QUEUE_PREFIXES = (PROVISION_PREFIX, "corral.", "celeryev.")


class CallbackRefusedError(CorralError, ValueError):
    """a link or link_error callback of the message is refused"""

    code = "invalid_message"


@dataclass(frozen=True)
class Callback:
    """One callback signature as corral sends it: a task on a queue, with its arguments."""

    task: str
    args: tuple[Any, ...] = ()
    kwargs: Mapping[str, Any] = field(default_factory=dict)
    queue: str = DEFAULT_CALLBACK_QUEUE
    immutable: bool = False  # Celery's: the parent's result is not prepended to its args

    def call_args(self, first: Any) -> list[Any]:
        """Its positional arguments, ``first`` (the record, or the task id) prepended unless
        it is immutable."""
        return list(self.args) if self.immutable else [first, *self.args]

    def as_json(self) -> dict[str, Any]:
        return {
            "task": self.task,
            "args": list(self.args),
            "kwargs": dict(self.kwargs),
            "queue": self.queue,
            "immutable": self.immutable,
        }


@dataclass(frozen=True)
class Reply:
    """What one message is owed when its item ends: its result under ``task_id``, and its
    callbacks (``link`` on success, ``link_error`` otherwise)."""

    task_id: str
    link: tuple[Callback, ...] = ()
    link_error: tuple[Callback, ...] = ()

    def as_json(self) -> dict[str, Any]:
        return {
            "task_id": self.task_id,
            "link": [callback.as_json() for callback in self.link],
            "link_error": [callback.as_json() for callback in self.link_error],
        }

    @classmethod
    def from_json(cls, stored: Mapping[str, Any]) -> Reply:
        """A reply as :meth:`as_json` stored it."""

        def callbacks(kind: str) -> tuple[Callback, ...]:
            return tuple(
                Callback(
                    task=c["task"],
                    args=tuple(c.get("args") or ()),
                    kwargs=dict(c.get("kwargs") or {}),
                    queue=c.get("queue") or DEFAULT_CALLBACK_QUEUE,
                    immutable=bool(c.get("immutable")),
                )
                for c in stored.get(kind) or ()
            )

        return cls(str(stored["task_id"]), callbacks("link"), callbacks("link_error"))


def read_reply(
    task_id: str,
    callbacks: Any,
    errbacks: Any,
    *,
    allowed: Sequence[str] = DEFAULT_ALLOWED_QUEUES,
) -> Reply:
    """The reply owed to the message ``task_id`` whose embed named ``callbacks`` (link) and
    ``errbacks`` (link_error), as the sender wrote them; each callback's queue must match
    one of the ``allowed`` globs (the deployment's ``CORRAL_CALLBACK_QUEUES``).

    Raises:
        CallbackRefusedError: a callback is not a plain task call corral may send; the
            message names which (``link[0]: ...``), never a value of it.
    """
    return Reply(
        task_id,
        _signatures("link", callbacks, allowed),
        _signatures("link_error", errbacks, allowed),
    )


def _signatures(kind: str, value: Any, allowed: Sequence[str]) -> tuple[Callback, ...]:
    if value is None:
        return ()
    if not isinstance(value, list):
        raise CallbackRefusedError(f"{kind}: a list of task signatures is expected")
    if len(value) > MAX_CALLBACKS:
        raise CallbackRefusedError(f"{kind}: at most {MAX_CALLBACKS} callbacks are sent")
    return tuple(
        _signature(f"{kind}[{number}]", entry, allowed) for number, entry in enumerate(value)
    )


def _signature(where: str, value: Any, allowed: Sequence[str]) -> Callback:
    if not isinstance(value, dict) or not set(value) <= _SIGNATURE_KEYS:
        raise CallbackRefusedError(f"{where}: not a task signature (task, args, kwargs, options)")
    if len(json.dumps(value, separators=(",", ":"))) > MAX_CALLBACK_BYTES:
        raise CallbackRefusedError(f"{where}: over {MAX_CALLBACK_BYTES} bytes of JSON")
    if value.get("subtask_type") is not None or value.get("chord_size") is not None:
        raise CallbackRefusedError(f"{where}: only a plain task is sent (no chain, group, chord)")
    task, args, kwargs = value.get("task"), value.get("args", []), value.get("kwargs", {})
    if not isinstance(task, str) or not _TASK_NAME.fullmatch(task):
        raise CallbackRefusedError(f"{where}: task is not a task name")
    if task.lower().startswith(_REFUSED_TASK_PREFIXES):
        raise CallbackRefusedError(f"{where}: a callback may not name corral's or Celery's tasks")
    if not isinstance(args, list) or not isinstance(kwargs, dict):
        raise CallbackRefusedError(f"{where}: args is a list and kwargs an object")
    if not all(isinstance(name, str) for name in kwargs):
        raise CallbackRefusedError(f"{where}: kwargs' names are strings")
    immutable = value.get("immutable", False)
    if not isinstance(immutable, bool):
        raise CallbackRefusedError(f"{where}: immutable is true or false")
    queue = _queue(where, value.get("options"), allowed)
    return Callback(task, tuple(args), kwargs, queue, immutable)


def _queue(where: str, options: Any, allowed: Sequence[str]) -> str:
    options = {} if options is None else options
    if not isinstance(options, dict) or not set(options) <= {"queue"}:
        raise CallbackRefusedError(f"{where}: the one option corral honours is queue")
    queue = options.get("queue", DEFAULT_CALLBACK_QUEUE)
    if not isinstance(queue, str) or not _QUEUE_NAME.fullmatch(queue):
        raise CallbackRefusedError(f"{where}: options.queue is not a queue name")
    lowered = queue.lower()
    if (
        lowered in _REFUSED_QUEUES
        or lowered.startswith(_REFUSED_QUEUE_PREFIXES)
        or "pidbox" in lowered
    ):
        raise CallbackRefusedError(f"{where}: a callback may not go to a queue of corral's")
    if not any(fnmatchcase(queue, pattern) for pattern in allowed):
        raise CallbackRefusedError(
            f"{where}: callbacks may go only to the queues CORRAL_CALLBACK_QUEUES allows; "
            "ask the deployment to allow this one, or leave options.queue out"
            if allowed
            else f"{where}: this deployment sends no callbacks (CORRAL_CALLBACK_QUEUES is empty)"
        )
    return queue


def owed(
    task_id: Any,
    callbacks: Any,
    errbacks: Any,
    *,
    allowed: Sequence[str] = DEFAULT_ALLOWED_QUEUES,
) -> tuple[Reply | None, str | None]:
    """The reply a message is owed, and what is wrong with its callbacks (None: nothing).

    No reply for a task id that cannot be kept (one line of printable text, at most 255
    characters: :func:`~corral.shared.text.storable_line`); a reply without
    callbacks when they are refused (its result is still stored: the refusal is the item's
    ``invalid_message``).
    """
    kept = storable_line(task_id)
    if kept is None:
        return None, None
    try:
        return read_reply(kept, callbacks, errbacks, allowed=allowed), None
    except CallbackRefusedError as exc:
        return Reply(kept), exc.message


def stored_replies(replies: Sequence[Reply]) -> list[dict[str, Any]] | None:
    """``replies`` as a work item's ``replies`` column holds them (None: none)."""
    return [reply.as_json() for reply in replies] or None
