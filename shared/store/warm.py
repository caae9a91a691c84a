"""Warm sandboxes: made ahead of any work item, bound to one later (docs/warm-pools.md).

A warm sandbox's runner starts holding only an *enrolment* credential (``cre_``, single use,
scoped to its pool's warm sandbox row). It redeems it once for a *channel* token (``crw_``)
and then waits on ``/v1/runner/warm/wait``. A provision of a routed item of the pool binds
the item to a waiting warm sandbox instead of making one (:func:`bind`); the next wait
answer mints the item's registration token and hands it over, once (:func:`hand_over`).
Only hashes of the three tokens are stored.

Every state change is one guarded UPDATE (``WHERE state = ...``), so of two binders, two
enrolments or two hand-overs exactly one wins, on PostgreSQL and SQLite alike.
"""

from __future__ import annotations

import hashlib
import json
import uuid
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field
from sqlalchemy import ColumnElement, case, func, select, update
from sqlalchemy.engine import CursorResult
from sqlalchemy.orm import Session

from corral.providers.base import Egress, SandboxHandle, SandboxSpec
from corral.shared.broker.queues import provision_queue
from corral.shared.store import budgets
from corral.shared.store.db import Database, utcnow
from corral.shared.store.ledger import BillingModel, price
from corral.shared.store.models import OrgLimit, Pool, Sandbox, WarmSandbox, WarmState
from corral.shared.store.pools import ProvisionPool, pool_view
from corral.shared.store.tokens import hash_token, mint_registration_token, new_token, revoke_token

ENROLMENT_PREFIX = "cre_"
CHANNEL_PREFIX = "crw_"
WARM_MIN_LIMIT = 100
# A waiting runner calls again as soon as a wait answers; past CORRAL_WARM_WAIT_S plus this
# without a call it is taken for gone.
SEEN_GRACE_S = 15.0
# pg_advisory_xact_lock(classid, objid): 0x636f7272 is "corr" (the reaper's lock is 1).
TICK_LOCK = (0x636F7272, 2)
WAITING, BOOTING = WarmState.WAITING.value, WarmState.BOOTING.value
BOUND, ENDED = WarmState.BOUND.value, WarmState.ENDED.value


def new_warm_id() -> str:
    return f"wm-{uuid.uuid4().hex[:24]}"


Day = Literal["mon", "tue", "wed", "thu", "fri", "sat", "sun"]
DAYS: tuple[Day, ...] = ("mon", "tue", "wed", "thu", "fri", "sat", "sun")
CLOCK = r"^([01][0-9]|2[0-3]):[0-5][0-9]$"


class WarmWindow(BaseModel):
    """A window of the week (UTC) in which a pool keeps ``warm_min`` warm sandboxes instead
    of its own ``warm_min``: from ``start`` to ``end`` (HH:MM; an ``end`` at or before
    ``start`` runs past midnight) on ``days`` (of the start; all when left out)."""

    model_config = ConfigDict(extra="forbid")

    days: list[Day] = Field(default_factory=lambda: list(DAYS), min_length=1)
    start: str = Field(pattern=CLOCK)
    end: str = Field(pattern=CLOCK)
    warm_min: int = Field(ge=0, le=WARM_MIN_LIMIT)

    def contains(self, now: datetime) -> bool:
        start, end = _minutes(self.start), _minutes(self.end)
        minute = now.hour * 60 + now.minute
        today, yesterday = DAYS[now.weekday()], DAYS[(now.weekday() - 1) % 7]
        if start < end:
            return today in self.days and start <= minute < end
        # Past midnight: the evening part belongs to today, the morning part to yesterday.
        return (today in self.days and minute >= start) or (yesterday in self.days and minute < end)


def _minutes(clock: str) -> int:
    hours, minutes = clock.split(":")
    return int(hours) * 60 + int(minutes)


