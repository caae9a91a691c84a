"""The contract of an outcome sink: deliver one final record to one outbox row's target."""

from __future__ import annotations

import abc
from collections.abc import Mapping
from typing import Any, ClassVar

from corral.shared.errors import CorralError
from corral.shared.store.outbox import OutboxRow


class OutcomeDeliveryError(CorralError):
    """an outcome could not be delivered"""

    code = "outcome_delivery_failed"


class OutcomeSink(abc.ABC):
    """Delivers the final records of ended work items to the targets of one sink's outbox
    rows (``name``: the rows' ``sink``). Delivery is at least once: a record whose delivery
    failed part of the way is delivered again, whole."""

    name: ClassVar[str]

    def deliver_row(self, row: OutboxRow, record: Mapping[str, Any]) -> None:
        """Deliver ``record`` to ``row``'s target: :meth:`deliver`, for a sink that keeps
        nothing of the row's own (a sink that logs each try overrides it).

        Raises:
            Exception: as :meth:`deliver`.
        """
        self.deliver(row.target, record)

    @abc.abstractmethod
    def deliver(self, target: Mapping[str, Any], record: Mapping[str, Any]) -> None:
        """Deliver ``record`` to ``target``.

        Raises:
            Exception: any, the delivery failed: the row is tried again later (its type
                name and message are kept on the row, so none may carry a secret).
        """
