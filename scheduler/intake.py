"""Intake and routing against the database.

:func:`accept` writes the work item before anything is enqueued; :func:`route_item` picks
its pool and queue and hands back what to enqueue, which the caller sends only after the
transaction committed (so a provision task never finds an item that is not there).
"""

from __future__ import annotations

import hashlib
import logging
import re
import uuid
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from pydantic import ValidationError
from sqlalchemy import select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from corral.scheduler.admission import Wait, queue_key, wait_of
from corral.scheduler.errors import (
    DispatchError,
    ExpiredError,
    InvalidMessageError,
    SecretKeyMissingError,
    UnknownNamedSecretError,
)
from corral.scheduler.placement import decide
from corral.scheduler.publish import enqueue
from corral.scheduler.routing import Exhausted, Routed, Waiting
from corral.scheduler.routing_config import Board, failed_pools_of, read_config
from corral.shared import logs
from corral.shared.broker.callbacks import Reply, owed, stored_replies
from corral.shared.messages import DispatchRequest, describe_field_errors, field_errors
from corral.shared.settings import IntakeSettings, split_list
from corral.shared.store import breaker, liveness, secrets, slots
from corral.shared.store.db import Database, utcnow
from corral.shared.store.expiry import expire_items
from corral.shared.store.leases import chosen
from corral.shared.store.lifecycle import record_creation, transition
from corral.shared.store.models import ItemState, WorkItem
from corral.shared.store.outbox import add_reply
from corral.shared.store.sealing import is_withheld, stored
from corral.shared.store.slots import free_slots, take_slots
from corral.shared.text import IDENTIFIER, storable_line

log = logging.getLogger(__name__)

ROUTABLE_STATES = (ItemState.RECEIVED, ItemState.WAITING_CAPACITY)
_IDENTIFIER = re.compile(IDENTIFIER.removeprefix("^").removesuffix("$"))
_FIELD = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,63}")


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


@dataclass(frozen=True)
class Origin:
    """Where a dispatch came from: the Celery task id of its message (None over HTTP), and
    the reply the message is owed when its item ends (None: no result backend)."""

    task_id: str | None = None
    reply: Reply | None = None

    def columns(self) -> dict[str, Any]:
        """The work item's columns that keep it."""
        replies = stored_replies([self.reply] if self.reply is not None else [])
        return {"task_id": self.task_id, "replies": replies}

    def owed_by(self, db: Database, item_id: str) -> str:
        """``item_id``, which an earlier message made: it owes this message's reply too."""
        if self.reply is not None:
            add_reply(db, item_id, self.reply.as_json())
        return item_id


NO_ORIGIN = Origin()


def origin_of(
    task_id: Any, callbacks: Any, errbacks: Any, settings: IntakeSettings
) -> tuple[Origin, str | None]:
    """A Celery message's origin, and why its callbacks are refused (None: they are not).
    The message is owed a reply only when the deployment has a result backend, and only
    under a task id that can be kept (:func:`~corral.shared.text.storable_line`)."""
    if settings.result_backend is None:
        return Origin(storable_line(task_id)), None
    allowed = split_list(settings.callback_queues)
    reply, refused = owed(task_id, callbacks, errbacks, allowed=allowed)
    return Origin(storable_line(task_id), reply), refused


def expired_at_intake(request: DispatchRequest, now: datetime) -> ExpiredError | None:
    """The dispatch error of a message whose own ``expires_at`` has passed at ``now``."""
    if request.expires_at is not None and request.expires_at <= now:
        return ExpiredError(request.expires_at)
    return None


