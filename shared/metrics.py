"""Prometheus metrics of the control plane (docs/architecture.md §10).

Counters and histograms live in the process that does the work: the api observes claims
(and with them both dispatch latencies), provider workers their provisions, the maintenance
worker the reaper and the ledger. Each process serves its own registry (the api on
``/metrics``, workers on ``--metrics-port``); the api adds gauges read from the database
(corral.scheduler.api.metrics), which see what every process did.
"""

from __future__ import annotations

from prometheus_client import Counter, Histogram

from corral.shared.store.models import CostEvent

SANDBOXES_REAPED = Counter(
    "corral_sandboxes_reaped",
    "Sandboxes the reaper ended, by termination reason.",
    ["reason"],
)
BUDGET_THRESHOLDS_CROSSED = Counter(
    "corral_budget_threshold_crossings",
    "Budget thresholds (percentages of a cap) a spend reached, each counted once per period.",
    ["threshold", "period", "set_by", "org"],
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


# Latency buckets from 50 ms to 30 min: a local sandbox starts in well under a second, a
# cloud one pulling an image can take minutes.
_LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800)

DISPATCH_TO_PROVISIONED = Histogram(
    "corral_dispatch_to_provisioned_seconds",
    "From a work item's intake to its sandbox being up (observed when its runner claims).",
    ["provider"],
    buckets=_LATENCY_BUCKETS,
)
PROVISIONED_TO_CLAIMED = Histogram(
    "corral_provisioned_to_claimed_seconds",
    "From a sandbox being recorded as made to its runner claiming the work.",
    ["provider"],
    buckets=_LATENCY_BUCKETS,
)
PROVISION_SECONDS = Histogram(
    "corral_provision_seconds",
    "How long a provider's provision() call took, by provider and outcome.",
    ["provider", "outcome"],
    buckets=_LATENCY_BUCKETS,
)
WARM_BOUND = Counter(
    "corral_warm_bound",
    "Work items given a waiting warm sandbox instead of a new one, by provider.",
    ["provider"],
)
PROVISION_PACED = Counter(
    "corral_provision_paced",
    "Creates the provider's pace held back (the task sent again for later), by provider and "
    "reason: rate, in_flight, or refused (the provider answered a rate limit).",
    ["provider", "reason"],
)
PROVISION_ERRORS = Counter(
    "corral_provision_errors",
    "Provision attempts that failed, by provider and error code (transient ones included).",
    ["provider", "code"],
)