def wanted(pool: Pool, now: datetime) -> int:
    """How many warm sandboxes the pool wants at ``now``: none when it is disabled or
    deleted; else the first window of its ``warm_schedule`` that holds ``now``, else its
    ``warm_min``."""
    if not pool.active or pool.deleted_at is not None:
        return 0
    for window in pool.warm_schedule or []:
        parsed = WarmWindow.model_validate(window)  # checked when the pool was written
        if parsed.contains(now):
            return parsed.warm_min
    return pool.warm_min


def config_digest(pool: Pool) -> str:
    """What a warm sandbox of ``pool`` was made with: its provider's options, substrate and
    capability overrides. A warm sandbox made under other settings is never bound."""
    made_with = {
        "provider": pool.provider_id,
        "sandbox_config": pool.sandbox_config,
        "runtime_provides": pool.runtime_provides,
        "capabilities": pool.capabilities,
    }
    return hashlib.sha256(json.dumps(made_with, sort_keys=True, default=str).encode()).hexdigest()


def keeps_warm(pool: ProvisionPool) -> bool:
    """Whether the pool may have warm sandboxes at all (a provision then tries to bind)."""
    return pool.warm_min > 0 or bool(pool.warm_schedule)


def binds_warm(spec: SandboxSpec) -> bool:
    """Whether an item's spec fits a warm sandbox, which was made with the pool's
    ``sandbox_config`` and nothing else: no image, GPU, cpu or memory of its own, and the
    default egress (no network). Other items are provisioned cold."""
    resources = spec.resources
    return (
        spec.image is None
        and not resources.gpu
        and resources.cpu is None
        and resources.memory_mb is None
        and spec.egress == Egress()
    )


def idle_cost(pool: Pool, created_at: datetime, now: datetime) -> tuple[float, int]:
    """The idle seconds of a warm sandbox made at ``created_at``, and their price as the
    pool's ``idle_cost_model`` (its capability matrix, or the pool's override of it) says:
    ``metered``, the seconds at the pool's ``rate_micros`` per second; ``zero`` and
    ``storage-only`` (an idle sandbox's compute is not billed), nothing."""
    elapsed = max(now - created_at, timedelta(0))
    if pool_view(pool).capabilities.idle_cost_model != "metered":
        return elapsed.total_seconds(), 0
    amount = price(BillingModel.WALL_CLOCK, pool.rate_micros, elapsed=elapsed, cpu_seconds=None)
    return elapsed.total_seconds(), amount.amount_micros


def _changed(result: Any) -> int:
    assert isinstance(result, CursorResult)
    return result.rowcount


# -- the runner's side: enrol, then wait for a registration token -------------------------


def enrol(session: Session, token: str, *, now: datetime | None = None) -> str | None:
    """Redeem an enrolment credential once; the channel token, or None for an unknown or
    used credential, or a warm sandbox no longer booting (alike on purpose)."""
    if not token.startswith(ENROLMENT_PREFIX):
        return None
    moment = now or utcnow()
    channel = new_token(CHANNEL_PREFIX)
    made = WarmSandbox.external_id.is_not(None)
    changed = session.execute(
        update(WarmSandbox)
        .where(
            WarmSandbox.enrol_hash == hash_token(token),
            WarmSandbox.enrolled_at.is_(None),
            WarmSandbox.state == BOOTING,
        )
        .values(
            enrolled_at=moment,
            last_seen_at=moment,
            channel_hash=hash_token(channel),
            state=case((made, WAITING), else_=WarmSandbox.state),
            ready_at=case((made, moment), else_=WarmSandbox.ready_at),
        )
        .execution_options(synchronize_session=False)
    )
    return channel if _changed(changed) == 1 else None


@dataclass(frozen=True)
class Handover:
    """What a wait answers: ``gone`` (the channel is closed: 401), else the item's
    registration token, or None to wait again."""

    gone: bool = False
    registration_token: str | None = None