def unknown_secrets(
    session: Session, requests: Sequence[DispatchRequest]
) -> dict[int, UnknownNamedSecretError]:
    """The dispatch error of each request (by position) that refers to a named secret
    neither its org nor the deployment has; one read for all (none when none refers to
    one)."""
    wanted = {(r.org, name) for r in requests for name in r.secret_refs.values()}
    if not wanted:
        return {}
    gone = secrets.missing(session, wanted)
    errors: dict[int, UnknownNamedSecretError] = {}
    for index, request in enumerate(requests):
        for field, name in request.secret_refs.items():
            if (request.org, name) in gone:
                errors[index] = UnknownNamedSecretError(name, field)
                break
    return errors


def accept(
    db: Database, request: DispatchRequest, *, actor: str, origin: Origin = NO_ORIGIN
) -> Accepted:
    """Persist ``request`` as a work item; a repeated idempotency key returns the first item
    (which then owes ``origin``'s reply too). A message past its own expiry is written as
    the dispatch error ``expired``."""
    if request.idempotency_key is not None:
        existing = _find_by_key(db, request.org, request.idempotency_key)
        if existing is not None:
            return Accepted(origin.owed_by(db, existing), created=False)
    item_id = new_item_id()
    try:
        with db.session() as session:
            item = WorkItem(
                id=item_id,
                org_id=request.org,
                project_id=request.project,
                idempotency_key=request.idempotency_key,
                profile=request.profile,
                payload=stored(request.model_dump(mode="json"), db.sealer, request.org, item_id),
                state=ItemState.RECEIVED.value,
                expires_at=request.expires_at,
                **origin.columns(),
            )
            session.add(item)
            session.flush()
            record_creation(session, item, actor=actor, detail="accepted")
            expired = expired_at_intake(request, item.created_at)
            if expired is not None:
                _fail_dispatch(session, item, expired, actor)
    except IntegrityError:
        # A concurrent request with the same key won the insert.
        assert request.idempotency_key is not None
        existing = _find_by_key(db, request.org, request.idempotency_key)
        if existing is None:
            raise
        return Accepted(origin.owed_by(db, existing), created=False)
    return Accepted(item_id, created=True)


def _find_by_key(db: Database, org_id: str, key: str) -> str | None:
    with db.session() as session:
        return session.scalar(
            select(WorkItem.id).where(WorkItem.org_id == org_id, WorkItem.idempotency_key == key)
        )


def record_invalid(
    db: Database,
    message: Any,
    error: ValidationError | str,
    *,
    actor: str,
    idempotency_key: str | None = None,
    origin: Origin = NO_ORIGIN,
) -> str:
    """Record a malformed dispatch message as a work item in ``dispatch_error``; its id.

    The item is keyed by the message's own ``idempotency_key`` when its org and key can be
    read, else by ``idempotency_key`` (the key of the message's Celery task id), so that its
    sender finds it, and a second delivery of the same message finds the first record
    instead of writing another (which then owes ``origin``'s reply too).
    """
    if isinstance(error, ValidationError):
        text = describe_field_errors(field_errors(error))
    else:
        text = error
    org_id, project_id = _identifier(message, "org"), _identifier(message, "project")
    own = storable_line(message.get("idempotency_key")) if isinstance(message, dict) else None
    key = own if own is not None and org_id != UNKNOWN else idempotency_key
    if key is not None:
        existing = _find_by_key(db, org_id, key)
        if existing is not None:
            return origin.owed_by(db, existing)
    item = WorkItem(
        id=new_item_id(),
        org_id=org_id,
        project_id=project_id,
        idempotency_key=key,
        payload={"invalid_message": _describe_shape(message)},
        state=ItemState.RECEIVED.value,
        **origin.columns(),
    )
    logs.remember(org_id=org_id, pool_id=None, work_item_id=item.id)
    try:
        with db.session() as session:
            session.add(item)
            session.flush()
            invalid = InvalidMessageError(f"invalid dispatch message: {text}")
            _fail_dispatch(session, item, invalid, actor)
    except IntegrityError:
        found = _find_by_key(db, org_id, key) if key else None
        if found is None:
            raise
        return origin.owed_by(db, found)
    return item.id


