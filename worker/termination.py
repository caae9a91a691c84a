"""Ending sandboxes: stop each at its provider, record why, settle its work item, bill it.

Every way a sandbox ends goes through :func:`end_sandboxes`: the runner's completion and a
cancel as a batch of one (:func:`end_sandbox`), each of the reaper's rules a batch at a time
(docs/architecture.md §6). It is idempotent: a sandbox that has ended already is left alone, so two
callers (a redelivered task, two sweeps) never record or bill it twice.

A batch costs a few statements, not a few per sandbox: one read of the sandboxes' rows; the
reads of the providers' own logs of those that ended before their runner reported, at once and
for at most ``CORRAL_END_LOG_TIMEOUT_S`` (:mod:`corral.worker.end_log_reads`: kept on the
sandbox's row, their last lines in the error of an item they fail); the
provider calls, one sandbox at a time and outside any transaction; one transaction that
locks the items and then the sandboxes (in id order; item before sandbox is the lock order
of every path that takes both), skips what ended meanwhile, and records the ends, the items'
outcomes, their audit rows and the slots given back in set-based statements; and one
transaction for the batch's cost events.

Settling the item, by its lease policy (:mod:`corral.shared.store.leases`): when the sandbox of
an item's current attempt ends before the runner claimed the work, the item goes back to
routing for a new sandbox, up to its ``max_attempts``; so does one whose runner was lost
after the claim (``heartbeat_lost``, ``sandbox_lost``, ``gone``) when its policy says
``on_heartbeat_lost: requeue``. Attempts whose provision failed made no sandbox and do not
count (:mod:`corral.shared.store.attempts`). A requeued item is not routed again before its
back-off's ``not_before``. After its last attempt, or for any other end of claimed work, the item
fails with the reason; so does any item whose sandbox ended because its budget was spent
(``budget_exhausted``: another attempt would be stopped the same way).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session, load_only

from corral.providers.base import SandboxHandle, SandboxState, SupportsUsage
from corral.providers.errors import PermanentProviderError
from corral.shared import logs
from corral.shared.end_logs import short_form
from corral.shared.runtime import Runtime
from corral.shared.store import attempts, breaker
from corral.shared.store.db import utcnow
from corral.shared.store.leases import Lease, gave_up, in_force
from corral.shared.store.ledger import observe_costs, write_costs_quietly
from corral.shared.store.lifecycle import (
    ItemMove,
    SandboxEnd,
    record_sandbox_ends,
    transition_items,
)
from corral.shared.store.models import ItemState, Sandbox, TerminationReason, WorkItem
from corral.worker.end_log_reads import WANTED, LogRead, read_end_logs

log = logging.getLogger(__name__)

# Ends that are not the work's fault: the item may get another sandbox if it was not claimed.
_WORK_ENDED = frozenset({TerminationReason.FINISHED, TerminationReason.CANCELLED})
_BEFORE_CLAIM = frozenset({ItemState.PROVISIONING, ItemState.AWAITING_CLAIM})
_WITH_SANDBOX = _BEFORE_CLAIM | {ItemState.RUNNING}  # states an attempt's end settles
# Ends that lose the runner after its claim: requeued when the lease policy says so.
_RUNNER_LOST = frozenset(
    {TerminationReason.HEARTBEAT_LOST, TerminationReason.LOST, TerminationReason.GONE}
)
_FAILED_STATUS = frozenset({TerminationReason.LOST, TerminationReason.GONE})
# Ends before the claim that say the pool's sandboxes do not work: its breaker counts them.
_POOL_FAULTS = frozenset(
    {TerminationReason.NEVER_CLAIMED, TerminationReason.LOST, TerminationReason.GONE}
)
# Ends another attempt could not help: the item fails with the reason, whatever its lease.
_NEVER_RETRIED = frozenset({TerminationReason.BUDGET_EXHAUSTED})
BATCH = 500  # sandboxes per transaction: bounds the parameters of each statement


@dataclass(frozen=True)
class EndRequest:
    """A sandbox to end, and why; ``detail`` says what happened, for people.

    ``kill=False`` records an end the provider already made (``gone``). ``still_applies``
    re-checks a reaper rule on a fresh read just before the kill (the runner may have
    claimed or heartbeated since the sweep read the rows); if it no longer holds, nothing
    is done.
    """

    sandbox_id: str
    reason: TerminationReason
    detail: str | None = None
    kill: bool = True
    still_applies: Callable[[Sandbox], bool] | None = None


@dataclass(frozen=True)
class Ended:
    """What ending one sandbox did."""

    ended: bool  # this call ended it (False: it had ended already, or is not there)
    reason: TerminationReason | None = None  # the reason recorded
    requeued: str | None = None  # the item to route again
    not_before: datetime | None = None  # ... once its back-off is over (None: at once)
    failed: str | None = None  # the item this end failed
    # The pool whose circuit breaker counts this end as a failure: its sandbox ended before
    # the runner claimed the work (never claimed, or exited early).
    pool_failed: str | None = None


NOT_ENDED = Ended(ended=False)


@dataclass
class Endings:
    """What :func:`end_sandboxes` did, by sandbox id. A sandbox in neither map was left
    alone: ended already, its rule no longer held, still being made, or not reached."""

    ended: dict[str, Ended] = field(default_factory=dict)
    # Nothing was recorded for these (the provider could not be reached, or the database
    # failed): the caller (a retried task, the next sweep) tries again.
    errors: dict[str, Exception] = field(default_factory=dict)


def end_sandbox(
    rt: Runtime,
    sandbox_id: str,
    *,
    reason: TerminationReason,
    actor: str,
    detail: str | None = None,
    kill: bool = True,
    still_applies: Callable[[Sandbox], bool] | None = None,
) -> Ended:
    """End ``sandbox_id`` for ``reason``: :func:`end_sandboxes` for one (see
    :class:`EndRequest` for the arguments).

    Raises:
        TransientProviderError: the provider could not be reached; nothing was recorded, so
            the caller (a retried task, the next sweep) tries again. Any error of the
            database, likewise.
    """
    request = EndRequest(sandbox_id, reason, detail, kill, still_applies)
    endings = end_sandboxes(rt, [request], actor=actor)
    if sandbox_id in endings.errors:
        raise endings.errors[sandbox_id]
    return endings.ended.get(sandbox_id, NOT_ENDED)


def end_sandboxes(
    rt: Runtime,
    requests: Sequence[EndRequest],
    *,
    actor: str,
    renew: Callable[[], bool] = lambda: True,
) -> Endings:
    """End each sandbox of ``requests``, :data:`BATCH` at a time; never raises: what could
    not be ended is in :attr:`Endings.errors`. ``renew`` is called before each provider
    call; once it returns False (the reaper lost its lease) no more sandboxes are stopped,
    and those stopped already are recorded."""
    endings = Endings()
    for start in range(0, len(requests), BATCH):
        batch = requests[start : start + BATCH]
        if not renew():
            break
        try:
            _end_batch(rt, batch, actor, renew, endings)
        except Exception as exc:  # the database: nothing of this batch was recorded
            for request in batch:
                endings.errors.setdefault(request.sandbox_id, exc)
    return endings


def _end_batch(
    rt: Runtime,
    batch: Sequence[EndRequest],
    actor: str,
    renew: Callable[[], bool],
    endings: Endings,
) -> None:
    stopped: list[_Stopped] = []
    targets = _targets(rt, batch)
    # Read before the sandboxes are stopped (stopping removes what some providers keep).
    reads = [target.log_read for target in targets if target.log_read is not None]
    logs = read_end_logs(rt, reads, timeout_s=rt.settings.end_log_timeout_s)
    for target in targets:
        if not renew():
            break  # the rest wait for the next sweep
        try:
            stopped.append(_stop(rt, target, logs.get(target.sandbox_id)))
        except Exception as exc:
            endings.errors[target.sandbox_id] = exc
    ended, costs = _record_ends(rt, stopped, actor=actor, max_attempts=rt.settings.max_attempts)
    endings.ended.update(ended)
    _count_pool_faults(rt, ended)
    observe_costs(costs)
    for sandbox_id, outcome in ended.items():
        recorded = outcome.reason.value if outcome.reason else None
        log.info("sandbox ended", extra={"sandbox_id": sandbox_id, "reason": recorded})


@dataclass(frozen=True)
class _Target:
    """A sandbox to stop: its request, its handle, whether no handle was recorded for it
    (yet), and the read of its own log when it ends before its runner reported."""

    request: EndRequest
    handle: SandboxHandle
    unrecorded: bool
    log_read: LogRead | None = None

    @property
    def sandbox_id(self) -> str:
        return self.request.sandbox_id


def _targets(rt: Runtime, batch: Sequence[EndRequest]) -> list[_Target]:
    """The sandboxes of ``batch`` to stop, from one read of their rows."""
    requests = {request.sandbox_id: request for request in reversed(batch)}  # first wins
    with rt.db.session() as session:
        rows = session.scalars(
            select(Sandbox).where(Sandbox.id.in_(requests)).order_by(Sandbox.id)
        ).all()
    targets = (_target(sandbox, requests[sandbox.id]) for sandbox in rows)
    return [target for target in targets if target is not None]


def _target(sandbox: Sandbox, request: EndRequest) -> _Target | None:
    logs.remember(
        org_id=sandbox.org_id,
        pool_id=sandbox.pool_id,
        work_item_id=sandbox.work_item_id,
        sandbox_id=sandbox.id,
    )
    if sandbox.terminated_at is not None:
        return None
    if request.still_applies is not None and not request.still_applies(sandbox):
        return None
    unrecorded = sandbox.external_id is None
    in_flight = unrecorded and sandbox.lease_until is not None and sandbox.lease_until > utcnow()
    if in_flight and request.reason is not TerminationReason.PROVISION_STUCK:
        # A worker is making it under a live lease. When it stores the handle it sees the
        # item has ended and records the end itself (corral.worker.provision).
        return None
    metadata = dict(sandbox.handle_metadata) or {
        "org_id": sandbox.org_id,
        "sandbox_id": sandbox.id,
    }
    # Built-in providers name a sandbox by corral's id, so one whose handle was never
    # recorded (still being made, or its worker gave up) is found by that id.
    external_id = sandbox.external_id or sandbox.id
    handle = SandboxHandle(
        provider_id=sandbox.provider_id, external_id=external_id, metadata=metadata
    )
    unreported = request.reason in WANTED and sandbox.end_requested_at is None
    log_read = LogRead(sandbox.id, sandbox.work_item_id, handle) if unreported else None
    return _Target(request, handle, unrecorded, log_read)


@dataclass(frozen=True)
class _Stopped:
    """A sandbox stopped at its provider (or one it had ended), to be recorded."""

    request: EndRequest
    detail: str
    cpu_seconds: float | None
    end_log: str | None = None  # its own log's last lines, kept (corral.shared.end_logs)


def _stop(rt: Runtime, target: _Target, end_log: str | None = None) -> _Stopped:
    """Stop one sandbox at its provider, outside any transaction; ``end_log`` goes with it.

    Raises:
        TransientProviderError: the provider could not be reached (unless no handle was
            recorded: whatever the provider holds, reconciliation finds as an orphan).
    """
    request, handle = target.request, target.handle
    detail = request.detail or request.reason.value
    if not request.kill:
        return _Stopped(request, detail, None, end_log)
    cpu_seconds = _usage(rt, handle)
    try:
        rt.provider(handle.provider_id).terminate(handle)
    except PermanentProviderError as exc:
        # Retrying cannot help (e.g. the provider is no longer configured): record the end
        # with the failure, so that an operator sees it, rather than retry for ever.
        detail = f"{detail}; the provider could not terminate it: {exc.message}"
    except Exception:
        if not target.unrecorded:
            raise
        log.warning(
            "terminate of a stuck provision failed",
            exc_info=True,
            extra={"sandbox_id": request.sandbox_id},
        )
    return _Stopped(request, detail, cpu_seconds, end_log)


def _usage(rt: Runtime, handle: SandboxHandle) -> float | None:
    """CPU seconds, asked before the sandbox goes (its counters go with it)."""
    try:
        provider = rt.provider(handle.provider_id)
        if isinstance(provider, SupportsUsage):
            return provider.usage(handle).cpu_seconds
    except Exception:  # billing falls back to wall-clock; ending must not wait on this
        log.warning("usage not available", extra={"sandbox_id": handle.external_id}, exc_info=True)
    return None


def _record_ends(
    rt: Runtime, stopped: Sequence[_Stopped], *, actor: str, max_attempts: int
) -> tuple[dict[str, Ended], list[dict[str, Any]]]:
    """Record the ends of ``stopped`` and write their cost events, in one transaction;
    what each end did, by sandbox, and the cost events written (a failure to write those
    leaves them owed, for the reaper's next sweep, and the ends recorded)."""
    if not stopped:
        return {}, []
    ended: dict[str, Ended] = {}
    ends: list[SandboxEnd] = []
    moves: list[ItemMove] = []
    with rt.db.session() as session:
        sandbox_ids = [one.request.sandbox_id for one in stopped]
        items, sandboxes = _lock(session, sandbox_ids)
        # Only an end that may requeue or fail its item counts its attempts (_settle): the
        # work's own end (the common one) reads nothing more.
        settling = {
            sandboxes[one.request.sandbox_id].work_item_id
            for one in stopped
            if one.request.reason not in _WORK_ENDED and one.request.sandbox_id in sandboxes
        }
        unmade = attempts.unmade_attempts(session, sorted(settling))
        for one in sorted(stopped, key=lambda one: one.request.sandbox_id):
            sandbox = sandboxes[one.request.sandbox_id]
            if sandbox.terminated_at is not None:
                continue  # ended by another caller since it was read
            item = items[sandbox.work_item_id]
            end = _end_of(sandbox, one, item)
            ends.append(end)
            lease = in_force(item.lease, max_attempts=max_attempts)
            made = attempts.made_attempts(item.attempts, unmade.get(item.id, 0))
            outcome, move = _settle(item, sandbox, end, lease, made)
            ended[end.sandbox_id] = outcome
            if move is not None:
                moves.append(move)
        record_sandbox_ends(session, ends, actor=actor)
        transition_items(session, moves, actor=actor)
        costs = write_costs_quietly(session, list(ended))
    return ended, costs


def _lock(
    session: Session, sandbox_ids: list[str]
) -> tuple[dict[str, WorkItem], dict[str, Sandbox]]:
    """The sandboxes and their items, locked: every item first, then every sandbox, each in
    id order. Only the columns the ends read are loaded."""
    of_sandboxes = select(Sandbox.work_item_id).where(Sandbox.id.in_(sandbox_ids))
    items = session.scalars(
        select(WorkItem)
        .options(load_only(WorkItem.state, WorkItem.attempts, WorkItem.pool_id, WorkItem.lease))
        .where(WorkItem.id.in_(of_sandboxes.scalar_subquery()))
        .order_by(WorkItem.id)
        .with_for_update()
    ).all()
    sandboxes = session.scalars(
        select(Sandbox)
        .options(
            load_only(
                Sandbox.work_item_id,
                Sandbox.attempt,
                Sandbox.pool_id,
                Sandbox.status,
                Sandbox.terminated_at,
                Sandbox.end_requested_at,
            )
        )
        .where(Sandbox.id.in_(sandbox_ids))
        .order_by(Sandbox.id)
        .with_for_update()
    ).all()
    return {item.id: item for item in items}, {sandbox.id: sandbox for sandbox in sandboxes}


def _end_of(sandbox: Sandbox, stopped: _Stopped, item: WorkItem) -> SandboxEnd:
    reason, detail = stopped.request.reason, stopped.detail
    if reason in _FAILED_STATUS and sandbox.end_requested_at is not None:
        # It ended at the provider after its work reported: that is the normal end.
        reason, detail = TerminationReason.FINISHED, "its work item has ended"
    if (
        reason is TerminationReason.FINISHED
        and item.state == ItemState.CANCELLED.value
        and sandbox.attempt == item.attempts
    ):
        # Its work was cancelled: whichever end comes first (the cancel's, the batch its
        # runner's report of the cancelled work joined, the reaper's backstop), the sandbox
        # ends as the cancel's own end records it.
        reason = TerminationReason.CANCELLED
        detail = reason.value
    to = SandboxState.FAILED if reason in _FAILED_STATUS else SandboxState.TERMINATED
    return SandboxEnd(
        sandbox_id=sandbox.id,
        work_item_id=sandbox.work_item_id,
        from_status=sandbox.status,
        to=to,
        reason=reason,
        detail=detail,
        cpu_seconds=stopped.cpu_seconds,
        end_log=stopped.end_log,
    )


def _settle(
    item: WorkItem, sandbox: Sandbox, end: SandboxEnd, lease: Lease, made: int
) -> tuple[Ended, ItemMove | None]:
    """What the end does to the sandbox's item: nothing unless it was the current attempt
    and the end was not the work's; else requeue (before the claim, or a lost runner when
    ``lease`` says so) while attempts are left (``made``: those that got a sandbox), or
    fail. An end before the claim that says the pool's sandboxes do not work is the pool's
    failure too (:attr:`Ended.pool_failed`)."""
    reason, detail, state = end.reason, end.detail, ItemState(item.state)
    current = sandbox.attempt == item.attempts and state in _WITH_SANDBOX
    if not current or reason in _WORK_ENDED:
        return Ended(ended=True, reason=reason), None
    pool_failed = sandbox.pool_id if state in _BEFORE_CLAIM and reason in _POOL_FAULTS else None
    retried = reason not in _NEVER_RETRIED and (
        state in _BEFORE_CLAIM or (reason in _RUNNER_LOST and lease.requeues_lost_runner)
    )
    if retried and made < lease.max_attempts:
        not_before = lease.not_before(made, utcnow())
        ended = f"attempt {item.attempts} ended ({reason.value}: {detail})"
        if not_before is not None:
            ended += f"; routed again from {not_before.isoformat(timespec='seconds')}"
        move = ItemMove(
            item.id,
            item.pool_id,
            item.state,
            ItemState.RECEIVED,
            detail=f"requeued: {ended}",
            not_before=not_before,
        )
        requeued = Ended(
            ended=True,
            reason=reason,
            requeued=item.id,
            not_before=not_before,
            pool_failed=pool_failed,
        )
        return requeued, move
    if retried:
        detail = f"{detail}; {gave_up(made)}"
    if end.end_log:
        detail = f"{detail}; {short_form(end.end_log)}"
    move = ItemMove(
        item.id,
        item.pool_id,
        item.state,
        ItemState.FAILED,
        detail=reason.value,
        error_code=reason.value,
        error_message=detail,
    )
    return Ended(ended=True, reason=reason, failed=item.id, pool_failed=pool_failed), move


def _count_pool_faults(rt: Runtime, ended: dict[str, Ended]) -> None:
    """Count the ends before the claim toward their pools' circuit breakers, after the ends
    are recorded: the breaker is advice, a failure here undoes nothing."""
    faults = [(sandbox_id, one) for sandbox_id, one in ended.items() if one.pool_failed]
    if not faults:
        return
    by_pool: dict[str, list[Ended]] = {}
    for _, one in sorted(faults):
        assert one.pool_failed is not None
        by_pool.setdefault(one.pool_failed, []).append(one)
    try:
        with rt.db.session() as session:
            # A pool's ends counted at once (its row read and written once, whatever their
            # number), in pool id order, as every path that locks several pools.
            for pool_id, ends in sorted(by_pool.items()):
                last = ends[-1]
                assert last.reason is not None
                breaker.record_failure(
                    session,
                    pool_id,
                    item_id=last.requeued or last.failed or "",
                    code=last.reason.value,
                    settings=rt.settings,
                    count=len(ends),
                )
    except Exception:
        log.warning("could not count sandbox ends toward the pools' breakers", exc_info=True)
