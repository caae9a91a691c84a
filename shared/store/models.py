"""The tables of the system of record (docs/architecture.md §8).

Every state change of a work item or sandbox goes through
:func:`corral.shared.store.lifecycle.transition`, which also appends a :class:`LifecycleEvent`;
nothing updates ``state`` or ``status`` by hand. Indexes follow the queries the scheduler,
workers and reaper run, so that their cost grows with the rows they are after, not with
everything stored.
"""

from __future__ import annotations

import enum
from datetime import datetime
from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    Float,
    ForeignKey,
    Index,
    Integer,
    LargeBinary,
    String,
    Text,
    UniqueConstraint,
    text,
)
from sqlalchemy.orm import Mapped, mapped_column

from corral.shared.store.db import Base, UTCDateTime, utcnow
from corral.shared.store.kinds import FINAL_ITEM_STATES, AuthMode, BundleReview, ItemState

# Re-exported (with the rows defined here): their enumerations, defined without SQLAlchemy.
__all__ = ["FINAL_ITEM_STATES", "AuthMode", "BundleReview", "ItemState"]

# Autoincrementing keys: BIGINT on PostgreSQL, INTEGER (the rowid) on SQLite.
BigId = BigInteger().with_variant(Integer, "sqlite")
ID_LENGTH = 63


# States in which an item holds a slot of its pool.
SLOT_HOLDING_STATES = frozenset(
    {ItemState.ROUTED, ItemState.PROVISIONING, ItemState.AWAITING_CLAIM, ItemState.RUNNING}
)


class TerminationReason(enum.StrEnum):
    """Why a sandbox ended: the reaper's rules (docs/architecture.md §6) and the normal paths."""

    FINISHED = "finished"  # its work item ended (the normal path, or the reaper's backstop)
    CANCELLED = "cancelled"
    DEADLINE = "deadline"
    HEARTBEAT_LOST = "heartbeat_lost"
    PROVISION_STUCK = "provision_stuck"
    NEVER_CLAIMED = "never_claimed"
    ORPHAN = "orphan"
    GONE = "gone"  # the provider no longer has it: marked ended, nothing to kill
    # The provider could not make it: the item goes to the next qualifying pool, or fails.
    PROVISION_FAILED = "provision_failed"
    # The provider failed transiently past the provision task's retries (a brown-out): the
    # item waits to be routed again, to this pool too once its breaker lets work through.
    PROVISION_UNAVAILABLE = "provision_unavailable"
    LOST = "sandbox_lost"  # it ended at the provider before its work reported
    # An interactive session's sandbox (docs/sessions.md): closed by its caller, idle past
    # its idle_ttl_s, or past its total ttl_s.
    SESSION_CLOSED = "session_closed"
    SESSION_IDLE = "session_idle"
    SESSION_EXPIRED = "session_expired"
    # Its org's (or pool's) budget with ``on_cap: stop`` is spent (the reaper; the item fails).
    BUDGET_EXHAUSTED = "budget_exhausted"


# Live sandboxes (not yet ended), the predicate of the reaper's partial indexes.
_LIVE = text("terminated_at IS NULL")
_WARM_BOUND_TO = text("sandbox_id IS NOT NULL")
_WARM_BOUND_AT = text("bound_at IS NOT NULL")
_WARM_ENDED_UNBOUND = text("bound_at IS NULL AND ended_at IS NOT NULL")
_COST_DUE = text("cost_due_at IS NOT NULL")
# The items that carry their own expiry and have not finished: what the expiry rule reads.
_EXPIRING = text("expires_at IS NOT NULL AND finished_at IS NULL")
_WAITING = text("state = 'waiting_capacity'")


class ModelProfile(Base):
    """A named model and the auth mode its credentials use."""

    __tablename__ = "model_profiles"

    name: Mapped[str] = mapped_column(String(ID_LENGTH), primary_key=True)
    model: Mapped[str] = mapped_column(String(255))
    auth_mode: Mapped[str] = mapped_column(String(32))
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)


