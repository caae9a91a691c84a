"""The contract of an outcome sink: deliver one final record to one outbox row's target."""

from __future__ import annotations

import abc
from collections.abc import Mapping
from typing import Any, ClassVar

from corral.shared.errors import CorralError


class OutcomeDeliveryError(CorralError):
    """an outcome could not be delivered"""

    code = "outcome_delivery_failed"


class OutcomeSink(abc.ABC):
    """Delivers the final records of ended work items to the targets of one sink's outbox
    rows (``name``: the rows' ``sink``). Delivery is at least once: a record whose delivery
    failed part of the way is delivered again, whole."""

    name: ClassVar[str]

    @abc.abstractmethod
    def deliver(self, target: Mapping[str, Any], record: Mapping[str, Any]) -> None:
        """Deliver ``record`` to ``target``.

        Raises:
            Exception: any, the delivery failed: the row is tried again later (its type
                name and message are kept on the row, so none may carry a secret).
        """
