"""Prometheus metrics of the control plane (DESIGN §8).

Counters live in the process that does the work (the maintenance worker for the reaper and
the ledger); each process exposes its own registry.
"""

from __future__ import annotations

from prometheus_client import Counter

from shared.models import CostEvent

SANDBOXES_REAPED = Counter(
    "corral_sandboxes_reaped",
    "Sandboxes the reaper ended, by termination reason.",
    ["reason"],
)
COST_EVENTS = Counter(
    "corral_cost_events",
    "Cost events written, by provider and billing model.",
    ["provider", "billing_model"],
)
COST_MICROS = Counter(
    "corral_cost_micros",
    "Sum of the cost events written, in micro-units of the rate cards' currency.",
    ["provider", "billing_model"],
)
COST_SECONDS = Counter(
    "corral_cost_seconds",
    "Sandbox seconds billed, by provider and billing model.",
    ["provider", "billing_model"],
)


def record_cost_event(event: CostEvent) -> None:
    labels = {"provider": event.provider_id, "billing_model": event.billing_model}
    COST_EVENTS.labels(**labels).inc()
    COST_MICROS.labels(**labels).inc(event.amount_micros)
    COST_SECONDS.labels(**labels).inc(event.seconds)
