"""The ``celery`` sink: a message's result in the result backend, and its callbacks sent.

For each reply (corral.shared.broker.callbacks.Reply) the final record is stored under the
reply's task id with Celery's own backend (``store_result``, as a worker stores a task's
result: corral.shared.broker.results says in which state), then the reply's ``link``
callbacks (the item succeeded) or ``link_error`` ones (it did not) are sent as tasks on the
deployment's broker, each to its queue. corral runs none of them.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from celery import Celery
from celery.app.backends import by_url

from corral.shared.broker.callbacks import Reply
from corral.shared.broker.results import SUCCESS, celery_result
from corral.worker.outcome_sinks.base import OutcomeSink


class CeleryResultSink(OutcomeSink):
    """Stores results in ``backend`` and sends callbacks through ``app``'s broker."""

    name = "celery"

    def __init__(self, app: Celery, backend: Any) -> None:
        self._app = app
        self._backend = backend

    @classmethod
    def from_url(cls, app: Celery, url: str) -> CeleryResultSink:
        """The sink of the result backend at ``url`` (``CORRAL_RESULT_BACKEND``), built by
        Celery as its ``result_backend`` setting would be, with ``app``'s configuration
        (JSON results, their expiry)."""
        backend_cls, backend_url = by_url(url, app.loader)
        return cls(app, backend_cls(app=app, url=backend_url))

    def deliver(self, target: Mapping[str, Any], record: Mapping[str, Any]) -> None:
        reply = Reply.from_json(target)
        state, value = celery_result(record)
        self._backend.store_result(reply.task_id, value, state)
        succeeded = state == SUCCESS
        first = dict(record) if succeeded else reply.task_id  # as Celery calls each kind
        for callback in reply.link if succeeded else reply.link_error:
            self._app.send_task(
                callback.task,
                args=callback.call_args(first),
                kwargs=dict(callback.kwargs),
                queue=callback.queue,
                parent_id=reply.task_id,
                root_id=reply.task_id,
            )
