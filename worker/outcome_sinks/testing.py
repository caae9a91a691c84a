"""An in-memory outcome sink for tests: it records each delivery, and fails when told to."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from corral.worker.outcome_sinks.base import OutcomeDeliveryError, OutcomeSink


class RecordingSink(OutcomeSink):
    """Records ``(target, record)`` for each delivery; fails the next ``failures`` ones."""

    name = "celery"

    def __init__(self, *, failures: int = 0) -> None:
        self.delivered: list[tuple[dict[str, Any], dict[str, Any]]] = []
        self.failures = failures

    def deliver(self, target: Mapping[str, Any], record: Mapping[str, Any]) -> None:
        if self.failures > 0:
            self.failures -= 1
            raise OutcomeDeliveryError("the in-memory sink was told to fail")
        self.delivered.append((dict(target), dict(record)))