def hand_over(
    session: Session, channel: str, *, token_ttl_s: float, seen: bool = False
) -> Handover:
    """The wait's answer for ``channel``. A bound warm sandbox gets its item's registration
    token minted here, exactly once (the channel then closes). ``seen``: the first look of
    a wait call, which notes that the runner is still there."""
    if not channel.startswith(CHANNEL_PREFIX):
        return Handover(gone=True)
    warm = session.scalars(
        select(WarmSandbox).where(
            WarmSandbox.channel_hash == hash_token(channel),
            WarmSandbox.handed_over_at.is_(None),
            WarmSandbox.state.in_([BOOTING, WAITING, BOUND]),
        )
    ).one_or_none()
    if warm is None:
        return Handover(gone=True)
    if warm.state != BOUND:
        if seen:
            warm.last_seen_at = utcnow()  # this column alone: the state stays the binder's
        return Handover()
    taken = session.execute(
        update(WarmSandbox)
        .where(WarmSandbox.id == warm.id, WarmSandbox.handed_over_at.is_(None))
        .values(handed_over_at=utcnow())
        .execution_options(synchronize_session=False)
    )
    sandbox = session.get(Sandbox, warm.sandbox_id) if warm.sandbox_id else None
    if _changed(taken) != 1 or sandbox is None or sandbox.terminated_at is not None:
        return Handover(gone=True)
    return Handover(registration_token=mint_registration_token(session, sandbox, ttl_s=token_ttl_s))


def still_waiting(session: Session, channel_hashes: Collection[str]) -> set[str]:
    """Those of ``channel_hashes`` whose warm sandbox still waits to be bound: the rest were
    bound (their wait has a token to take) or are gone. One lookup by the channel's unique
    index each, for every held wait of an api process at once."""
    waiting: set[str] = set()
    hashes = sorted(channel_hashes)
    for start in range(0, len(hashes), 500):
        waiting.update(
            session.scalars(
                select(WarmSandbox.channel_hash).where(
                    WarmSandbox.channel_hash.in_(hashes[start : start + 500]),
                    WarmSandbox.handed_over_at.is_(None),
                    WarmSandbox.state.in_([BOOTING, WAITING]),
                )
            )
        )
    return waiting


# -- the worker's side: record a made sandbox, bind an item to one ------------------------


def record_made(db: Database, warm_id: str, handle: SandboxHandle) -> bool:
    """Store a made warm sandbox's handle; False when the row is no longer booting (ended
    while it was made: the caller terminates it)."""
    now = utcnow()
    enrolled = WarmSandbox.enrolled_at.is_not(None)
    with db.session() as session:
        changed = session.execute(
            update(WarmSandbox)
            .where(WarmSandbox.id == warm_id, WarmSandbox.state == BOOTING)
            .values(
                external_id=handle.external_id,
                handle_metadata=dict(handle.metadata),
                state=case((enrolled, WAITING), else_=WarmSandbox.state),
                ready_at=case((enrolled, now), else_=WarmSandbox.ready_at),
            )
            .execution_options(synchronize_session=False)
        )
        return _changed(changed) == 1


def handle_of(warm: WarmSandbox) -> SandboxHandle:
    """How to reach a warm sandbox at its provider: its recorded handle, or (not recorded
    yet) its id, which every built-in provider names its sandboxes by."""
    return SandboxHandle(
        provider_id=warm.provider_id,
        external_id=warm.external_id or warm.id,
        metadata={"org_id": warm.org_id, "sandbox_id": warm.id, **warm.handle_metadata},
    )


@dataclass(frozen=True)
class Bound:
    """A warm sandbox given to an item: its handle becomes the item's sandbox's."""

    warm_id: str
    handle: SandboxHandle


