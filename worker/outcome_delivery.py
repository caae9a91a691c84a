"""Delivering the outcome outbox: each ended item's record to whoever is owed it.

``corral.outcomes.deliver`` (beat, every ``CORRAL_OUTCOME_INTERVAL_S``, on the maintenance
worker) runs :func:`deliver_due`: it claims the rows due (corral.shared.store.outbox), reads
each item's final record (corral.shared.store.final_records), hands it to the row's sink
(corral.worker.outcome_sinks) and deletes the rows delivered. A record whose item's
sandboxes are not all billed yet waits up to ``CORRAL_OUTCOME_COST_WAIT_S`` for them. A
failed delivery is tried again, backing off exponentially up to 10 minutes, until
``CORRAL_OUTCOME_MAX_ATTEMPTS`` tries: then the row is kept as failed (pruned after 7 days),
counted and logged. At least once: a deliverer that dies after delivering and before
deleting leaves the row to be delivered again once its claim lapses
(``CORRAL_OUTCOME_CLAIM_S``, 120 s: also how long the rows a killed deliverer held wait); a
run gives back the rows it has not reached shortly before its claim ends, so that no row
is delivered by two runs at once however short the claim. A row that carries its
own record (a sandbox's end, a budget's crossing: ``data`` in its target) delivers that.
Each hour the rows given up 7 days ago are pruned, and the webhook delivery log's tries
older than ``CORRAL_WEBHOOK_LOG_KEEP_S``.

Metrics: ``corral_outcome_deliveries_total{sink, result}`` (``delivered``, ``retried``,
``given_up``) and ``corral_outcome_outbox_rows{sink, status}`` (``pending``, ``failed``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta

from prometheus_client import Counter, Gauge

from corral.shared.settings import OutcomeSettings
from corral.shared.store import outbox, webhook_log
from corral.shared.store.db import Database, utcnow
from corral.shared.store.final_records import FinalRecord, final_record
from corral.shared.store.outbox import OutboxRow
from corral.worker.outcome_sinks.base import OutcomeDeliveryError, OutcomeSink

log = logging.getLogger(__name__)

DELIVERIES = Counter(
    "corral_outcome_deliveries",
    "Tries at delivering an ended item's outcome, by sink and result.",
    ["sink", "result"],
)
OUTBOX_ROWS = Gauge(
    "corral_outcome_outbox_rows",
    "Outcomes owed and not delivered, by sink: pending (to be tried) or failed (given up).",
    ["sink", "status"],
)
BATCH = 200  # rows one run claims
# A run starts no delivery this close to the end of its claim (CORRAL_OUTCOME_CLAIM_S): one
# delivery may take 10 s (a webhook's deadline), and it must end while the row is still its.
RESERVE_S = 12.0
COST_POLL_S = 1.0  # a record waiting for its cost is looked at again after this
BACKOFF_MAX_S = 600.0
KEEP_FAILED = timedelta(days=7)
PRUNE_EVERY_S = 3600.0
# The gauge is read again after a run that claimed rows, else at most this often: an idle
# deliverer runs every second and the gauge is scraped every 15 s or so.
OBSERVE_EVERY_S = 10.0
_last_prune = [0.0]  # monotonic time of this process's last prune
_last_observed = [float("-inf")]  # and of its last read of the gauge


@dataclass
class DeliveryReport:
    """What one run did, row ids by what became of them."""

    delivered: list[int] = field(default_factory=list)
    waiting: list[int] = field(default_factory=list)  # for their items' cost
    given_back: list[int] = field(default_factory=list)  # not reached before the claim's end
    retried: list[int] = field(default_factory=list)
    given_up: list[int] = field(default_factory=list)

    def summary(self) -> dict[str, int]:
        return {name: len(ids) for name, ids in vars(self).items()}


def deliver_due(
    db: Database,
    sinks: Mapping[str, OutcomeSink],
    settings: OutcomeSettings,
    *,
    now: datetime | None = None,
    clock: Callable[[], float] = time.monotonic,
) -> DeliveryReport:
    """Deliver the outbox rows due now through ``sinks`` (by sink name). The rows are
    claimed for ``CORRAL_OUTCOME_CLAIM_S``; those a run has not reached :data:`RESERVE_S`
    before that ends (by ``clock``) are given back, due at once, untried."""
    run = _Run(db, sinks, settings, now or utcnow())
    claim_s = settings.outcome_claim_s
    rows = outbox.claim_due(db, now=run.now, limit=BATCH, lease_s=claim_s)
    give_back_at = clock() + claim_s - RESERVE_S
    records = _records(db, rows)
    for row in rows:
        if clock() >= give_back_at:
            run.report.given_back.append(row.id)
            continue
        run.deliver(row, _record_of(row, records))
    outbox.delivered(db, run.report.delivered)
    outbox.postpone(db, run.report.waiting, until=run.now + timedelta(seconds=COST_POLL_S))
    outbox.postpone(db, run.report.given_back, until=run.now)
    if rows or clock() - _last_observed[0] >= OBSERVE_EVERY_S:
        _last_observed[0] = clock()
        _observe(db, settings, run.now)
    return run.report


def _records(db: Database, rows: Sequence[OutboxRow]) -> dict[str, FinalRecord]:
    """The final records of the items whose rows carry none of their own."""
    wanted = {r.work_item_id for r in rows if r.work_item_id and "data" not in r.target}
    with db.session() as session:
        built = {item_id: final_record(session, item_id) for item_id in wanted}
    return {item_id: record for item_id, record in built.items() if record is not None}


def _record_of(row: OutboxRow, records: Mapping[str, FinalRecord]) -> FinalRecord | None:
    """What ``row`` delivers: the record it carries (a sandbox's end, a budget's crossing,
    fixed when it was written), else its item's final record (None: the item is gone)."""
    carried = row.target.get("data")
    if carried is not None:
        return FinalRecord(dict(carried), settled=True)
    return records.get(row.work_item_id or "")


