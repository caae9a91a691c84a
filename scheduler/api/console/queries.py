"""What the console reads that the api and the CLI do not: counts per time bucket (for the
charts), provisions in flight per provider, and spend per bucket and attribution.

Every query takes the org it is limited to (None: every org), and each reads through an
index: work items by ``created_at`` (ix_work_items_created, ix_work_items_org_created) or
``(state, updated_at)``, live sandboxes by provider (ix_sandboxes_live_provider), cost
events by ``ended_at``, warm sandboxes' billed idle time by when it was billed
(ix_warm_sandboxes_org_bound, ix_warm_sandboxes_org_ended_unbound, with an org).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

from sqlalchemy import ColumnElement, Integer, cast, func, select

from corral.providers.base import SandboxState
from corral.shared.store.db import Database, utcnow
from corral.shared.store.ledger import WARM_BILLED_AT, CostGrouping, warm_idle
from corral.shared.store.models import CostEvent, Pool, ProviderCredential, Sandbox, WorkItem

FAILED_STATES = ("failed", "dispatch_error")


@dataclass(frozen=True)
class Buckets:
    """``count`` buckets of ``width`` each, the last one ending at ``end``: whole multiples
    of ``width`` since the epoch (UTC), the last one holding now."""

    end: datetime
    width: timedelta
    count: int

    @classmethod
    def up_to(cls, now: datetime, width: timedelta, count: int) -> Buckets:
        seconds = int(width.total_seconds())
        end = (int(now.timestamp()) // seconds + 1) * seconds
        return cls(end=datetime.fromtimestamp(end, UTC), width=width, count=count)

    @property
    def start(self) -> datetime:
        return self.end - self.width * self.count

    def starts(self) -> list[datetime]:
        return [self.start + self.width * i for i in range(self.count)]

    def index(self, column: Any, db: Database) -> ColumnElement[int]:
        """The bucket number of ``column`` (a timestamp) as a SQL expression."""
        seconds = int(self.width.total_seconds())
        if db.is_postgres:
            epoch: ColumnElement[Any] = func.date_part("epoch", column)  # float, not numeric
        else:
            epoch = cast(func.strftime("%s", column), Integer)
        start = int(self.start.timestamp())
        return cast(func.floor((epoch - start) / seconds), Integer)


def last_hour(now: datetime | None = None) -> Buckets:
    """Twelve five-minute buckets, the last one holding now."""
    return Buckets.up_to(now or utcnow(), timedelta(minutes=5), 12)


def _bucketed(db: Database, buckets: Buckets, column: Any, *where: Any) -> list[int]:
    index = buckets.index(column, db).label("bucket")
    query = select(index, func.count()).where(column >= buckets.start, *where).group_by(index)
    counts = [0] * buckets.count
    with db.session() as session:
        for bucket, count in session.execute(query):
            if 0 <= bucket < buckets.count:
                counts[bucket] = count
    return counts


def dispatch_series(db: Database, buckets: Buckets, org_id: str | None) -> list[int]:
    """Items created in each bucket."""
    where = [WorkItem.org_id == org_id] if org_id is not None else []
    return _bucketed(db, buckets, WorkItem.created_at, *where)


def failure_series(db: Database, buckets: Buckets, org_id: str | None) -> list[int]:
    """Items that ended failed (or could not be dispatched) in each bucket."""
    where: list[ColumnElement[bool]] = [WorkItem.state.in_(FAILED_STATES)]
    if org_id is not None:
        where.append(WorkItem.org_id == org_id)
    return _bucketed(db, buckets, WorkItem.updated_at, *where)


def provisions_in_flight(db: Database, org_id: str | None) -> dict[str, int]:
    """Sandboxes being provisioned now, per provider."""
    query = (
        select(Sandbox.provider_id, func.count())
        .where(Sandbox.terminated_at.is_(None), Sandbox.status == SandboxState.PROVISIONING.value)
        .group_by(Sandbox.provider_id)
        .order_by(Sandbox.provider_id)
    )
    if org_id is not None:
        query = query.where(Sandbox.org_id == org_id)
    with db.session() as session:
        return {provider: count for provider, count in session.execute(query)}


def pool_choices(db: Database, org_id: str | None) -> list[dict[str, str]]:
    """Pools (not deleted) to filter items by: id, org and name."""
    query = select(Pool.id, Pool.org_id, Pool.name).where(Pool.deleted_at.is_(None))
    if org_id is not None:
        query = query.where(Pool.org_id == org_id)
    with db.session() as session:
        rows = session.execute(query.order_by(Pool.org_id, Pool.name)).all()
    return [{"id": pool_id, "org": org, "name": name} for pool_id, org, name in rows]


def credential_orgs(db: Database, provider_id: str, org_id: str | None) -> list[dict[str, Any]]:
    """The orgs (``org_id`` only, when given) with a stored credential for the provider, and
    when each was stored: names and times, never the credential."""
    query = (
        select(ProviderCredential.org_id, ProviderCredential.updated_at)
        .where(ProviderCredential.provider_id == provider_id)
        .order_by(ProviderCredential.org_id)
    )
    if org_id is not None:
        query = query.where(ProviderCredential.org_id == org_id)
    with db.session() as session:
        return [{"org": org, "updated_at": at} for org, at in session.execute(query)]


_COST_KEYS = {
    CostGrouping.ORG: CostEvent.org_id,
    CostGrouping.POOL: CostEvent.pool_id,
    CostGrouping.PROVIDER: CostEvent.provider_id,
    CostGrouping.PROJECT: CostEvent.project_id,
}


def cost_buckets(since: datetime, now: datetime | None = None) -> Buckets:
    """Hourly buckets for two days or less, else daily ones (at most 400 of them), from the
    one holding ``since`` to the one holding now."""
    end = now or utcnow()
    width = timedelta(hours=1) if end - since <= timedelta(days=2) else timedelta(days=1)
    last = Buckets.up_to(end, width, 1)
    span = int((last.end - since).total_seconds())
    count = max(1, min(400, -(-span // int(width.total_seconds()))))
    return Buckets(end=last.end, width=width, count=count)


def cost_series(
    db: Database, buckets: Buckets, by: CostGrouping, org_id: str | None
) -> dict[str, list[dict[str, Any]]]:
    """Per attribution key, each bucket's events, seconds and amount (micro-units)."""
    key = _COST_KEYS[by]
    index = buckets.index(CostEvent.ended_at, db).label("bucket")
    query = (
        select(
            key,
            index,
            func.count(),
            func.coalesce(func.sum(CostEvent.seconds), 0.0),
            func.coalesce(func.sum(CostEvent.amount_micros), 0),
        )
        .where(CostEvent.ended_at >= buckets.start)
        .group_by(key, index)
    )
    if org_id is not None:
        query = query.where(CostEvent.org_id == org_id)
    series: dict[str, list[dict[str, Any]]] = defaultdict(
        lambda: [{"events": 0, "seconds": 0.0, "amount_micros": 0} for _ in range(buckets.count)]
    )
    # Warm sandboxes' idle time too, in the bucket it was billed in, as the reports count it.
    warm = warm_idle(by, org_id, buckets.start, per=buckets.index(WARM_BILLED_AT, db))
    with db.session() as session:
        rows = [*session.execute(query), *session.execute(warm)]
    for name, bucket, events, seconds, amount in rows:
        if 0 <= bucket < buckets.count:
            was = series[name][bucket]
            series[name][bucket] = {
                "events": was["events"] + events,
                "seconds": was["seconds"] + float(seconds),
                "amount_micros": was["amount_micros"] + int(amount),
            }
    return dict(sorted(series.items()))