UNKNOWN = "unknown"  # the org and project of a message whose own cannot be read


def _identifier(message: Any, name: str) -> str:
    value = message.get(name) if isinstance(message, dict) else None
    return value if isinstance(value, str) and _IDENTIFIER.fullmatch(value) else UNKNOWN


def _describe_shape(message: Any) -> Any:
    # Keep the field names for debugging (those shaped like field names, at most 50), never
    # the values: a malformed message may still carry secrets in its env.
    if isinstance(message, dict):
        names = sorted(k for k in message if isinstance(k, str) and _FIELD.fullmatch(k))[:50]
        other = len(message) - len(names)
        return {"fields": names, **({"other_fields": other} if other else {})}
    if message is None:
        return {"type": "unreadable"}
    return {"type": type(message).__name__}


def resume(db: Database, item_id: str, *, actor: str, settings: IntakeSettings) -> RouteOutcome:
    """What a second delivery of an accepted message still owes: routing an item that was
    never routed, or the provision task of a routed one (provision is idempotent, so
    sending it again is safe; the first one may have died with its sender)."""
    with db.session() as session:
        item = session.get(WorkItem, item_id)
        state = ItemState(item.state) if item is not None else None
        queue = item.queue if item is not None else None
    if state in ROUTABLE_STATES:
        return route_item(db, item_id, actor=actor, settings=settings)
    if state is ItemState.ROUTED and queue is not None:
        return RouteOutcome(item_id, ItemState.ROUTED, queue=queue, detail="sent again")
    return RouteOutcome(item_id, state or ItemState.RECEIVED, detail="nothing owed")


def route_item(db: Database, item_id: str, *, actor: str, settings: IntakeSettings) -> RouteOutcome:
    """Route one received or waiting item. Safe to call again: other states are left alone.

    The item and the chosen pool are locked (PostgreSQL row locks; on SQLite every
    transaction holds the database's write lock), so concurrent routers never take more
    slots than a pool has.
    """
    with db.session() as session:
        item = session.get(WorkItem, item_id, with_for_update=True)
        if item is None:
            raise LookupError(f"work item {item_id} does not exist")
        held = _held_back(session, item, actor)
        if held is not None:
            return held
        request = DispatchRequest.model_validate(item.payload)
        try:
            if is_withheld(item.payload):
                raise SecretKeyMissingError()
            if request.secret_refs and (unknown := unknown_secrets(session, [request])):
                raise unknown[0]
            failed = failed_pools_of(session, item.id, attempts_made=item.attempts)
            # An item received now arrives; one waiting for capacity is being handed on.
            fresh = item.state == ItemState.RECEIVED.value
            decided = _decide(session, request, settings, failed, fresh=fresh)
        except DispatchError as exc:
            _fail_dispatch(session, item, exc, actor)
            return RouteOutcome(item_id, ItemState.DISPATCH_ERROR, detail=exc.message)
        if isinstance(decided, Exhausted):
            return _fail_over_nowhere(session, item, decided, actor)
        if isinstance(decided, Waiting):
            _wait(session, item, request, wait_of(decided), actor=actor, settings=settings)
            return RouteOutcome(item_id, ItemState.WAITING_CAPACITY)
        decision, pool_lease = decided
        item.pool_id = decision.pool.id
        item.queue = decision.queue
        logs.remember(org_id=item.org_id, pool_id=item.pool_id, work_item_id=item.id)
        item.attempts += 1
        item.error_code = item.error_message = None
        item.not_before = None
        item.wait_reason = item.wait_pools = None  # its place (queue_key) it keeps
        if item.lease is None:  # chosen once, at the first routing: every attempt's rules
            item.lease = chosen(request.lease, pool_lease)
        detail = f"pool {decision.pool.name} via {decision.queue}"
        if failed:
            detail += f" (failover: passed by {', '.join(sorted(failed))}, which failed it)"
        if decision.queue not in liveness.served_queues(session):
            detail += liveness.unserved_note(decision.queue)
        transition(session, item, ItemState.ROUTED, actor=actor, detail=detail)
        return RouteOutcome(item_id, ItemState.ROUTED, queue=decision.queue)