@dataclass
class _Run:
    """One run of the deliverer: where it writes, who delivers, and what became of each row."""

    db: Database
    sinks: Mapping[str, OutcomeSink]
    settings: OutcomeSettings
    now: datetime
    report: DeliveryReport = field(default_factory=DeliveryReport)

    def deliver(self, row: OutboxRow, built: FinalRecord | None) -> None:
        """Hand ``row``'s record to its sink, unless it waits for its item's cost."""
        if built is not None and not built.settled and self._may_wait(row):
            self.report.waiting.append(row.id)
            return
        sink = self.sinks.get(row.sink)
        try:
            if built is None:
                raise OutcomeDeliveryError(f"work item {row.work_item_id} is gone")
            if sink is None:
                raise OutcomeDeliveryError(
                    f"no {row.sink} sink in this process (is CORRAL_RESULT_BACKEND set?)"
                )
            sink.deliver_row(row, built.record)
        except Exception as exc:  # whatever a sink raises fails this row alone
            self._failed(row, f"{type(exc).__name__}: {exc}")
            return
        DELIVERIES.labels(row.sink, "delivered").inc()
        self.report.delivered.append(row.id)

    def _may_wait(self, row: OutboxRow) -> bool:
        return self.now - row.created_at < timedelta(seconds=self.settings.outcome_cost_wait_s)

    def _failed(self, row: OutboxRow, error: str) -> None:
        tries = row.attempts + 1
        extra = {"work_item_id": row.work_item_id, "sink": row.sink, "attempts": tries}
        if tries >= self.settings.outcome_max_attempts:
            outbox.give_up(self.db, row, error=error, now=self.now)
            DELIVERIES.labels(row.sink, "given_up").inc()
            self.report.given_up.append(row.id)
            log.error("outcome not delivered; given up: %s", error, extra=extra)
            return
        delay = min(BACKOFF_MAX_S, 2.0**tries)
        outbox.retry(self.db, row, error=error, due_at=self.now + timedelta(seconds=delay))
        DELIVERIES.labels(row.sink, "retried").inc()
        self.report.retried.append(row.id)
        log.warning("outcome not delivered; tried again in %.0f s: %s", delay, error, extra=extra)


def _observe(db: Database, settings: OutcomeSettings, now: datetime) -> None:
    """The outbox's gauge; now and then, the rows given up long ago pruned, and the webhook
    delivery log's tries older than ``CORRAL_WEBHOOK_LOG_KEEP_S``."""
    found = outbox.counts(db)
    for sink in {sink for sink, _ in found} | {"celery", "webhook"}:
        for status in ("pending", "failed"):
            OUTBOX_ROWS.labels(sink, status).set(found.get((sink, status), 0))
    if time.monotonic() - _last_prune[0] >= PRUNE_EVERY_S:
        _last_prune[0] = time.monotonic()
        outbox.prune(db, before=now - KEEP_FAILED)
        webhook_log.prune(db, before=now - timedelta(seconds=settings.webhook_log_keep_s))
