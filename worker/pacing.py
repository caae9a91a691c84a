"""Provider pacing in the provision path: a create waits for its credential's pace.

Before a provision task claims its item, :func:`admit` asks the pace of the item's
provider credential (:mod:`corral.shared.store.pacing`, shared by every worker process)
whether the create may go. When it may not, nothing is claimed: the item stays routed with
its slot held (it was admitted to its pool), marked with what holds it (``wait_reason``
``provider_pace``: it waits for the rate, its slot reserved at ``not_before`` or to be
asked for then; ``provider_in_flight``: the creates in flight are at their cap, it looks
again at ``not_before``), and the task is sent again for then (:class:`Deferred`). A
provider's rate-limit answer (:func:`refused`) slows the pace and leaves the item waiting
the same way (:class:`Paced`), neither failed nor counted as a retry.

The key of a pace is the provider and a digest of the credential in use (the org's stored
one, else the deployment's ``CORRAL_<PROVIDER>_API_KEY``), never the credential: orgs with
one credential share a pace, an org with its own has its own. A provider without limits
(local, docker and kubernetes unless configured) costs a provision nothing here: no
database or broker round trip.
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from dataclasses import dataclass
from datetime import UTC, datetime

from sqlalchemy import select, update
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.orm import Session

from corral.providers.credentials import resolve_credential
from corral.providers.pacing import PaceLimits
from corral.shared import metrics
from corral.shared.errors import CorralError
from corral.shared.runtime import Runtime
from corral.shared.store import pacing
from corral.shared.store.db import utcnow
from corral.shared.store.models import Pool, WorkItem

log = logging.getLogger(__name__)

PACE_REASONS, HELD_STATES = pacing.PACE_REASONS, pacing.HELD_STATES
KEY_TTL_S = 60.0  # how long a process keeps an org's pace key (its credential's digest)


@dataclass
class Grant:
    """A create the pace let go: in flight as ``holder`` until :func:`settle`."""

    key: str
    provider_id: str
    holder: str  # the item
    queue: str  # where its task is sent again should the provider refuse the create
    limits: PaceLimits
    settled: bool = False


@dataclass(frozen=True)
class Deferred:
    """A create that may not go yet: its task is sent again to ``queue`` for ``until``
    (epoch seconds); ``reason`` is what holds the item."""

    item_id: str
    queue: str
    until: float
    reason: str

    @property
    def countdown_s(self) -> float:
        return max(0.0, self.until - time.time())


class Paced(CorralError):  # noqa: N818 - a signal to the task, not a failure
    """The provider refused a create for its rate or quota: the item waits for its pace."""

    code = "provider_paced"

    def __init__(self, deferred: Deferred) -> None:
        super().__init__(f"paced until {deferred.until:.3f}")
        self.deferred = deferred


def limits_of(rt: Runtime, provider_id: str) -> PaceLimits | None:
    """The provider's pace as the deployment configures it; None: not paced (or a provider
    this process cannot build, whose provision reports what is wrong)."""
    try:
        return rt.provider(provider_id).config.pace()
    except CorralError:
        return None


def admit(
    rt: Runtime, item_id: str, *, provider_hint: str | None = None, now: float | None = None
) -> Grant | Deferred | None:
    """Whether ``item_id``'s create may go now: a :class:`Grant` (it goes, in flight until
    :func:`settle`), a :class:`Deferred` (not yet: the item is marked, send the task again),
    or None (its provider is not paced, or the item is not waiting for a create).

    ``provider_hint``: the provider of the queue the task came from; when it has no limits
    the item is not even read. ``now``: the pace's clock (epoch seconds), the wall clock's
    unless a test says."""
    if provider_hint is not None and limits_of(rt, provider_hint) is None:
        return None
    with rt.db.session() as session:
        row = session.execute(
            select(
                WorkItem.org_id,
                WorkItem.state,
                WorkItem.queue,
                WorkItem.wait_reason,
                WorkItem.not_before,
                Pool.provider_id,
            )
            .join(Pool, Pool.id == WorkItem.pool_id)
            .where(WorkItem.id == item_id)
        ).one_or_none()
    if row is None or row.state not in HELD_STATES or not row.queue:
        return None
    limits = limits_of(rt, row.provider_id)
    if limits is None:
        return None
    asked_for = row.not_before.timestamp() if row.wait_reason in PACE_REASONS else None
    if asked_for is not None and asked_for > _now(now) + pacing.EARLY_S:  # back early
        return Deferred(item_id, row.queue, asked_for, row.wait_reason)
    key = pace_key(rt, row.provider_id, row.org_id)
    lease_s = float(rt.settings.provision_lease_s)

    def change(state: pacing.PaceState) -> tuple[pacing.PaceState, pacing.Go | pacing.Wait]:
        return pacing.admit(state, limits, item_id, now=_now(now), lease_s=lease_s)

    with rt.db.session() as session:
        decided = pacing.apply(session, key, row.provider_id, change)
        if isinstance(decided, pacing.Go):
            return Grant(key, row.provider_id, item_id, row.queue, limits)
        reason = pacing.IN_FLIGHT if decided.reason == "in_flight" else pacing.PACED
        _mark(session, item_id, reason, decided.until)
    metrics.PROVISION_PACED.labels(provider=row.provider_id, reason=decided.reason).inc()
    return Deferred(item_id, row.queue, decided.until, reason)


def _now(fixed: float | None) -> float:
    """The pace's clock: read under the pace's lock (a create that waited for the lock is
    judged at when it got it), unless a test fixes it."""
    return time.time() if fixed is None else fixed


def settle(rt: Runtime, grant: Grant | None, *, succeeded: bool) -> None:
    """The granted create is over (made, or failed otherwise than for the pace): it leaves
    those in flight; a success brings a slowed pace back a step. Advice only: a database
    away leaves the holder to its lease."""
    if grant is None or grant.settled:
        return
    grant.settled = True
    limits = grant.limits
    if limits.in_flight is None and not succeeded:
        return  # nothing in flight to end, nothing to recover

    def change(state: pacing.PaceState) -> tuple[pacing.PaceState, None]:
        after = pacing.settle(state, limits, grant.holder, succeeded=succeeded, now=time.time())
        return after, None

    try:
        with rt.db.session() as session:
            pacing.apply(session, grant.key, grant.provider_id, change)
    except SQLAlchemyError:
        log.warning("could not settle a paced create", extra={"work_item_id": grant.holder})


def refused(rt: Runtime, grant: Grant) -> Deferred:
    """The provider refused the granted create for its rate or quota: the pace slows, the
    item (its attempt given back, still holding its slot) waits for its next slot."""
    grant.settled = True

    def change(state: pacing.PaceState) -> tuple[pacing.PaceState, float]:
        return pacing.refused(state, grant.limits, grant.holder, now=time.time())

    with rt.db.session() as session:
        until = pacing.apply(session, grant.key, grant.provider_id, change)
        _mark(session, grant.holder, pacing.PACED, until)
    now = time.time()
    metrics.PROVISION_PACED.labels(provider=grant.provider_id, reason="refused").inc()
    log.info(
        "provider refused a create for its rate limit; paced",
        extra={"work_item_id": grant.holder, "retry_in_s": round(until - now, 3)},
    )
    return Deferred(grant.holder, grant.queue, until, pacing.PACED)


def _mark(session: Session, item_id: str, reason: str, until: float) -> None:
    """Say on the item what holds it and when it may go (it keeps its state and slot)."""
    session.execute(
        update(WorkItem)
        .where(WorkItem.id == item_id, WorkItem.state.in_(HELD_STATES))
        .values(
            wait_reason=reason,
            not_before=datetime.fromtimestamp(until, UTC),
            updated_at=utcnow(),
        )
        .execution_options(synchronize_session=False)
    )


# -- the key ----------------------------------------------------------------------------------


def credential_digest(provider_id: str, credential: str | None) -> str:
    """The part of a pace key that stands for the credential: a digest, or ``none``."""
    if credential is None:
        return "none"
    material = b"corral-pace\0" + provider_id.encode() + b"\0" + credential.encode()
    return hashlib.sha256(material).hexdigest()[:24]


class _Keys:
    """The process's pace keys by org and provider, each kept :data:`KEY_TTL_S`: resolving a
    credential reads the credential store, which a create need not do twice a minute."""

    def __init__(self, rt: Runtime) -> None:
        self._rt = rt
        self._lock = threading.Lock()
        self._keys: dict[tuple[str, str], tuple[str, float]] = {}

    def key(self, provider_id: str, org_id: str) -> str:
        now = time.monotonic()
        with self._lock:
            found = self._keys.get((org_id, provider_id))
        if found is not None and found[1] > now:
            return found[0]
        try:
            provider = self._rt.provider(provider_id)
            secret: str | None = resolve_credential(
                org_id, provider_id, resolver=provider.credentials
            ).get_secret_value()
        except CorralError:  # no credential (the create fails on its own), or not openable
            secret = None
        key = f"{provider_id}:{credential_digest(provider_id, secret)}"
        with self._lock:
            self._keys[(org_id, provider_id)] = (key, now + KEY_TTL_S)
        return key


def pace_key(rt: Runtime, provider_id: str, org_id: str) -> str:
    """The key of the pace ``org_id``'s creates toward ``provider_id`` share."""
    return rt.part("pace-keys", _Keys).key(provider_id, org_id)
