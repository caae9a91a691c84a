"""Ending one sandbox: stop it at its provider, record why, settle its work item, bill it.

Every way a sandbox ends goes through :func:`end_sandbox`: the runner's completion, a
cancel, and each of the reaper's rules (DESIGN §7). It is idempotent: a sandbox that has
ended already is left alone, so two callers (a redelivered task, two sweeps) never record or
bill it twice.

Settling the item: when the sandbox of an item's current attempt ends before the runner
claimed the work, the item goes back to routing for a new sandbox, up to ``max_attempts``;
after that, or when the work had been claimed, the item fails with the reason.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

from sqlalchemy import select
from sqlalchemy.orm import Session

from providers.base import SandboxHandle, SupportsUsage
from providers.errors import PermanentProviderError
from shared.db import utcnow
from shared.ledger import record_cost_quietly
from shared.lifecycle import sandbox_transition, transition
from shared.models import (
    ItemState,
    Sandbox,
    SandboxStatusValue,
    TerminationReason,
    WorkItem,
)
from shared.runtime import Runtime

log = logging.getLogger(__name__)

# Ends that are not the work's fault: the item may get another sandbox if it was not claimed.
_WORK_ENDED = frozenset({TerminationReason.FINISHED, TerminationReason.CANCELLED})
_BEFORE_CLAIM = frozenset({ItemState.PROVISIONING, ItemState.AWAITING_CLAIM})
_FAILED_STATUS = frozenset({TerminationReason.LOST, TerminationReason.GONE})


@dataclass(frozen=True)
class Ended:
    """What :func:`end_sandbox` did."""

    ended: bool  # this call ended it (False: it had ended already, or is not there)
    reason: TerminationReason | None = None  # the reason recorded
    requeued: str | None = None  # the item to route again
    failed: str | None = None  # the item this end failed


NOT_ENDED = Ended(ended=False)


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
    """End ``sandbox_id`` for ``reason``; ``detail`` says what happened, for people.

    ``kill=False`` records an end the provider already made (``gone``). ``still_applies``
    re-checks a reaper rule on a fresh read just before the kill (the runner may have
    claimed or heartbeated since the sweep read the rows); if it no longer holds, nothing
    is done.

    Raises:
        TransientProviderError: the provider could not be reached; nothing was recorded, so
            the caller (a retried task, the next sweep) tries again.
    """
    target = _target(rt, sandbox_id, reason, still_applies)
    if target is None:
        return NOT_ENDED
    handle, unrecorded = target
    cpu_seconds = None
    if kill:
        cpu_seconds = _usage(rt, handle)
        try:
            rt.provider(handle.provider_id).terminate(handle)
        except PermanentProviderError as exc:
            # Retrying cannot help (e.g. the provider is no longer configured): record the
            # end with the failure, so that an operator sees it, rather than retry for ever.
            detail = f"{detail or reason.value}; the provider could not terminate it: {exc.message}"
        except Exception:
            if not unrecorded:
                raise
            # Nothing was recorded as made: whatever the provider holds, the inventory
            # reconciliation finds as an orphan.
            log.warning("terminate of a stuck provision failed", exc_info=True,
                        extra={"sandbox_id": sandbox_id})  # fmt: skip
    outcome = _record_end(rt, sandbox_id, reason, detail=detail or reason.value, actor=actor,
                          cpu_seconds=cpu_seconds)  # fmt: skip
    if outcome.ended:
        record_cost_quietly(rt.db, sandbox_id)
        recorded = (outcome.reason or reason).value
        log.info("sandbox ended", extra={"sandbox_id": sandbox_id, "reason": recorded})
    return outcome


def _target(
    rt: Runtime,
    sandbox_id: str,
    reason: TerminationReason,
    still_applies: Callable[[Sandbox], bool] | None,
) -> tuple[SandboxHandle, bool] | None:
    """The handle to terminate, and whether no handle was recorded for it (yet)."""
    with rt.db.session() as session:
        sandbox = session.get(Sandbox, sandbox_id)
        if sandbox is None or sandbox.terminated_at is not None:
            return None
        if still_applies is not None and not still_applies(sandbox):
            return None
        unrecorded = sandbox.external_id is None
        in_flight = (
            unrecorded and sandbox.lease_until is not None and sandbox.lease_until > utcnow()
        )
        if in_flight and reason is not TerminationReason.PROVISION_STUCK:
            # A worker is making it under a live lease. When it stores the handle it sees
            # the item has ended and records the end itself (worker.provision).
            return None
        metadata = dict(sandbox.handle_metadata) or {
            "org_id": sandbox.org_id, "sandbox_id": sandbox.id,
        }  # fmt: skip
        # Built-in providers name a sandbox by corral's id, so one whose handle was never
        # recorded (still being made, or its worker gave up) is found by that id.
        external_id = sandbox.external_id or sandbox.id
        return SandboxHandle(
            provider_id=sandbox.provider_id, external_id=external_id, metadata=metadata
        ), unrecorded


def _usage(rt: Runtime, handle: SandboxHandle) -> float | None:
    """CPU seconds, asked before the sandbox goes (its counters go with it)."""
    try:
        provider = rt.provider(handle.provider_id)
        if isinstance(provider, SupportsUsage):
            return provider.usage(handle).cpu_seconds
    except Exception:  # billing falls back to wall-clock; ending must not wait on this
        log.warning("usage not available", extra={"sandbox_id": handle.external_id},
                    exc_info=True)  # fmt: skip
    return None


def _record_end(
    rt: Runtime,
    sandbox_id: str,
    reason: TerminationReason,
    *,
    detail: str,
    actor: str,
    cpu_seconds: float | None,
) -> Ended:
    with rt.db.session() as session:
        item_id = session.scalar(select(Sandbox.work_item_id).where(Sandbox.id == sandbox_id))
        # Item first, then sandbox: the lock order every path that takes both uses.
        item = session.get_one(WorkItem, item_id, with_for_update=True)
        sandbox = session.get_one(Sandbox, sandbox_id, with_for_update=True)
        if sandbox.terminated_at is not None:
            return NOT_ENDED
        if reason in _FAILED_STATUS and sandbox.end_requested_at is not None:
            # It ended at the provider after its work reported: that is the normal end.
            reason, detail = TerminationReason.FINISHED, "its work item has ended"
        sandbox.lease_until = None  # fences a provision still in flight: it may not record
        sandbox.cpu_seconds = cpu_seconds
        sandbox.termination_reason = reason.value
        to = (
            SandboxStatusValue.FAILED if reason in _FAILED_STATUS else SandboxStatusValue.TERMINATED
        )
        sandbox_transition(session, sandbox, to, actor=actor, detail=f"{reason.value}: {detail}")
        current = sandbox.attempt == item.attempts and not ItemState(item.state).is_final
        if not current or reason in _WORK_ENDED:
            return Ended(ended=True, reason=reason)
        return _settle_item(session, item, reason, detail=detail, actor=actor,
                            max_attempts=rt.settings.max_attempts)  # fmt: skip


def _settle_item(
    session: Session,
    item: WorkItem,
    reason: TerminationReason,
    *,
    detail: str,
    actor: str,
    max_attempts: int,
) -> Ended:
    if ItemState(item.state) in _BEFORE_CLAIM and item.attempts < max_attempts:
        ended = f"attempt {item.attempts} ended ({reason.value}: {detail})"
        transition(session, item, ItemState.RECEIVED, actor=actor, detail=f"requeued: {ended}")
        return Ended(ended=True, reason=reason, requeued=item.id)
    if ItemState(item.state) in _BEFORE_CLAIM:
        detail = f"{detail}; gave up after {item.attempts} attempts"
    item.error_code = reason.value
    item.error_message = detail
    transition(session, item, ItemState.FAILED, actor=actor, detail=reason.value)
    return Ended(ended=True, reason=reason, failed=item.id)
