"""What a Celery worker needs of a task message beyond
:func:`corral.shared.broker.envelope.read_task`.

``read_task`` says a message is a task call: a task name, a list of arguments and an object
of keyword arguments. A Celery worker reads more than that, and some of it in places where
a bad value does not fail the message but the worker: a ``timelimit`` header that is not a
pair of numbers raises after the task was reserved (its slot is never freed), an ``embed``
that is not an object raises inside the pool thread (the message is never acknowledged),
and arguments that do not fit the task's signature fail it on every delivery. The checks
here run before Celery sees the message, so such a message is a dead letter instead.
Nothing here quotes a value from the message: only field and parameter names.
"""

from __future__ import annotations

import inspect
import math
import typing
from collections.abc import Callable, Mapping
from typing import Any

from corral.shared.broker.envelope import MalformedMessageError, TaskCall

Check = Callable[[Any], bool]


def _optional(*types: type) -> Check:
    """None, or a value of one of ``types`` (a bool is an int only where bool is listed)."""

    def check(value: Any) -> bool:
        if value is None:
            return True
        if isinstance(value, bool):
            return bool in types
        return isinstance(value, types)

    return check


def _limit(value: Any) -> bool:
    return value is None or (
        isinstance(value, int | float)
        and not isinstance(value, bool)
        and math.isfinite(value)
        and value >= 0
    )


def _timelimit(value: Any) -> bool:
    """None, or Celery's ``[soft, hard]`` pair of seconds (each may be None)."""
    return value is None or (
        isinstance(value, list | tuple) and len(value) == 2 and all(map(_limit, value))
    )


def _strings(value: Any) -> bool:
    return value is None or (isinstance(value, list) and all(isinstance(v, str) for v in value))


_TEXT, _NUMBER, _FLAG = _optional(str), _optional(int), _optional(bool)

# The protocol 2 headers a Celery 5 worker reads, and what each must be. Others are ignored.
_TEXT_HEADERS = [
    "lang",
    "root_id",
    "parent_id",
    "group",
    "shadow",
    "eta",
    "expires",
    "argsrepr",
    "kwargsrepr",
    "origin",
    "compression",
]
HEADER_CHECKS: dict[str, Check] = {
    **dict.fromkeys(_TEXT_HEADERS, _TEXT),
    **dict.fromkeys(("retries", "group_index", "replaced_task_nesting"), _NUMBER),
    **dict.fromkeys(("ignore_result", "redelivered"), _FLAG),
    "timelimit": _timelimit,
    "stamped_headers": _strings,
    "stamps": _optional(dict),
}

# The fields of a protocol 1 body besides task, id, args and kwargs.
PROTOCOL_1_CHECKS: dict[str, Check] = {
    **dict.fromkeys(("eta", "expires", "taskset"), _TEXT),
    "retries": _NUMBER,
    "utc": _FLAG,
    "timelimit": _timelimit,
    "chord": _optional(dict),
    **dict.fromkeys(("callbacks", "errbacks"), _optional(list)),
}

# A protocol 2 body's third element, which the pool spreads into the task's request.
EMBED_CHECKS: dict[str, Check] = {
    **dict.fromkeys(("callbacks", "errbacks", "chain"), _optional(list)),
    "chord": _optional(dict),
}


def check_celery_message(call: TaskCall, headers: Mapping[str, Any], body: Any) -> None:
    """Check the headers and the decoded ``body`` of ``call``'s message as a Celery worker
    reads them.

    Raises:
        MalformedMessageError: ``bad_headers`` or ``bad_call_shape``, naming the field.
    """
    try:
        if call.protocol == 1:
            _check_fields(body, PROTOCOL_1_CHECKS, reason="bad_call_shape", what="body field")
            return
        if call.id is None:
            raise MalformedMessageError("bad_headers", "the message has no id header")
        _check_fields(headers, HEADER_CHECKS, reason="bad_headers", what="header")
        if not isinstance(body, list) or len(body) != 3:
            raise MalformedMessageError(
                "bad_call_shape", "a Celery worker reads the body as [args, kwargs, embed]"
            )
        embed = body[2]
        if embed is not None and not isinstance(embed, dict):
            raise MalformedMessageError("bad_call_shape", "the body's embed is not an object")
        unknown = sorted(set(embed or {}) - set(EMBED_CHECKS))
        if unknown:
            raise MalformedMessageError(
                "bad_call_shape",
                f"the body's embed has {len(unknown)} field(s) other than "
                f"{', '.join(EMBED_CHECKS)}",
            )
        _check_fields(embed or {}, EMBED_CHECKS, reason="bad_call_shape", what="embed field")
    except MalformedMessageError as exc:
        raise MalformedMessageError(
            exc.reason, exc.message, task_name=call.name, task_id=call.id
        ) from exc


def _check_fields(fields: Any, checks: Mapping[str, Check], *, reason: str, what: str) -> None:
    if not isinstance(fields, Mapping):
        raise MalformedMessageError(reason, f"the message's {what}s are not an object")
    for name, check in checks.items():
        if name in fields and not check(fields[name]):
            raise MalformedMessageError(reason, f"the {what} {name} is not what Celery reads")


# -- arguments against the task's signature ---------------------------------------------------

_SCALARS = (str, int, float, bool)


def _fits(value: Any, expected: type) -> bool:
    if isinstance(value, bool):
        return expected is bool
    if expected is float:
        return isinstance(value, int | float)
    return isinstance(value, expected)


class TaskSignatures:
    """Each registered task's signature and parameter types, read once."""

    def __init__(self, tasks: Mapping[str, Any]) -> None:
        self._tasks = tasks
        self._read: dict[str, tuple[inspect.Signature, dict[str, Any]] | None] = {}

    def check(self, call: TaskCall) -> None:
        """Check ``call`` names a registered task and fits its signature: every required
        parameter given, none unknown, and a ``str``/``int``/``float``/``bool`` parameter
        given a value of that type.

        Raises:
            MalformedMessageError: ``unknown_task`` or ``bad_arguments``.
        """
        known = {"task_name": call.name, "task_id": call.id}
        if call.name not in self._tasks:
            raise MalformedMessageError(
                "unknown_task", "no task of that name is registered in this worker", **known
            )
        read = self._signature(call.name)
        if read is None:
            return
        signature, hints = read
        try:
            bound = signature.bind(*call.args, **call.kwargs)
        except TypeError as exc:
            raise MalformedMessageError(
                "bad_arguments",
                f"the arguments do not fit {call.name}({', '.join(signature.parameters)})",
                **known,
            ) from exc
        for name, value in bound.arguments.items():
            expected = hints.get(name)
            if expected in _SCALARS and not _fits(value, expected):
                raise MalformedMessageError(
                    "bad_arguments",
                    f"argument {name} of {call.name} is not a {expected.__name__}",
                    **known,
                )

    def _signature(self, name: str) -> tuple[inspect.Signature, dict[str, Any]] | None:
        if name not in self._read:
            run = getattr(self._tasks[name], "run", None)
            try:
                signature = inspect.signature(run)  # type: ignore[arg-type]
                hints = typing.get_type_hints(run)
            except (TypeError, ValueError, NameError):
                self._read[name] = None  # nothing to check it against
            else:
                self._read[name] = (signature, hints)
        return self._read[name]