def bind(
    db: Database,
    pool_id: str,
    work_item_id: str,
    sandbox_id: str,
    *,
    revoke_hash: str,
    seen_within_s: float,
) -> Bound | None:
    """Give the oldest waiting warm sandbox of ``pool_id`` whose runner called within
    ``seen_within_s`` to ``work_item_id`` (its sandbox row ``sandbox_id``), revoking the
    registration token ``revoke_hash`` in the same transaction; None when none waits. Rows
    another binder holds are skipped, and the guarded UPDATE makes a sandbox bound once,
    whatever the isolation."""
    now = utcnow()
    with db.session() as session:
        pool = session.get(Pool, pool_id)
        assert pool is not None
        candidates = session.scalars(
            select(WarmSandbox)
            .where(
                WarmSandbox.pool_id == pool_id,
                WarmSandbox.state == WAITING,
                WarmSandbox.last_seen_at > now - timedelta(seconds=seen_within_s),
                WarmSandbox.config_digest == config_digest(pool),
            )
            .order_by(WarmSandbox.ready_at, WarmSandbox.id)
            # One row: a binder locking several would keep concurrent binders from them.
            .limit(1)
            .with_for_update(skip_locked=True)
        ).all()
        for warm in candidates:
            changes = {"work_item_id": work_item_id, "sandbox_id": sandbox_id, "bound_at": now}
            if _leave_idle(session, warm, pool, now, [WAITING], state=BOUND, **changes):
                revoke_token(session, revoke_hash)
                return Bound(warm.id, handle_of(warm))
    return None


def _leave_idle(
    session: Session,
    warm: WarmSandbox,
    pool: Pool,
    now: datetime,
    states: list[str],
    **changes: Any,
) -> bool:
    """Move ``warm`` out of ``states`` with ``changes``, its idle time billed in the same
    guarded UPDATE (so once); False when it was no longer in them."""
    seconds, amount = idle_cost(pool, warm.created_at, now)
    changed = session.execute(
        update(WarmSandbox)
        .where(WarmSandbox.id == warm.id, WarmSandbox.state.in_(states))
        .values(idle_seconds=seconds, idle_amount_micros=amount, **changes)
        .execution_options(synchronize_session=False)
    )
    return _changed(changed) == 1


def release_bound(db: Database, sandbox_id: str) -> list[SandboxHandle]:
    """End the warm sandboxes bound to ``sandbox_id`` (an attempt taken over after its
    worker died between the bind and the handle's record): their handles, to terminate."""
    with db.session() as session:
        bound = session.scalars(
            select(WarmSandbox).where(
                WarmSandbox.sandbox_id == sandbox_id, WarmSandbox.state == BOUND
            )
        ).all()
        ended = []
        for warm in bound:
            changed = session.execute(
                update(WarmSandbox)
                .where(WarmSandbox.id == warm.id, WarmSandbox.state == BOUND)
                .values(state=ENDED, ended_at=utcnow(), end_reason="superseded")
                .execution_options(synchronize_session=False)
            )
            if _changed(changed) == 1:
                ended.append(handle_of(warm))
    return ended


# -- beat's side: end what is stale or surplus, make what is missing ----------------------


@dataclass(frozen=True)
class Ending:
    """A warm sandbox ended here, for its provider to terminate."""

    warm_id: str
    handle: SandboxHandle
    reason: str


def end_warm(session: Session, warm: WarmSandbox, pool: Pool, reason: str) -> Ending | None:
    """End one unbound warm sandbox (its idle time billed once); None if it moved on."""
    now = utcnow()
    changes = {"state": ENDED, "ended_at": now, "end_reason": reason}
    if not _leave_idle(session, warm, pool, now, [BOOTING, WAITING], **changes):
        return None
    return Ending(warm.id, handle_of(warm), reason)