class Pool(Base):
    """Capacity of one provider for one org, with its priority, limits and rate card."""

    __tablename__ = "pools"
    __table_args__ = (
        UniqueConstraint("org_id", "name"),
        Index("ix_pools_org_active", "org_id", "active", "priority"),
        Index("ix_pools_capacity", "capacity_id"),
    )

    id: Mapped[str] = mapped_column(String(ID_LENGTH), primary_key=True)
    org_id: Mapped[str] = mapped_column(String(ID_LENGTH))
    provider_id: Mapped[str] = mapped_column(String(ID_LENGTH))
    name: Mapped[str] = mapped_column(String(ID_LENGTH))
    priority: Mapped[int] = mapped_column(Integer, default=0)
    active: Mapped[bool] = mapped_column(Boolean, default=True)
    max_concurrent: Mapped[int] = mapped_column(Integer)
    # The most max_concurrent an org key may set (the deployment sets it, and max_concurrent
    # above it; null on a pool made before there was one: its max_concurrent is the ceiling).
    max_concurrent_ceiling: Mapped[int | None] = mapped_column(Integer, nullable=True)
    runtime_provides: Mapped[dict[str, Any] | None] = mapped_column(JSON, nullable=True)
    capabilities: Mapped[dict[str, Any] | None] = mapped_column(JSON, nullable=True)
    sandbox_config: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)
    billing_model: Mapped[str | None] = mapped_column(String(32), nullable=True)
    rate_micros: Mapped[int] = mapped_column(BigInteger, default=0)
    # Slots held by its items (corral.shared.store.slots): changed with the items, reconciled by the
    # reaper.
    slots_in_use: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    # Set when an operator deletes it: the row stays (its items, sandboxes and cost events
    # refer to it), inactive and out of every list, its name freed for a new pool.
    deleted_at: Mapped[datetime | None] = mapped_column(UTCDateTime, nullable=True)
    # The circuit breaker (corral.shared.store.breaker): closed, open or half_open; the consecutive
    # provision failures counted toward opening it, the last one's time, when it opened and
    # when its half-open probe was routed.
    breaker_state: Mapped[str] = mapped_column(
        String(16), default="closed", server_default="closed"
    )
    breaker_failures: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    breaker_failed_at: Mapped[datetime | None] = mapped_column(UTCDateTime, nullable=True)
    breaker_opened_at: Mapped[datetime | None] = mapped_column(UTCDateTime, nullable=True)
    breaker_probe_at: Mapped[datetime | None] = mapped_column(UTCDateTime, nullable=True)
    # The pool's default lease policy (corral.shared.store.leases.LeaseSpec, the fields it sets):
    # what its items get for the fields their message leaves out.
    lease: Mapped[dict[str, Any] | None] = mapped_column(JSON, nullable=True)
    # Warm sandboxes (corral.shared.store.warm, docs/warm-pools.md): how many idle ones beat keeps
    # ready, and how long one may wait unbound.
    warm_min: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    warm_idle_ttl_s: Mapped[int] = mapped_column(Integer, default=600, server_default="600")
    # Windows of the week (UTC) with a warm_min of their own (corral.shared.store.warm.WarmWindow).
    warm_schedule: Mapped[list[dict[str, Any]] | None] = mapped_column(JSON, nullable=True)
    # How long an item may stay routed here while no worker consumes the pool's queue
    # before it fails as ``no_worker``; null: the deployment's CORRAL_ROUTED_TTL_S.
    routed_ttl_s: Mapped[int | None] = mapped_column(Integer, nullable=True)
    # A shared capacity this pool draws on (corral.shared.store.shares), or null. Its share
    # of the capacity: the most slots it may hold now, set by the re-drive's fair division
    # and lowered with every slot it gives back (null: not on a capacity, no share).
    capacity_id: Mapped[str | None] = mapped_column(
        String(ID_LENGTH), ForeignKey("capacities.id", name="fk_pools_capacity_id"), nullable=True
    )
    share_limit: Mapped[int | None] = mapped_column(Integer, nullable=True)


class WorkItem(Base):
    """One dispatched piece of work and where it is."""

    __tablename__ = "work_items"
    __table_args__ = (
        UniqueConstraint("org_id", "idempotency_key", name="uq_work_items_idempotency"),
        Index("ix_work_items_pool_state", "pool_id", "state"),
        Index("ix_work_items_state_updated", "state", "updated_at"),
        # Newest first: the console's item list and its dispatch rate (migration 0015).
        Index("ix_work_items_created", "created_at", "id"),
        # The item a Celery message made, by the message's task id.
        Index("ix_work_items_task_id", "task_id"),
        # The items that carry their own expiry (migration 0028).
        Index(
            "ix_work_items_expires",
            "expires_at",
            postgresql_where=_EXPIRING,
            sqlite_where=_EXPIRING,
        ),
        # An org's waiting items in admission order (migration 0032): the re-drive reads the
        # first few of an org with room, whatever waits behind them.
        Index(
            "ix_work_items_waiting_queue",
            "org_id",
            "queue_key",
            postgresql_where=_WAITING,
            sqlite_where=_WAITING,
        ),
        # Each project's first waiting item, and the org's projects with waiting items,
        # each an index probe (migration 0034): an org's projects take turns.
        Index(
            "ix_work_items_waiting_project",
            "org_id",
            "project_id",
            "queue_key",
            postgresql_where=_WAITING,
            sqlite_where=_WAITING,
        ),
    )

    id: Mapped[str] = mapped_column(String(ID_LENGTH), primary_key=True)
    org_id: Mapped[str] = mapped_column(String(ID_LENGTH))
    project_id: Mapped[str] = mapped_column(String(ID_LENGTH))
    idempotency_key: Mapped[str | None] = mapped_column(String(255), nullable=True)
    profile: Mapped[str | None] = mapped_column(String(ID_LENGTH), nullable=True)
    payload: Mapped[dict[str, Any]] = mapped_column(JSON)
    state: Mapped[str] = mapped_column(String(32))
    pool_id: Mapped[str | None] = mapped_column(
        String(ID_LENGTH), ForeignKey("pools.id"), nullable=True
    )
    queue: Mapped[str | None] = mapped_column(String(255), nullable=True)
    attempts: Mapped[int] = mapped_column(Integer, default=0)
    error_code: Mapped[str | None] = mapped_column(String(64), nullable=True)
    error_message: Mapped[str | None] = mapped_column(Text, nullable=True)
    exit_code: Mapped[int | None] = mapped_column(Integer, nullable=True)
    result: Mapped[Any] = mapped_column(JSON, nullable=True)
    duration_s: Mapped[float | None] = mapped_column(Float, nullable=True)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    updated_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    routed_at: Mapped[datetime | None] = mapped_column(UTCDateTime, nullable=True)
    provisioned_at: Mapped[datetime | None] = mapped_column(UTCDateTime, nullable=True)
    claimed_at: Mapped[datetime | None] = mapped_column(UTCDateTime, nullable=True)
    finished_at: Mapped[datetime | None] = mapped_column(UTCDateTime, nullable=True)
    # What its runners logged so far, and the lines dropped past the log budget
    # (CORRAL_LOG_BUDGET_BYTES / _LINES); kept here so a logs call need not count the rows.
    log_bytes: Mapped[int] = mapped_column(BigInteger, default=0, server_default="0")
    log_lines: Mapped[int] = mapped_column(BigInteger, default=0, server_default="0")
    log_dropped_lines: Mapped[int] = mapped_column(BigInteger, default=0, server_default="0")
    # The lease policy in force (corral.shared.store.leases.Lease), resolved when it was first
    # routed; null: the deployment's defaults. A requeued item is not routed again before
    # ``not_before`` (its back-off).
    lease: Mapped[dict[str, Any] | None] = mapped_column(JSON, nullable=True)
    not_before: Mapped[datetime | None] = mapped_column(UTCDateTime, nullable=True)
    # The Celery task id of the message that made it (null over HTTP), and the replies its
    # end owes: one per message that named it, each a task id with the message's link and
    # link_error callbacks (corral.shared.broker.callbacks.Reply); null when no result
    # backend was configured. Its end writes one outbox row per reply.
    task_id: Mapped[str | None] = mapped_column(String(255), nullable=True)
    replies: Mapped[list[dict[str, Any]] | None] = mapped_column(JSON, nullable=True)
    # The message's own expiry: not final by then, the item fails as ``expired``.
    expires_at: Mapped[datetime | None] = mapped_column(UTCDateTime, nullable=True)
    # Admission (scheduler/admission.py): its place among the org's waiting items (when it
    # began waiting, less its priority's head start), what holds it and the pools it waits
    # for (ids; empty: its org's limit across pools).
    queue_key: Mapped[datetime | None] = mapped_column(UTCDateTime, nullable=True)
    wait_reason: Mapped[str | None] = mapped_column(String(32), nullable=True)
    wait_pools: Mapped[list[str] | None] = mapped_column(JSON, nullable=True)


