"""The queue table: which queue each task travels on.

- ``dispatch``: consumed by ``corral scheduler``; tasks ``corral.dispatch``, ``corral.route``.
- ``provision.<provider>`` and ``provision.<provider>.gpu``: consumed by
  ``corral worker --provider <provider>``; task ``corral.provision``.
- ``maintenance``: consumed by ``corral worker --maintenance``; tasks ``corral.terminate``,
  ``corral.terminate_many``, ``corral.redrive``, ``corral.reaper.sweep``.

The provision queue is a pure function of the chosen pool's provider and whether the item
needs a GPU, so that each provider's workers scale on their own backlog.

Every queue is bound to the direct exchange ``corral`` with its own name as routing key, so
one publish reaches one queue. ``dispatch`` was the exchange (and routing key) every queue
was bound to before; it is named here only to take those bindings away.
"""

from __future__ import annotations

DISPATCH_QUEUE = "dispatch"
MAINTENANCE_QUEUE = "maintenance"
PROVISION_PREFIX = "provision."
EXCHANGE = "corral"
LEGACY_EXCHANGE = "dispatch"


def provision_queue(provider_id: str, *, gpu: bool) -> str:
    """``provision.<provider_id>``, plus ``.gpu`` for work that needs a GPU."""
    return f"{PROVISION_PREFIX}{provider_id}{'.gpu' if gpu else ''}"


def provider_of_queue(queue: str | None) -> str | None:
    """The provider whose workers consume ``queue`` (:func:`provision_queue`'s inverse);
    None for any other queue."""
    if not queue or not queue.startswith(PROVISION_PREFIX):
        return None
    return queue.removeprefix(PROVISION_PREFIX).removesuffix(".gpu") or None


def provider_queues(provider_id: str) -> list[str]:
    """The queues one provider's workers consume."""
    return [provision_queue(provider_id, gpu=False), provision_queue(provider_id, gpu=True)]