def _held_back(session: Session, item: WorkItem, actor: str) -> RouteOutcome | None:
    """Why ``item`` is not routed now (None: it is): not in a routable state, past its own
    expiry (it fails as expired instead), or backing off after a requeue."""
    if ItemState(item.state) not in ROUTABLE_STATES:
        return RouteOutcome(item.id, ItemState(item.state), detail="not routable")
    now = utcnow()
    if item.expires_at is not None and item.expires_at <= now:
        expire_items(session, [item], actor=actor)
        return RouteOutcome(item.id, ItemState.FAILED, detail="expired")
    if item.not_before is not None and item.not_before > now:
        # A requeued item backing off: the re-drive routes it once the time has come.
        return RouteOutcome(item.id, ItemState(item.state), detail="backing off")
    return None


def _wait(
    session: Session,
    item: WorkItem,
    request: DispatchRequest,
    wait: Wait,
    *,
    actor: str,
    settings: IntakeSettings,
) -> None:
    """Every qualifying pool is full (or its breaker open, or the org at its limit): the
    item waits for a slot, at the place it first took among its org's waiting items
    (scheduler/admission.py), with what holds it now."""
    key = item.queue_key or queue_key(request.priority, utcnow(), settings.priority_aging_s)
    for column, value in wait.columns(key).items():
        setattr(item, column, value)
    slots.close(session, wait.pools)  # a slot they free is handed on, not taken at intake
    if item.state != ItemState.WAITING_CAPACITY:
        transition(session, item, ItemState.WAITING_CAPACITY, actor=actor, detail=wait.detail)


def _fail_over_nowhere(
    session: Session, item: WorkItem, exhausted: Exhausted, actor: str
) -> RouteOutcome:
    """Every qualifying pool failed to make the item's sandbox: it fails with the last
    pool's error (kept on the item by the failed provision), naming the pools tried."""
    tried = ", ".join(pool.describe() for pool in exhausted.pools)
    item.error_code = item.error_code or "provision_failed"
    last = item.error_message or "its provision failed"
    item.error_message = f"{last} (failover: every qualifying pool failed to provision it: {tried})"
    transition(session, item, ItemState.FAILED, actor=actor, detail=item.error_code)
    return RouteOutcome(item.id, ItemState.FAILED, detail=item.error_message)


def _decide(
    session: Session,
    request: DispatchRequest,
    settings: IntakeSettings,
    failed: frozenset[str],
    *,
    fresh: bool,
) -> tuple[Routed, dict[str, Any] | None] | Exhausted | Waiting:
    """The routing decision for one item, its slot taken, and the chosen pool's default
    lease policy; :class:`Waiting`: it waits; :class:`Exhausted`: every qualifying pool is
    in ``failed`` (those that failed to make its sandbox before).

    Raises:
        DispatchError: the item's dispatch error.
    """
    config = read_config(session, [request], lock=False, fresh=fresh)  # locks a limited org
    board = Board.read(session, config, [request.org], settings, utcnow())
    while True:
        decision = decide(request, board.facts(request, failed_pools=failed))
        if not isinstance(decision, Routed):
            return decision
        # Guarded updates take the slot (and a half-open pool's probe), whatever concurrent
        # routers took meanwhile; then the gates decide again on what is left.
        chosen = decision.pool
        if not take_slots(session, chosen.id, 1, limit=chosen.slot_limit):
            board.mark_full(chosen)
            continue
        if chosen.breaker == breaker.PROBE and not breaker.take_probe(
            session, chosen.id, settings
        ):  # another router sent the probe: the slot goes back, the pool is passed by
            free_slots(session, Counter([chosen.id]))
            board.pass_by(chosen)
            continue
        return decision, board.lease_of(chosen.id)


