"""The Celery result of a ``corral.dispatch`` message: its state, and what ``get()`` gives.

When the deployment names a result backend, the final record of the item a message made
(corral.shared.store.final_records) is stored under the message's task id, as a Celery
worker stores a task's result:

- the item ``succeeded``: state ``SUCCESS``, the record as the result, so
  ``AsyncResult(task_id).get()`` returns it;
- it ``failed``, was ``cancelled`` or ended as a ``dispatch_error``: state ``FAILURE`` with
  an exception whose one argument is the record (:class:`ItemFailedError`,
  :class:`ItemCancelledError`, :class:`ItemDispatchError`), so ``get()`` raises it, as it
  raises a failed task's exception, and ``get(propagate=False)`` returns it.

Results travel as JSON, never pickle: Celery stores an exception as its type name, module
and arguments, and a reader rebuilds it. A reader that imported this module gets these
classes; any other (a sender with Celery alone) gets a class of the same name that Celery
makes on the fly, deriving from ``Exception``: ``exc.args[0]`` is the record either way.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

from corral.shared.errors import CorralError

SUCCESS, FAILURE = "SUCCESS", "FAILURE"  # Celery's states (celery.states)


class ItemOutcomeError(CorralError):
    """a work item did not succeed"""

    code: ClassVar[str] = "item_outcome"

    def __init__(self, record: Mapping[str, Any] | None = None) -> None:
        self.record = dict(record or {})
        error = self.record.get("error") or {}
        super().__init__(
            f"work item {self.record.get('id', '?')} {self.record.get('state', 'ended')}: "
            f"{error.get('code')}: {error.get('message')}"
        )
        self.args = (self.record,)  # what Celery stores, and rebuilds the exception from


class ItemFailedError(ItemOutcomeError):
    """a work item failed"""

    code = "item_failed"


class ItemCancelledError(ItemOutcomeError):
    """a work item was cancelled"""

    code = "item_cancelled"


class ItemDispatchError(ItemOutcomeError):
    """a dispatch message was refused: its item ended as a dispatch error"""

    code = "item_dispatch_error"


_FAILURES: Mapping[str, type[ItemOutcomeError]] = {
    "failed": ItemFailedError,
    "cancelled": ItemCancelledError,
    "dispatch_error": ItemDispatchError,
}


def celery_result(record: Mapping[str, Any]) -> tuple[str, Any]:
    """The Celery state and result value of a final ``record``.

    Raises:
        ValueError: the record's state is not a final one.
    """
    state = record.get("state")
    if state == "succeeded":
        return SUCCESS, dict(record)
    failure = _FAILURES.get(str(state))
    if failure is None:
        raise ValueError(f"a work item in state {state!r} has no final result")
    return FAILURE, failure(record)