def stale(
    session: Session,
    pool: Pool,
    now: datetime,
    *,
    want: int,
    boot_timeout_s: float,
    seen_within_s: float,
) -> list[tuple[WarmSandbox, str]]:
    """The pool's unbound warm sandboxes that must end, and why: made under settings the
    pool no longer has (``pool_changed``), waiting past its idle TTL, its runner silent for
    ``seen_within_s`` (``runner_lost``), booting past ``boot_timeout_s``, or more than the
    pool may keep now, ``want`` (``surplus``)."""
    live = session.scalars(
        select(WarmSandbox)
        .where(WarmSandbox.pool_id == pool.id, WarmSandbox.state.in_([BOOTING, WAITING]))
        .order_by(WarmSandbox.created_at, WarmSandbox.id)
    ).all()
    found: list[tuple[WarmSandbox, str]] = []
    digest = config_digest(pool)
    for warm in live:
        if warm.config_digest not in (None, digest):
            found.append((warm, "pool_changed"))
        elif warm.state == WAITING and warm.ready_at is not None:
            if warm.ready_at < now - timedelta(seconds=pool.warm_idle_ttl_s):
                found.append((warm, "idle_ttl"))
            elif (warm.last_seen_at or warm.ready_at) < now - timedelta(seconds=seen_within_s):
                found.append((warm, "runner_lost"))
        elif warm.created_at < now - timedelta(seconds=boot_timeout_s):
            found.append((warm, "provision_stuck"))
    kept = len(live) - len(found)
    ending = {warm.id for warm, _ in found}
    for warm in live:  # the oldest extra ones go first
        if kept <= want:
            break
        if warm.id not in ending:
            found.append((warm, "surplus"))
            kept -= 1
    return found


@dataclass
class Tick:
    """What one warm tick did: sandboxes ended, new rows to make on their queues, and rows of
    earlier ticks whose provision task was never noted as sent (that tick failed after its
    commit, e.g. the answer to its COMMIT was lost, or died before sending): sent again."""

    ended: list[Ending]
    made: list[tuple[str, str]]  # (warm id, provision queue)
    unsent: list[tuple[str, str]] = field(default_factory=list)

    @property
    def to_send(self) -> list[tuple[str, str]]:
        """The provision tasks the caller sends (then :func:`mark_sent`)."""
        return self.made + self.unsent


def tick(db: Database, *, boot_timeout_s: float, seen_within_s: float) -> Tick:
    """End the stale and surplus warm sandboxes of every pool that has or had some, and add
    rows for those missing below ``warm_min``, one tick at a time (a transaction-scoped
    advisory lock on PostgreSQL; SQLite has one writer), so two ticks never both fill the
    same gap. Pool rows are not locked: routing updates them on every item."""
    now = utcnow()
    result = Tick([], [])
    with db.session() as session:
        if session.get_bind().dialect.name == "postgresql":
            session.execute(select(func.pg_advisory_xact_lock(*TICK_LOCK)))
        has_warm = select(WarmSandbox.pool_id).where(WarmSandbox.state.in_([BOOTING, WAITING]))
        configured = (Pool.warm_min > 0) | Pool.warm_schedule.is_not(None)
        wants: ColumnElement[bool] = configured & Pool.active & Pool.deleted_at.is_(None)
        pools = session.scalars(
            select(Pool).where(wants | Pool.id.in_(has_warm)).order_by(Pool.id)
        ).all()
        if not pools:
            return result
        allowed = _allowed(session, pools, now)
        for pool in pools:
            found = stale(
                session,
                pool,
                now,
                want=allowed[pool.id],
                boot_timeout_s=boot_timeout_s,
                seen_within_s=seen_within_s,
            )
            for warm, reason in found:
                ending = end_warm(session, warm, pool, reason)
                if ending is not None:
                    result.ended.append(ending)
            made = _refill(session, pool, allowed[pool.id], now)
            result.made += made
            result.unsent += _unsent(session, pool, made)
    return result


def _allowed(session: Session, pools: Sequence[Pool], now: datetime) -> dict[str, int]:
    """How many warm sandboxes each pool may keep now: what it wants, none while its org's
    or its own budget is spent, and no more across an org's pools than the org's limit on
    work in flight (pools in id order take theirs first)."""
    orgs = sorted({pool.org_id for pool in pools})
    spent = set()
    for state in budgets.states(session, orgs, max_age_s=0):
        if state.exhausted:
            spent.add(state.budget.pool_id or state.budget.org_id)
    rows = session.execute(
        select(OrgLimit.org_id, OrgLimit.max_concurrent).where(OrgLimit.org_id.in_(orgs))
    )
    limits = {org_id: int(limit) for org_id, limit in rows}
    wants = {}
    for pool in pools:
        want = 0 if {pool.org_id, pool.id} & spent else wanted(pool, now)
        if pool.org_id in limits:
            want = min(want, limits[pool.org_id])
            limits[pool.org_id] -= want
        wants[pool.id] = want
    return wants