class Sandbox(Base):
    """One sandbox made for one attempt of a work item."""

    __tablename__ = "sandboxes"
    __table_args__ = (
        UniqueConstraint("work_item_id", "attempt", name="uq_sandboxes_item_attempt"),
        # One index per reaper rule, each a range over the stale end only, so that a sweep
        # reads the stale sandboxes and not every live one (docs/benchmarks.md).
        Index("ix_sandboxes_status_created", "status", "created_at"),
        Index("ix_sandboxes_status_started", "status", "started_at"),
        Index("ix_sandboxes_status_heartbeat", "status", "last_heartbeat_at"),
        Index(
            "ix_sandboxes_live_deadline", "deadline_at", postgresql_where=_LIVE, sqlite_where=_LIVE
        ),
        Index(
            "ix_sandboxes_live_end_requested",
            "end_requested_at",
            postgresql_where=_LIVE,
            sqlite_where=_LIVE,
        ),
        Index(
            "ix_sandboxes_live_provider", "provider_id", postgresql_where=_LIVE, sqlite_where=_LIVE
        ),
        Index("ix_sandboxes_live_org", "org_id", postgresql_where=_LIVE, sqlite_where=_LIVE),
        Index(
            "ix_sandboxes_cost_due",
            "cost_due_at",
            postgresql_where=_COST_DUE,
            sqlite_where=_COST_DUE,
        ),
    )

    id: Mapped[str] = mapped_column(String(ID_LENGTH), primary_key=True)
    work_item_id: Mapped[str] = mapped_column(String(ID_LENGTH), ForeignKey("work_items.id"))
    attempt: Mapped[int] = mapped_column(Integer)
    org_id: Mapped[str] = mapped_column(String(ID_LENGTH))
    pool_id: Mapped[str] = mapped_column(String(ID_LENGTH), ForeignKey("pools.id"))
    provider_id: Mapped[str] = mapped_column(String(ID_LENGTH))
    external_id: Mapped[str | None] = mapped_column(String(255), nullable=True)
    handle_metadata: Mapped[dict[str, Any]] = mapped_column("metadata", JSON, default=dict)
    status: Mapped[str] = mapped_column(String(32))
    lease_until: Mapped[datetime | None] = mapped_column(UTCDateTime, nullable=True)
    # Which try of which provision task holds the lease (worker.claims.Delivery.holder).
    lease_holder: Mapped[str | None] = mapped_column(String(64), nullable=True)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    started_at: Mapped[datetime | None] = mapped_column(UTCDateTime, nullable=True)
    deadline_at: Mapped[datetime | None] = mapped_column(UTCDateTime, nullable=True)
    last_heartbeat_at: Mapped[datetime | None] = mapped_column(UTCDateTime, nullable=True)
    terminated_at: Mapped[datetime | None] = mapped_column(UTCDateTime, nullable=True)
    termination_reason: Mapped[str | None] = mapped_column(Text, nullable=True)
    # The provider's own log of it (bounded, redacted, the last lines), kept when it ended
    # before its runner reported: why it never claimed, or died.
    end_log: Mapped[str | None] = mapped_column(Text, nullable=True)
    # Set when its work item ends: from then on the sandbox should go (reaper rule finished).
    end_requested_at: Mapped[datetime | None] = mapped_column(UTCDateTime, nullable=True)
    # Set when it ends, cleared when its cost event is written: what the ledger still owes.
    cost_due_at: Mapped[datetime | None] = mapped_column(UTCDateTime, nullable=True)
    # CPU seconds the provider reported just before it ended (providers that report usage).
    cpu_seconds: Mapped[float | None] = mapped_column(Float, nullable=True)


class WarmState(enum.StrEnum):
    """Where a warm sandbox is (docs/warm-pools.md)."""

    BOOTING = "booting"  # being made, or made and its runner not yet enrolled
    WAITING = "waiting"  # made and enrolled: its runner waits on its channel for an item
    BOUND = "bound"  # given to one work item (final here: the item's sandbox row takes over)
    ENDED = "ended"  # ended unbound (idle TTL, stuck, surplus)