def _fail_dispatch(session: Session, item: WorkItem, error: DispatchError, actor: str) -> None:
    item.error_code = error.code
    item.error_message = error.message
    transition(session, item, ItemState.DISPATCH_ERROR, actor=actor, detail=error.code)
    log.info(
        "dispatch error",
        extra={"work_item_id": item.id, "org_id": item.org_id, "pool_id": None, "code": error.code},
    )


def message_of(args: Sequence[Any], kwargs: Mapping[str, Any]) -> tuple[bool, Any]:
    """``(True, message)`` for a dispatch call's one argument (or its keyword fields);
    ``(False, None)`` for any other call shape."""
    if len(args) == 1 and not kwargs:
        return True, args[0]
    if kwargs and not args:
        return True, dict(kwargs)  # sent as keyword arguments: the fields themselves
    return False, None


WRONG_CALL = "corral.dispatch takes exactly one argument, the message"


def task_key(task_id: str | None) -> str | None:
    """The idempotency key a message without one gets: its Celery task id (its digest when
    the id is not one line of printable text that fits in a key)."""
    if not isinstance(task_id, str) or not task_id:
        return None
    kept = storable_line(task_id, 255 - len("celery:"))
    if kept is not None:
        return f"celery:{kept}"
    # An id no key can hold as it is (too long, or a control character): its digest, so
    # that a second delivery still finds the first item, and no two ids share a key.
    digest = hashlib.sha256(task_id.encode("utf-8", "surrogatepass")).hexdigest()
    return f"celery:sha256:{digest}"


def take_dispatch(
    db: Database,
    args: Sequence[Any],
    kwargs: Mapping[str, Any],
    *,
    task_id: str | None,
    actor: str,
    settings: IntakeSettings,
    callbacks: Any = None,
    errbacks: Any = None,
) -> str:
    """One dispatch call: validate, persist, route, publish; the work item's id. A malformed
    message (or one whose ``callbacks`` or ``errbacks``, its link and link_error, are
    refused) becomes a ``dispatch_error`` item; a second delivery finishes what the first
    left undone."""
    key = task_key(task_id)
    origin, refused = origin_of(task_id, callbacks, errbacks, settings)
    ok, message = message_of(args, kwargs)
    request = read_request(ok, message, refused)
    if not isinstance(request, DispatchRequest):
        message = message if ok else None
        return record_invalid(db, message, request, actor=actor, idempotency_key=key, origin=origin)
    if request.idempotency_key is None and key is not None:
        request = request.model_copy(update={"idempotency_key": key})
    accepted, outcome = take_one(db, request, actor=actor, settings=settings, origin=origin)
    enqueue(outcome)
    return accepted.item_id


def read_request(ok: bool, message: Any, refused: str | None) -> DispatchRequest | str:
    """The request of a dispatch call (``ok``: of the right shape, carrying ``message``),
    or why the call is invalid, with ``refused`` (why its callbacks are) among the reasons."""
    if not ok:
        return "; ".join(filter(None, (WRONG_CALL, refused)))
    try:
        request = DispatchRequest.model_validate(message)
    except ValidationError as exc:
        return "; ".join(filter(None, (describe_field_errors(field_errors(exc)), refused)))
    return request if refused is None else refused


def take_one(
    db: Database,
    request: DispatchRequest,
    *,
    actor: str,
    settings: IntakeSettings,
    origin: Origin = NO_ORIGIN,
) -> tuple[Accepted, RouteOutcome]:
    """Accept and route one request on its own (no batch); what to publish for it. A
    repeated idempotency key finishes what the first request may have left."""
    accepted = accept(db, request, actor=actor, origin=origin)
    if accepted.created:
        return accepted, route_item(db, accepted.item_id, actor=actor, settings=settings)
    return accepted, resume(db, accepted.item_id, actor=actor, settings=settings)
