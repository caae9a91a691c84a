"""Intake and routing against the database.

:func:`accept` writes the work item before anything is enqueued; :func:`route_item` picks
its pool and queue and hands back what to enqueue, which the caller sends only after the
transaction committed (so a provision task never finds an item that is not there).
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError
from sqlalchemy import func, select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from scheduler.errors import DispatchError, InvalidMessageError, UnknownProfileError
from scheduler.routing import PoolView, Routed, route
from shared.db import Database, utcnow
from shared.lifecycle import record_creation, transition
from shared.messages import DispatchRequest, describe_field_errors, field_errors
from shared.models import SLOT_HOLDING_STATES, AuthMode, ItemState, ModelProfile, Pool, WorkItem

log = logging.getLogger(__name__)

ROUTABLE_STATES = (ItemState.RECEIVED, ItemState.WAITING_CAPACITY)


def new_item_id() -> str:
    return f"wi-{uuid.uuid4().hex}"


@dataclass(frozen=True)
class Accepted:
    item_id: str
    created: bool


@dataclass(frozen=True)
class RouteOutcome:
    """What routing did; ``queue`` is set when a provision task must be sent."""

    item_id: str
    state: ItemState
    queue: str | None = None
    detail: str | None = None


def accept(db: Database, request: DispatchRequest, *, actor: str) -> Accepted:
    """Persist ``request`` as a work item; a repeated idempotency key returns the first item."""
    if request.idempotency_key is not None:
        existing = _find_by_key(db, request.org, request.idempotency_key)
        if existing is not None:
            return Accepted(existing, created=False)
    item_id = new_item_id()
    try:
        with db.session() as session:
            item = WorkItem(
                id=item_id, org_id=request.org, project_id=request.project,
                idempotency_key=request.idempotency_key, profile=request.profile,
                payload=request.model_dump(mode="json"), state=ItemState.RECEIVED.value,
            )  # fmt: skip
            session.add(item)
            session.flush()
            record_creation(session, item, actor=actor, detail="accepted")
    except IntegrityError:
        # A concurrent request with the same key won the insert.
        assert request.idempotency_key is not None
        existing = _find_by_key(db, request.org, request.idempotency_key)
        if existing is None:
            raise
        return Accepted(existing, created=False)
    return Accepted(item_id, created=True)


def _find_by_key(db: Database, org_id: str, key: str) -> str | None:
    with db.session() as session:
        return session.scalar(
            select(WorkItem.id).where(WorkItem.org_id == org_id, WorkItem.idempotency_key == key)
        )


def record_invalid(db: Database, message: Any, error: ValidationError | str, *, actor: str) -> str:
    """Record a malformed dispatch message as a work item in ``dispatch_error``."""
    if isinstance(error, ValidationError):
        text = describe_field_errors(field_errors(error))
    else:
        text = error
    org = message.get("org") if isinstance(message, dict) else None
    project = message.get("project") if isinstance(message, dict) else None
    item_id = new_item_id()
    with db.session() as session:
        item = WorkItem(
            id=item_id,
            org_id=org if isinstance(org, str) and 0 < len(org) <= 63 else "unknown",
            project_id=project
            if isinstance(project, str) and 0 < len(project) <= 63
            else "unknown",
            payload={"invalid_message": _describe_shape(message)},
            state=ItemState.RECEIVED.value,
        )
        session.add(item)
        session.flush()
        _fail_dispatch(
            session, item, InvalidMessageError(f"invalid dispatch message: {text}"), actor
        )
    return item_id


def _describe_shape(message: Any) -> Any:
    # Keep the field names for debugging, never the values: a malformed message may still
    # carry secrets in its env.
    if isinstance(message, dict):
        return {"fields": sorted(str(k) for k in message)}
    return {"type": type(message).__name__}


def route_item(db: Database, item_id: str, *, actor: str) -> RouteOutcome:
    """Route one received or waiting item. Safe to call again: other states are left alone.

    The item and the chosen pool are locked (PostgreSQL row locks; on SQLite every
    transaction holds the database's write lock), so concurrent routers never take more
    slots than a pool has.
    """
    with db.session() as session:
        item = session.get(WorkItem, item_id, with_for_update=True)
        if item is None:
            raise LookupError(f"work item {item_id} does not exist")
        if ItemState(item.state) not in ROUTABLE_STATES:
            return RouteOutcome(item_id, ItemState(item.state), detail="not routable")
        request = DispatchRequest.model_validate(item.payload)
        try:
            decision = _decide(session, request)
        except DispatchError as exc:
            _fail_dispatch(session, item, exc, actor)
            return RouteOutcome(item_id, ItemState.DISPATCH_ERROR, detail=exc.message)
        if decision is None:
            if item.state != ItemState.WAITING_CAPACITY:
                transition(session, item, ItemState.WAITING_CAPACITY, actor=actor,
                           detail="every qualifying pool is full")  # fmt: skip
            else:
                item.updated_at = utcnow()  # to the back of the re-drive line
            return RouteOutcome(item_id, ItemState.WAITING_CAPACITY)
        item.pool_id = decision.pool.id
        item.queue = decision.queue
        item.attempts += 1
        item.error_code = item.error_message = None
        transition(session, item, ItemState.ROUTED, actor=actor,
                   detail=f"pool {decision.pool.name} via {decision.queue}")  # fmt: skip
        return RouteOutcome(item_id, ItemState.ROUTED, queue=decision.queue)


def _decide(session: Session, request: DispatchRequest) -> Routed | None:
    profile = session.get(ModelProfile, request.profile)
    if profile is None:
        raise UnknownProfileError(
            f"model profile {request.profile!r} does not exist; create it with "
            "`corral profiles create` or name an existing one"
        )
    query = select(Pool).where(Pool.org_id == request.org, Pool.active.is_(True))
    if request.provider is not None:
        query = query.where(Pool.provider_id == request.provider)
    pools = [pool_view(pool) for pool in session.scalars(query)]
    counts = _slots_in_use(session, [p.id for p in pools])
    while True:
        decision = route(request, AuthMode(profile.auth_mode), pools, counts)
        if not isinstance(decision, Routed):
            return None
        # Re-count the chosen pool under its row lock: a concurrent router may have taken
        # the last slot since the first count.
        session.get(Pool, decision.pool.id, with_for_update=True)
        fresh = _slots_in_use(session, [decision.pool.id]).get(decision.pool.id, 0)
        if fresh < decision.pool.slot_limit:
            return decision
        counts[decision.pool.id] = fresh


def pool_view(pool: Pool) -> PoolView:
    """The routing view of ``pool``: its capabilities with its overrides applied."""
    return PoolView.build(
        id=pool.id, name=pool.name, org_id=pool.org_id, provider_id=pool.provider_id,
        priority=pool.priority, max_concurrent=pool.max_concurrent,
        runtime_provides=pool.runtime_provides, capabilities=pool.capabilities,
    )  # fmt: skip


def _slots_in_use(session: Session, pool_ids: Sequence[str]) -> dict[str, int]:
    if not pool_ids:
        return {}
    rows = session.execute(
        select(WorkItem.pool_id, func.count())
        .where(
            WorkItem.pool_id.in_(pool_ids),
            WorkItem.state.in_([s.value for s in SLOT_HOLDING_STATES]),
        )
        .group_by(WorkItem.pool_id)
    )
    return {str(pool_id): int(count) for pool_id, count in rows}


def _fail_dispatch(session: Session, item: WorkItem, error: DispatchError, actor: str) -> None:
    item.error_code = error.code
    item.error_message = error.message
    transition(session, item, ItemState.DISPATCH_ERROR, actor=actor, detail=error.code)
    log.info("dispatch error", extra={"work_item_id": item.id, "code": error.code})