class WarmSandbox(Base):
    """A sandbox made ahead of any work item, its runner holding only a pool-scoped,
    single-use enrolment credential (stored as its SHA-256), and what became of it."""

    __tablename__ = "warm_sandboxes"
    __table_args__ = (
        Index("ix_warm_sandboxes_pool_state", "pool_id", "state", "created_at"),
        # The bound ones' item sandboxes, which the reaper and a takeover look up: their
        # reads do not grow with the rows of every warm sandbox ever made.
        Index(
            "ix_warm_sandboxes_sandbox",
            "sandbox_id",
            postgresql_where=_WARM_BOUND_TO,
            sqlite_where=_WARM_BOUND_TO,
        ),
        # When each one's billed idle time ended (bound, or ended unbound), by org: budgets
        # and cost reports read a period's rows, not every warm sandbox ever made.
        Index(
            "ix_warm_sandboxes_org_bound",
            "org_id",
            "bound_at",
            postgresql_where=_WARM_BOUND_AT,
            sqlite_where=_WARM_BOUND_AT,
        ),
        Index(
            "ix_warm_sandboxes_org_ended_unbound",
            "org_id",
            "ended_at",
            postgresql_where=_WARM_ENDED_UNBOUND,
            sqlite_where=_WARM_ENDED_UNBOUND,
        ),
    )

    id: Mapped[str] = mapped_column(String(ID_LENGTH), primary_key=True)
    pool_id: Mapped[str] = mapped_column(String(ID_LENGTH), ForeignKey("pools.id"))
    org_id: Mapped[str] = mapped_column(String(ID_LENGTH))
    provider_id: Mapped[str] = mapped_column(String(ID_LENGTH))
    state: Mapped[str] = mapped_column(String(16))
    external_id: Mapped[str | None] = mapped_column(String(255), nullable=True)
    handle_metadata: Mapped[dict[str, Any]] = mapped_column("metadata", JSON, default=dict)
    enrol_hash: Mapped[str | None] = mapped_column(String(64), unique=True, nullable=True)
    enrolled_at: Mapped[datetime | None] = mapped_column(UTCDateTime, nullable=True)
    channel_hash: Mapped[str | None] = mapped_column(String(64), unique=True, nullable=True)
    # The pool's settings it was made with (corral.shared.store.warm.config_digest): bound only
    # while the pool still has them.
    config_digest: Mapped[str | None] = mapped_column(String(64), nullable=True)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    # When beat's tick sent its provision task (after the commit that wrote the row): a
    # booting row no worker took and whose send was never noted gets it from the next tick.
    sent_at: Mapped[datetime | None] = mapped_column(UTCDateTime, nullable=True)
    ready_at: Mapped[datetime | None] = mapped_column(UTCDateTime, nullable=True)
    # When its runner last called (enrol, or the start of a wait): one that stops calling
    # is not bound, and is ended (runner_lost).
    last_seen_at: Mapped[datetime | None] = mapped_column(UTCDateTime, nullable=True)
    # Bound: the item and its sandbox row (whose handle is this sandbox's), and when the
    # item's registration token went down the channel (once).
    work_item_id: Mapped[str | None] = mapped_column(String(ID_LENGTH), nullable=True)
    sandbox_id: Mapped[str | None] = mapped_column(String(ID_LENGTH), nullable=True)
    bound_at: Mapped[datetime | None] = mapped_column(UTCDateTime, nullable=True)
    handed_over_at: Mapped[datetime | None] = mapped_column(UTCDateTime, nullable=True)
    ended_at: Mapped[datetime | None] = mapped_column(UTCDateTime, nullable=True)
    end_reason: Mapped[str | None] = mapped_column(String(64), nullable=True)
    # Its idle time (made to bound or ended) and what it cost, written once as it leaves
    # booting or waiting.
    idle_seconds: Mapped[float | None] = mapped_column(Float, nullable=True)
    idle_amount_micros: Mapped[int | None] = mapped_column(BigInteger, nullable=True)


class RegistrationToken(Base):
    """A one-time registration token, stored as its SHA-256 only."""

    __tablename__ = "registration_tokens"

    id: Mapped[int] = mapped_column(BigId, primary_key=True, autoincrement=True)
    token_hash: Mapped[str] = mapped_column(String(64), unique=True)
    sandbox_id: Mapped[str] = mapped_column(
        String(ID_LENGTH), ForeignKey("sandboxes.id"), index=True
    )
    work_item_id: Mapped[str] = mapped_column(String(ID_LENGTH))
    expires_at: Mapped[datetime] = mapped_column(UTCDateTime)
    redeemed_at: Mapped[datetime | None] = mapped_column(UTCDateTime, nullable=True)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)


class RunnerSession(Base):
    """What a redeemed registration token became: a runner's bearer for its own sandbox."""

    __tablename__ = "runner_sessions"

    id: Mapped[int] = mapped_column(BigId, primary_key=True, autoincrement=True)
    session_hash: Mapped[str] = mapped_column(String(64), unique=True)
    sandbox_id: Mapped[str] = mapped_column(
        String(ID_LENGTH), ForeignKey("sandboxes.id"), index=True
    )
    work_item_id: Mapped[str] = mapped_column(String(ID_LENGTH))
    org_id: Mapped[str] = mapped_column(String(ID_LENGTH))
    expires_at: Mapped[datetime] = mapped_column(UTCDateTime)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)