def _refill(session: Session, pool: Pool, want: int, now: datetime) -> list[tuple[str, str]]:
    if want == 0:
        return []
    live = session.scalar(
        select(func.count())
        .select_from(WarmSandbox)
        .where(WarmSandbox.pool_id == pool.id, WarmSandbox.state.in_([BOOTING, WAITING]))
    )
    made = []
    for _ in range(want - int(live or 0)):
        warm_id = new_warm_id()
        session.add(
            WarmSandbox(
                id=warm_id,
                pool_id=pool.id,
                org_id=pool.org_id,
                provider_id=pool.provider_id,
                state=BOOTING,
                handle_metadata={},
                created_at=now,
            )
        )
        made.append((warm_id, provision_queue(pool.provider_id, gpu=False)))
    return made


def _unsent(session: Session, pool: Pool, made: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """The pool's booting rows (but those just ``made``) that no provider worker took (no
    enrolment minted) and whose provision task was never noted as sent."""
    rows = session.execute(
        select(WarmSandbox.id, WarmSandbox.provider_id)
        .where(
            WarmSandbox.pool_id == pool.id,
            WarmSandbox.state == BOOTING,
            WarmSandbox.enrol_hash.is_(None),
            WarmSandbox.sent_at.is_(None),
            WarmSandbox.id.not_in([warm_id for warm_id, _ in made]),
        )
        .order_by(WarmSandbox.created_at, WarmSandbox.id)
    )
    return [(warm_id, provision_queue(provider_id, gpu=False)) for warm_id, provider_id in rows]


def mark_sent(db: Database, warm_ids: Sequence[str]) -> None:
    """Note that the provision tasks of ``warm_ids`` were sent. Until then the next tick
    sends them again: a task may arrive twice, and the second delivery does nothing."""
    if not warm_ids:
        return
    with db.session() as session:
        session.execute(
            update(WarmSandbox)
            .where(WarmSandbox.id.in_(list(warm_ids)), WarmSandbox.sent_at.is_(None))
            .values(sent_at=utcnow())
            .execution_options(synchronize_session=False)
        )


def take_for_provision(db: Database, warm_id: str) -> tuple[WarmSandbox, Pool, str] | None:
    """The row to make, its pool and a new enrolment credential (its hash stored, once: a
    second delivery of the same task finds the hash set and does nothing)."""
    enrolment = new_token(ENROLMENT_PREFIX)
    with db.session() as session:
        changed = session.execute(
            update(WarmSandbox)
            .where(
                WarmSandbox.id == warm_id,
                WarmSandbox.state == BOOTING,
                WarmSandbox.enrol_hash.is_(None),
            )
            .values(enrol_hash=hash_token(enrolment))
            .execution_options(synchronize_session=False)
        )
        if _changed(changed) != 1:
            return None
        warm = session.get(WarmSandbox, warm_id)
        assert warm is not None
        pool = session.get(Pool, warm.pool_id)
        assert pool is not None
        # Made with the pool's settings as they are now: a later change retires it unbound.
        warm.config_digest = config_digest(pool)
        session.flush()
        session.expunge_all()
    return warm, pool, enrolment


def fail_boot(db: Database, warm_id: str, reason: str) -> None:
    """A warm sandbox that could not be made ends (beat makes another)."""
    with db.session() as session:
        warm = session.get(WarmSandbox, warm_id)
        pool = session.get(Pool, warm.pool_id) if warm is not None else None
        if warm is not None and pool is not None:
            end_warm(session, warm, pool, reason)