class CostEvent(Base):
    """The cost of one sandbox; the unique key makes it exactly one.

    ``amount_micros`` is in millionths of the rate card's currency unit. ``cpu_estimated``
    says an active-cpu pool was billed by wall-clock because its provider reports no usage.
    """

    __tablename__ = "cost_events"
    __table_args__ = (Index("ix_cost_events_org_ended", "org_id", "ended_at"),)

    id: Mapped[int] = mapped_column(BigId, primary_key=True, autoincrement=True)
    sandbox_id: Mapped[str] = mapped_column(
        String(ID_LENGTH), ForeignKey("sandboxes.id"), unique=True
    )
    work_item_id: Mapped[str] = mapped_column(String(ID_LENGTH))
    org_id: Mapped[str] = mapped_column(String(ID_LENGTH))
    project_id: Mapped[str] = mapped_column(String(ID_LENGTH))
    pool_id: Mapped[str] = mapped_column(String(ID_LENGTH))
    provider_id: Mapped[str] = mapped_column(String(ID_LENGTH))
    started_at: Mapped[datetime] = mapped_column(UTCDateTime)
    ended_at: Mapped[datetime] = mapped_column(UTCDateTime, index=True)
    seconds: Mapped[float] = mapped_column(Float)
    billing_model: Mapped[str] = mapped_column(String(32))
    rate_micros: Mapped[int] = mapped_column(BigInteger, server_default="0")
    cpu_seconds: Mapped[float | None] = mapped_column(Float, nullable=True)
    cpu_estimated: Mapped[bool] = mapped_column(Boolean, server_default=text("false"))
    termination_reason: Mapped[str | None] = mapped_column(Text, nullable=True)
    amount_micros: Mapped[int] = mapped_column(BigInteger)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)


class LifecycleEvent(Base):
    """Append-only audit: one row per state change, saying who did what and when."""

    __tablename__ = "lifecycle_events"
    __table_args__ = (Index("ix_lifecycle_events_item", "work_item_id", "id"),)

    id: Mapped[int] = mapped_column(BigId, primary_key=True, autoincrement=True)
    entity: Mapped[str] = mapped_column(String(32))
    entity_id: Mapped[str] = mapped_column(String(ID_LENGTH))
    work_item_id: Mapped[str | None] = mapped_column(String(ID_LENGTH), nullable=True)
    from_state: Mapped[str | None] = mapped_column(String(32), nullable=True)
    to_state: Mapped[str] = mapped_column(String(32))
    actor: Mapped[str] = mapped_column(String(64))
    detail: Mapped[str | None] = mapped_column(Text, nullable=True)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)


_UNDELIVERED = text("failed_at IS NULL")


class OutcomeOutbox(Base):
    """An outcome owed to someone, written in the transaction of the change that owes it
    (corral.shared.store.outbox), deleted once delivered: an ended work item's reply or
    event, a sandbox's end, a budget's crossed threshold.

    ``sink`` names who delivers it (``celery``: a result stored under a task id and its
    callbacks sent; ``webhook``: an event POSTed to an org's endpoint); ``target`` is that
    sink's address (for ``celery``, a reply; for ``webhook``, the endpoint and the event).
    ``work_item_id`` is null for what no item owes (a budget's threshold). A row not
    delivered is tried again from ``due_at`` on; one given up keeps ``failed_at``.
    """

    __tablename__ = "outcome_outbox"
    __table_args__ = (
        Index(
            "ix_outcome_outbox_due",
            "due_at",
            postgresql_where=_UNDELIVERED,
            sqlite_where=_UNDELIVERED,
        ),
        Index("ix_outcome_outbox_item", "work_item_id"),
    )

    id: Mapped[int] = mapped_column(BigId, primary_key=True, autoincrement=True)
    work_item_id: Mapped[str | None] = mapped_column(
        String(ID_LENGTH), ForeignKey("work_items.id"), nullable=True
    )
    org_id: Mapped[str] = mapped_column(String(ID_LENGTH))
    sink: Mapped[str] = mapped_column(String(32))
    target: Mapped[dict[str, Any]] = mapped_column(JSON)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime)
    due_at: Mapped[datetime] = mapped_column(UTCDateTime)
    attempts: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    last_error: Mapped[str | None] = mapped_column(Text, nullable=True)
    failed_at: Mapped[datetime | None] = mapped_column(UTCDateTime, nullable=True)


class WorkItemLog(Base):
    """Output lines a runner streamed for its work item."""

    __tablename__ = "work_item_logs"
    __table_args__ = (Index("ix_work_item_logs_item", "work_item_id", "id"),)

    id: Mapped[int] = mapped_column(BigId, primary_key=True, autoincrement=True)
    work_item_id: Mapped[str] = mapped_column(String(ID_LENGTH), ForeignKey("work_items.id"))
    stream: Mapped[str] = mapped_column(String(16))
    line: Mapped[str] = mapped_column(Text)
    logged_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)


class ProviderCredential(Base):
    """An org's credential for one provider, encrypted with the deployment's secret key."""

    __tablename__ = "provider_credentials"
    __table_args__ = (UniqueConstraint("org_id", "provider_id"),)

    id: Mapped[int] = mapped_column(primary_key=True)
    org_id: Mapped[str] = mapped_column(String(ID_LENGTH))
    provider_id: Mapped[str] = mapped_column(String(ID_LENGTH))
    ciphertext: Mapped[bytes] = mapped_column(LargeBinary)
    updated_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)


class StoredProviderConfig(Base):
    """The deployment's configuration of one provider, set by an operator (admin api or
    ``corral providers config set``); it replaces that provider's ``CORRAL_PROVIDER_CONFIG``
    entry in every process within ``CORRAL_PROVIDER_CONFIG_REFRESH_S``."""

    __tablename__ = "provider_configs"

    provider_id: Mapped[str] = mapped_column(String(ID_LENGTH), primary_key=True)
    config: Mapped[dict[str, Any]] = mapped_column(JSON)
    updated_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)


class WorkItemBundle(Base):
    """The result bundle of a work item: small ones in ``data``, larger ones in the bundle
    store (``store`` and ``location``), and where its review stands."""

    __tablename__ = "work_item_bundles"

    work_item_id: Mapped[str] = mapped_column(
        String(ID_LENGTH), ForeignKey("work_items.id"), primary_key=True
    )
    org_id: Mapped[str] = mapped_column(String(ID_LENGTH))
    size_bytes: Mapped[int] = mapped_column(BigInteger)
    content_bytes: Mapped[int] = mapped_column(BigInteger)
    sha256: Mapped[str] = mapped_column(String(64))
    changes: Mapped[int] = mapped_column(Integer)
    refused: Mapped[int] = mapped_column(Integer)
    store: Mapped[str] = mapped_column(String(16))
    location: Mapped[str | None] = mapped_column(Text, nullable=True)
    data: Mapped[bytes | None] = mapped_column(LargeBinary, nullable=True)
    review: Mapped[str] = mapped_column(String(32))
    reviewed_by: Mapped[str | None] = mapped_column(String(64), nullable=True)
    reviewed_at: Mapped[datetime | None] = mapped_column(UTCDateTime, nullable=True)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)


class DeadLetter(Base):
    """A broker message that could not be read as a task, kept as a record of its shape.

    The body is never stored (it may carry a dispatch's env values): what arrived where, how
    big it was, its digest (to tell repeats apart) and why it was refused.
    """

    __tablename__ = "dead_letters"
    __table_args__ = (Index("ix_dead_letters_received", "received_at"),)

    id: Mapped[int] = mapped_column(BigId, primary_key=True, autoincrement=True)
    queue: Mapped[str] = mapped_column(String(255))
    reason: Mapped[str] = mapped_column(String(64))
    detail: Mapped[str] = mapped_column(Text)
    size_bytes: Mapped[int] = mapped_column(BigInteger)
    sha256: Mapped[str] = mapped_column(String(64))
    task_name: Mapped[str | None] = mapped_column(String(255), nullable=True)
    task_id: Mapped[str | None] = mapped_column(String(255), nullable=True)
    received_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)


class MaintenanceClock(Base):
    """When each of the reaper's less frequent phases last ran, shared by every maintenance
    worker (corral.worker.sweep_lock)."""

    __tablename__ = "maintenance_clock"

    phase: Mapped[str] = mapped_column(String(64), primary_key=True)
    last_run_at: Mapped[datetime] = mapped_column(UTCDateTime)


class RoutingConfigVersion(Base):
    """One row: the version of what routing reads of the configuration, bumped on PostgreSQL
    by triggers with every change of it (migration 0018; corral.scheduler.routing_cache)."""

    __tablename__ = "routing_config_version"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=False)
    version: Mapped[int] = mapped_column(BigInteger)


class BudgetOwner(enum.StrEnum):
    """Who set a budget: the deployment (the admin token, the CLI) or the org (its admin key)."""

    DEPLOYMENT = "deployment"
    ORG = "org"


class OnCap(enum.StrEnum):
    """What a spent budget does: refuse new work, or also stop the running sandboxes."""

    REFUSE = "refuse"
    STOP = "stop"


_ORG_WIDE = text("pool_id IS NULL")
_OF_POOL = text("pool_id IS NOT NULL")


class Budget(Base):
    """A spend cap: an org's (``pool_id`` null) or one pool's, over a calendar period (UTC),
    in micro-units of the rate cards' currency (corral.shared.store.budgets).

    One per org or pool, period and owner (``set_by``): the deployment's and the org's own
    apply side by side, the strictest wins. ``thresholds`` (percentages; null: 50, 80, 100)
    are warned of once per period: ``warned_pct`` is the highest warned of in the period
    that began at ``warned_period_start``."""

    __tablename__ = "budgets"
    __table_args__ = (
        Index("ix_budgets_org", "org_id"),
        Index(
            "ux_budgets_org_scope",
            "org_id",
            "period",
            "set_by",
            unique=True,
            postgresql_where=_ORG_WIDE,
            sqlite_where=_ORG_WIDE,
        ),
        Index(
            "ux_budgets_pool_scope",
            "pool_id",
            "period",
            "set_by",
            unique=True,
            postgresql_where=_OF_POOL,
            sqlite_where=_OF_POOL,
        ),
    )

    id: Mapped[str] = mapped_column(String(ID_LENGTH), primary_key=True)
    org_id: Mapped[str] = mapped_column(String(ID_LENGTH))
    pool_id: Mapped[str | None] = mapped_column(
        String(ID_LENGTH), ForeignKey("pools.id"), nullable=True
    )
    period: Mapped[str] = mapped_column(String(16))
    cap_micros: Mapped[int] = mapped_column(BigInteger)
    set_by: Mapped[str] = mapped_column(
        String(16), default=BudgetOwner.DEPLOYMENT.value, server_default="deployment"
    )
    on_cap: Mapped[str] = mapped_column(
        String(16), default=OnCap.REFUSE.value, server_default="refuse"
    )
    thresholds: Mapped[list[int] | None] = mapped_column(JSON, nullable=True)
    warned_pct: Mapped[int | None] = mapped_column(Integer, nullable=True)
    warned_period_start: Mapped[datetime | None] = mapped_column(UTCDateTime, nullable=True)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)


class QueueConsumer(Base):
    """A process consuming a queue, as it last said (a Celery worker every few seconds, the
    scheduler's intake after each round of its loop): the api's metrics count the recent
    ones per queue (corral.shared.store.liveness)."""

    __tablename__ = "queue_consumers"

    queue: Mapped[str] = mapped_column(String(255), primary_key=True)
    consumer_id: Mapped[str] = mapped_column(String(255), primary_key=True)
    seen_at: Mapped[datetime] = mapped_column(UTCDateTime)


class ApiKey(Base):
    """An org's api key: ``cok_`` + 32 random bytes, stored as its SHA-256 only, with the
    scopes it holds (``dispatch``, ``read``, ``review``, ``admin``, comma-separated). A
    revoked key keeps its row (``revoked_at``) so that its use can still be explained."""

    __tablename__ = "api_keys"
    __table_args__ = (Index("ix_api_keys_org", "org_id"),)

    id: Mapped[str] = mapped_column(String(ID_LENGTH), primary_key=True)
    org_id: Mapped[str] = mapped_column(String(ID_LENGTH))
    name: Mapped[str] = mapped_column(String(100))
    scopes: Mapped[str] = mapped_column(String(64))
    key_hash: Mapped[str] = mapped_column(String(64), unique=True)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    revoked_at: Mapped[datetime | None] = mapped_column(UTCDateTime, nullable=True)


class ConsoleSessionRecord(Base):
    """A browser's console session (corral.shared.store.console_sessions), kept server-side.

    The cookie carries a random session id; this row holds its SHA-256 only. Its principal
    is an org key (``api_key_id`` and its org) or, with ``api_key_id`` null, the deployment
    admin, bound to the admin token it logged in with by ``admin_check`` (an HMAC of the
    token keyed by the session id, which the table does not hold). Logging out sets
    ``revoked_at``."""

    __tablename__ = "console_sessions"
    __table_args__ = (
        Index("ix_console_sessions_expires", "expires_at"),
        Index("ix_console_sessions_key", "api_key_id"),
    )

    id_hash: Mapped[str] = mapped_column(String(64), primary_key=True)
    api_key_id: Mapped[str | None] = mapped_column(String(ID_LENGTH), nullable=True)
    org_id: Mapped[str | None] = mapped_column(String(ID_LENGTH), nullable=True)
    admin_check: Mapped[str | None] = mapped_column(String(64), nullable=True)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime)
    expires_at: Mapped[datetime] = mapped_column(UTCDateTime)
    last_seen_at: Mapped[datetime] = mapped_column(UTCDateTime)
    revoked_at: Mapped[datetime | None] = mapped_column(UTCDateTime, nullable=True)


class OrgPolicy(Base):
    """What the deployment lets an org's work ask for (corral.shared.store.org_policies):
    the image patterns its items may name and the regions they may ask for; a column left
    null falls back to the deployment's default."""

    __tablename__ = "org_policies"

    org_id: Mapped[str] = mapped_column(String(ID_LENGTH), primary_key=True)
    item_images: Mapped[list[str] | None] = mapped_column(JSON, nullable=True)
    regions: Mapped[list[str] | None] = mapped_column(JSON, nullable=True)
    updated_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)


class Capacity(Base):
    """Capacity the deployment shares between orgs (a host's sandboxes, a provider account's
    quota): each org's pool on it holds at most its share, divided by weight
    (corral.shared.store.shares)."""

    __tablename__ = "capacities"

    id: Mapped[str] = mapped_column(String(ID_LENGTH), primary_key=True)
    name: Mapped[str] = mapped_column(String(ID_LENGTH), unique=True)
    slots: Mapped[int] = mapped_column(Integer)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    updated_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)


class OrgWeight(Base):
    """An org's weight in the division of shared capacity (default 1 without a row)."""

    __tablename__ = "org_weights"

    org_id: Mapped[str] = mapped_column(String(ID_LENGTH), primary_key=True)
    weight: Mapped[int] = mapped_column(Integer)
    updated_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)


class OrgLimit(Base):
    """An org's limit on work in flight across all its pools (corral.shared.store.org_limits)."""

    __tablename__ = "org_limits"

    org_id: Mapped[str] = mapped_column(String(ID_LENGTH), primary_key=True)
    max_concurrent: Mapped[int] = mapped_column(Integer)
    updated_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)


_SESSION_LIVE = text("ended_at IS NULL")


class InteractiveSession(Base):
    """A live sandbox a caller runs commands in and moves files to and from
    (docs/sessions.md): a work item whose work idles, and the session's own clock.

    ``idle_until`` moves on with every exec or file call (to the call's timeout while it
    runs, then ``idle_ttl_s`` past its end); ``expires_at`` is ``ttl_s`` past creation. The
    reaper ends a live session (``ended_at`` null) past either.
    """

    __tablename__ = "interactive_sessions"
    __table_args__ = (
        Index(
            "ix_interactive_sessions_live_idle",
            "idle_until",
            postgresql_where=_SESSION_LIVE,
            sqlite_where=_SESSION_LIVE,
        ),
        Index(
            "ix_interactive_sessions_live_expires",
            "expires_at",
            postgresql_where=_SESSION_LIVE,
            sqlite_where=_SESSION_LIVE,
        ),
    )

    id: Mapped[str] = mapped_column(String(ID_LENGTH), primary_key=True)
    org_id: Mapped[str] = mapped_column(String(ID_LENGTH))
    project_id: Mapped[str] = mapped_column(String(ID_LENGTH))
    work_item_id: Mapped[str | None] = mapped_column(
        String(ID_LENGTH), ForeignKey("work_items.id"), nullable=True, unique=True
    )
    idle_ttl_s: Mapped[int] = mapped_column(Integer)
    ttl_s: Mapped[int] = mapped_column(Integer)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    expires_at: Mapped[datetime] = mapped_column(UTCDateTime)
    idle_until: Mapped[datetime] = mapped_column(UTCDateTime)
    ended_at: Mapped[datetime | None] = mapped_column(UTCDateTime, nullable=True)
    end_reason: Mapped[str | None] = mapped_column(String(32), nullable=True)


class WebhookEndpoint(Base):
    """An org's webhook endpoint (corral.shared.store.webhooks): where its events are POSTed.

    ``events`` lists the event types it is sent (comma-separated, e.g. ``item.final``).
    ``secret_sealed`` is its signing secret encrypted with the deployment's secret key; the
    secret itself is shown once, at creation. A removed endpoint keeps its row with
    ``disabled_at`` and is sent nothing more.
    """

    __tablename__ = "webhook_endpoints"
    __table_args__ = (Index("ix_webhook_endpoints_org", "org_id"),)

    id: Mapped[str] = mapped_column(String(ID_LENGTH), primary_key=True)
    org_id: Mapped[str] = mapped_column(String(ID_LENGTH))
    url: Mapped[str] = mapped_column(String(2048))
    events: Mapped[str] = mapped_column(String(255))
    secret_sealed: Mapped[bytes] = mapped_column(LargeBinary)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    disabled_at: Mapped[datetime | None] = mapped_column(UTCDateTime, nullable=True)


class WebhookDelivery(Base):
    """One try at delivering a webhook event to its endpoint (corral.shared.store.webhook_log),
    kept ``CORRAL_WEBHOOK_LOG_KEEP_S`` (then pruned).

    ``status`` is the endpoint's HTTP answer, or null when it gave none (``error`` says
    why). ``outbox_id`` is the outbox row the try was of (gone once delivered), and
    ``event`` that row's target, which a redelivery by hand owes again, event id and all.
    """

    __tablename__ = "webhook_deliveries"
    __table_args__ = (
        Index("ix_webhook_deliveries_endpoint", "endpoint_id", "id"),
        Index("ix_webhook_deliveries_event", "event_id"),
        Index("ix_webhook_deliveries_at", "at"),
    )

    id: Mapped[int] = mapped_column(BigId, primary_key=True, autoincrement=True)
    endpoint_id: Mapped[str] = mapped_column(String(ID_LENGTH))
    org_id: Mapped[str] = mapped_column(String(ID_LENGTH))
    event_id: Mapped[str] = mapped_column(String(ID_LENGTH))
    event_type: Mapped[str] = mapped_column(String(32))
    work_item_id: Mapped[str | None] = mapped_column(String(ID_LENGTH), nullable=True)
    outbox_id: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    attempt: Mapped[int] = mapped_column(Integer)
    status: Mapped[int | None] = mapped_column(Integer, nullable=True)
    error: Mapped[str | None] = mapped_column(Text, nullable=True)
    at: Mapped[datetime] = mapped_column(UTCDateTime)
    event: Mapped[dict[str, Any]] = mapped_column(JSON)


class NamedSecret(Base):
    """A secret kept by name (corral.shared.store.secrets): an org's, or the deployment's
    (``org_id`` is ``*``, which no org id can be). ``sealed`` is its value sealed with the
    deployment's secret key, bound to the org and the name."""

    __tablename__ = "named_secrets"
    __table_args__ = (UniqueConstraint("org_id", "name", name="uq_named_secrets_org_name"),)

    id: Mapped[int] = mapped_column(BigId, primary_key=True, autoincrement=True)
    org_id: Mapped[str] = mapped_column(String(ID_LENGTH))
    name: Mapped[str] = mapped_column(String(ID_LENGTH))
    sealed: Mapped[bytes] = mapped_column(LargeBinary)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    updated_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)


class SecretUseRecord(Base):
    """One resolution of a named secret for a work item: which secret (name and scope),
    where it went (``used_in``: env or binding, ``target``: the variable or binding name),
    when. Never its value."""

    __tablename__ = "secret_uses"
    __table_args__ = (Index("ix_secret_uses_item", "work_item_id", "id"),)

    id: Mapped[int] = mapped_column(BigId, primary_key=True, autoincrement=True)
    work_item_id: Mapped[str] = mapped_column(String(ID_LENGTH))
    org_id: Mapped[str] = mapped_column(String(ID_LENGTH))
    secret_name: Mapped[str] = mapped_column(String(ID_LENGTH))
    scope: Mapped[str] = mapped_column(String(16))
    used_in: Mapped[str] = mapped_column(String(16))
    target: Mapped[str] = mapped_column(String(255))
    at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)


class ProviderPaceRow(Base):
    """The pace of one provider credential's creates (corral.shared.store.pacing), shared by
    every worker process: ``key`` is the provider and a digest of the credential, never the
    credential. ``tat`` is when its next create conforms to its rate (epoch seconds), ``rate``
    its slowed rate after a rate-limit answer (null: the configured one), ``last_go`` when its
    last create went, ``in_flight`` the create calls outstanding (holder: when its lease
    ends), ``reserved`` the slots held for waiting creates (holder: when it may go)."""

    __tablename__ = "provider_paces"

    key: Mapped[str] = mapped_column(String(96), primary_key=True)
    provider_id: Mapped[str] = mapped_column(String(ID_LENGTH))
    tat: Mapped[float] = mapped_column(Float, default=0.0)
    rate: Mapped[float | None] = mapped_column(Float, nullable=True)
    slowed_at: Mapped[float | None] = mapped_column(Float, nullable=True)
    last_go: Mapped[float | None] = mapped_column(Float, nullable=True)
    in_flight: Mapped[dict[str, float]] = mapped_column(JSON, default=dict)
    reserved: Mapped[dict[str, float]] = mapped_column(JSON, default=dict)
    updated_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
