"""The reaper's sweep: a sandbox nothing else ended is ended here, for a reason.

The lifecycle it closes: docs/architecture.md §6.

One sweep at a time (:mod:`corral.worker.sweep_lock`). A sweep

1. reads every budget's spend, warns of the thresholds it newly reached, and notes the spent
   budgets whose policy is ``stop`` (:mod:`corral.worker.budget_watch`);
   fails the work items not final by their own ``expires_at`` (the expiry rule: each fails
   as ``expired``, and a sandbox it had made gets the expiry as its deadline, so that the
   deadline rule below ends it);
   ends the interactive sessions idle past their ``idle_ttl_s`` or past their ``ttl_s``
   (``session_idle``, ``session_expired``: their work items are cancelled, their sandboxes
   join the stale ones), then finds the stale sandboxes, one indexed query per rule, each
   reading only the stale end of its index, so that its cost grows with the stale
   sandboxes, not with all of them: ``finished``, ``deadline``, ``heartbeat_lost``,
   ``never_claimed``, ``provision_stuck``, and ``budget_exhausted`` (every live sandbox of
   each spent ``stop`` budget's org or pool);
2. every ``reconcile_interval_s``, compares each provider's own list of sandboxes with the
   database: ``orphan`` (the provider holds it, the database does not know it or has ended
   it: terminate it), ``gone`` (alive here, the provider no longer has it: mark it ended),
   and ``sandbox_lost`` (the provider lists it as ended before its work reported);
3. ends them through :func:`corral.worker.termination.end_sandboxes`, a batch at a time in a few
   set-based statements, which settles their work items by their lease policies (requeue
   before the claim, or a lost runner when the policy says so, up to ``max_attempts``)
   and writes their cost events;
4. writes the cost events earlier attempts could not (the ledger's retry), and records that
   it finished (``maintenance_clock``, read by the api's metrics).

Reconciliation lists every sandbox a provider holds, so it costs what the provider holds;
it runs less often than the rules for that reason. A provider it cannot ask (not installed,
not configured, unreachable) is logged once per change of its state, not at every pass
(:mod:`corral.worker.provider_states`).
"""

from __future__ import annotations

import json
import logging
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from functools import partial
from typing import Any, NamedTuple

from sqlalchemy import Text, cast, func, select, union_all
from sqlalchemy.orm import Session, load_only

from corral.providers.base import ManagedSandbox, SandboxHandle, SandboxState, SupportsInventory
from corral.providers.registry import default_registry
from corral.shared import metrics
from corral.shared.runtime import Runtime
from corral.shared.store.budgets import BudgetState
from corral.shared.store.db import utcnow
from corral.shared.store.expiry import expire_items
from corral.shared.store.interactive_ends import lapsed_sessions
from corral.shared.store.ledger import record_due_costs
from corral.shared.store.liveness import SWEEP_DONE, record_phase
from corral.shared.store.models import (
    Pool,
    Sandbox,
    TerminationReason,
    WarmSandbox,
    WarmState,
    WorkItem,
)
from corral.shared.store.slots import reconcile_slot_counts
from corral.worker.budget_watch import watch_budgets
from corral.worker.provider_states import ProviderStates
from corral.worker.reaper_rules import expiry_rule, rules
from corral.worker.sweep_lock import SweepLock
from corral.worker.termination import EndRequest, end_sandboxes

log = logging.getLogger(__name__)

Reason = TerminationReason
_CHUNK = 500  # ids per IN (...) lookup while reconciling


# A sandbox a rule says must end, and why; ``still_applies`` is the rule, re-checked on a
# fresh read just before the kill (rows change mid-sweep).
Stale = EndRequest


@dataclass
class SweepReport:
    """What one sweep did; returned by the task and logged."""

    skipped: bool = False
    ended: Counter[str] = field(default_factory=Counter)  # by reason
    orphans: list[str] = field(default_factory=list)  # sandbox ids terminated as orphans
    requeued: list[str] = field(default_factory=list)  # item ids sent back to routing
    # Those of them backing off: the re-drive routes each once its not_before has come.
    backing_off: list[str] = field(default_factory=list)
    failed: list[str] = field(default_factory=list)  # item ids failed with the reason
    expired: list[str] = field(default_factory=list)  # item ids failed past their expires_at
    costs_written: int = 0
    errors: int = 0

    def summary(self) -> dict[str, object]:
        return {
            "skipped": self.skipped,
            "ended": dict(self.ended),
            "orphans": len(self.orphans),
            "requeued": len(self.requeued),
            "failed": len(self.failed),
            "expired": len(self.expired),
            "costs_written": self.costs_written,
            "errors": self.errors,
        }


def sweep(rt: Runtime, lock: SweepLock, *, actor: str = "reaper") -> SweepReport:
    """One sweep, if no other sweep is running (else a skipped report, and a log line)."""
    if not lock.acquire():
        log.info("reaper sweep skipped: another sweep holds the lock")
        return SweepReport(skipped=True)
    report = SweepReport()
    try:
        now = utcnow()
        spent = _spent_budgets(rt, now, actor, report)
        # Expired items first: the deadline rule then ends the sandboxes they had made.
        expire(rt, now, actor, report)
        # Sessions first: a sandbox two rules match is ended for the first.
        stale = lapsed_session_sandboxes(rt, now, actor) + find_stale(rt, now, spent)
        if lock.due("reconcile", rt.settings.reconcile_interval_s):
            stale += reconcile(rt, report, renew=lock.renew)
            reconcile_slot_counts(rt.db)
        if lock.renew():
            _end(rt, stale, actor, report, lock.renew)
        if lock.renew():
            due = record_due_costs(rt.db, limit=rt.settings.reaper_batch)
            report.costs_written = len(due.written)
            report.errors += due.failed
            record_phase(rt.db, SWEEP_DONE)
    finally:
        lock.release()
    log.info("reaper sweep done", extra=report.summary())
    return report


def _end(
    rt: Runtime, stale: list[Stale], actor: str, report: SweepReport, renew: Callable[[], bool]
) -> None:
    endings = end_sandboxes(rt, stale, actor=actor, renew=renew)
    reasons = {candidate.sandbox_id: candidate.reason for candidate in reversed(stale)}
    for sandbox_id, error in endings.errors.items():
        # The next sweep tries again; one failure does not stop the rest.
        report.errors += 1
        extra = {"sandbox_id": sandbox_id, "reason": reasons[sandbox_id].value}
        log.warning("reaper could not end a sandbox", exc_info=error, extra=extra)
    for sandbox_id, outcome in endings.ended.items():
        reason = (outcome.reason or reasons[sandbox_id]).value
        report.ended[reason] += 1
        metrics.SANDBOXES_REAPED.labels(reason=reason).inc()
        if outcome.requeued:
            report.requeued.append(outcome.requeued)
            if outcome.not_before is not None:
                report.backing_off.append(outcome.requeued)
        if outcome.failed:
            report.failed.append(outcome.failed)


def _spent_budgets(
    rt: Runtime, now: datetime, actor: str, report: SweepReport
) -> list[BudgetState]:
    try:
        return watch_budgets(rt, now, actor=actor)
    except Exception:  # the other rules still run; the next sweep tries again
        report.errors += 1
        log.warning("reaper could not read the budgets", exc_info=True)
        return []


# -- the rules (declared in corral.worker.reaper_rules) ------------------------------------


def lapsed_session_sandboxes(rt: Runtime, now: datetime, actor: str) -> list[Stale]:
    """The session rule (docs/sessions.md): interactive sessions idle past their
    ``idle_ttl_s`` or past their ``ttl_s`` are ended (their work items cancelled) here;
    their sandboxes, to end with the reason."""
    try:
        lapsed = lapsed_sessions(rt.db, now, limit=rt.settings.reaper_batch, actor=actor)
    except Exception:  # the other rules still run; the next sweep tries again
        log.warning("reaper could not end lapsed sessions", exc_info=True)
        return []
    return [
        Stale(one.sandbox_id, one.reason, one.detail)
        for one in lapsed
        if one.sandbox_id is not None
    ]


def expire(rt: Runtime, now: datetime, actor: str, report: SweepReport) -> None:
    """Fail the items past their own expiry (docs/dispatch.md#expiry), at most
    ``reaper_batch``, soonest expired first; the sandboxes they had made get the expiry as
    their deadline, so the deadline rule, applied after this one, ends them. Items another
    path holds locked are left for the next sweep."""
    rule = expiry_rule(now)
    try:
        with rt.db.session() as session:
            rows = session.scalars(
                select(WorkItem)
                .options(load_only(WorkItem.state, WorkItem.pool_id, WorkItem.expires_at))
                .where(*rule.where())
                .order_by(getattr(WorkItem, rule.order_by))
                .limit(rt.settings.reaper_batch)
                .with_for_update(skip_locked=True)
            ).all()
            expired = expire_items(
                session, [item for item in rows if rule.applies(item)], actor=actor
            )
    except Exception:  # the other rules still run; the next sweep tries again
        report.errors += 1
        log.warning("reaper could not fail the expired items", exc_info=True)
        return
    report.expired += expired
    if expired:
        log.info("items expired", extra={"items": len(expired)})


def find_stale(rt: Runtime, now: datetime, spent: Sequence[BudgetState] = ()) -> list[Stale]:
    """Each rule's stale sandboxes, oldest first, at most ``reaper_batch`` per rule; a
    sandbox two rules match is ended for the first. ``spent``: the spent budgets that stop
    their sandboxes."""
    found: dict[str, Stale] = {}
    with rt.db.session() as session:
        for rule in rules(rt.settings, now, spent):
            query = (
                select(Sandbox.id, Sandbox.started_at, Sandbox.deadline_at)
                .where(*rule.where())
                .order_by(getattr(Sandbox, rule.order_by))
                .limit(rt.settings.reaper_batch)
            )
            for sandbox_id, started, deadline in session.execute(query):
                if sandbox_id not in found:
                    found[sandbox_id] = Stale(
                        sandbox_id,
                        rule.reason,
                        rule.describe(started, deadline),
                        still_applies=rule.applies,
                    )
    return list(found.values())


# -- reconciliation -----------------------------------------------------------------------


def reconcile(
    rt: Runtime, report: SweepReport, *, renew: Callable[[], bool] = lambda: True
) -> list[Stale]:
    """Compare each provider that can list its sandboxes with the database.

    Orphans are terminated here (there is nothing to record); gone and died sandboxes come
    back as :class:`Stale` for the sweep to end.
    """
    with rt.db.session() as session:
        provider_ids = sorted(set(session.scalars(select(Pool.provider_id).distinct())))
    stale: list[Stale] = []
    states = rt.part("provider-states", lambda _: ProviderStates())
    for provider_id in _known(rt, provider_ids):
        if not renew():
            break
        try:
            stale += _reconcile_provider(rt, provider_id, report)
        except Exception as exc:  # an unreachable provider is compared again next time
            report.errors += 1
            states.failed(provider_id, exc, doing="reconciliation")  # said once a change
        else:
            states.answered(provider_id)
    return stale


_UNKNOWN_WARNED: set[str] = set()


def _known(rt: Runtime, provider_ids: list[str]) -> list[str]:
    """The ids corral has a provider for; pools left from one it has not (a pool made before
    ids were checked) are said once per process, not failed on every sweep."""
    known = [provider_id for provider_id in provider_ids if rt.knows_provider(provider_id)]
    for provider_id in sorted(set(provider_ids) - set(known) - _UNKNOWN_WARNED):
        _UNKNOWN_WARNED.add(provider_id)
        log.warning(
            "pools name provider %r, which corral does not have (known: %s): their sandboxes "
            "are not reconciled; disable or delete those pools",
            provider_id,
            ", ".join(default_registry.known_ids()),
        )
    return known


def _reconcile_provider(rt: Runtime, provider_id: str, report: SweepReport) -> list[Stale]:
    """One provider's pass, in statements that do not grow with its live sandboxes: one read
    of the live set, one lookup of what the provider lists that the set lacks (per
    ``_CHUNK`` of those), and the ends of what differs, which the sweep writes a batch at a
    time (:func:`corral.worker.termination.end_sandboxes`)."""
    provider = rt.provider(provider_id)
    if not isinstance(provider, SupportsInventory):
        return []
    # Order matters. The database's live set is read before the provider's list, so a
    # sandbox recorded as made is in that list unless it is really gone; the provider is
    # listed before its unknown entries are looked up, and every sandbox's row is written
    # before the provider is asked to make it, so a sandbox being made is never unknown.
    with rt.db.session() as session:
        recorded = _recorded_live(session, provider_id)
    listed = {managed.sandbox_id: managed for managed in provider.list_managed()}
    with rt.db.session() as session:
        known_live = _live_among(session, [i for i in listed if i not in recorded])
    stale: list[Stale] = []
    for listed_id, managed in listed.items():
        live = recorded.get(listed_id)
        if live is None and listed_id not in known_live:
            _guarded(report, listed_id, partial(_terminate_orphan, rt, managed, report))
        elif live is not None and managed.state is not None and managed.state.is_final:
            confirm = partial(_confirm_ended, rt, live.sandbox_id, live.handle(), died=True)
            stale += _guarded(report, live.sandbox_id, confirm)
    for listed_id, live in recorded.items():
        if listed_id not in listed:
            confirm = partial(_confirm_ended, rt, live.sandbox_id, live.handle(), died=False)
            stale += _guarded(report, live.sandbox_id, confirm)
    return stale


def _guarded(report: SweepReport, sandbox_id: str, step: Callable[[], Any]) -> list[Stale]:
    """Run one sandbox's step; a failure is logged and counted, and the next one goes on."""
    try:
        result = step()
    except Exception:
        report.errors += 1
        log.warning("reconciliation step failed", exc_info=True, extra={"sandbox_id": sandbox_id})
        return []
    return result if isinstance(result, list) else []


class _Recorded(NamedTuple):
    """A live sandbox as the database records it: what asking its provider about it takes.
    Plain values, its metadata still JSON text: a pass reads every live sandbox, and builds
    a handle only for those that differ."""

    provider_id: str
    sandbox_id: str
    external_id: str
    metadata: str | None
    org_id: str

    def handle(self) -> SandboxHandle:
        metadata = json.loads(self.metadata) if self.metadata else None
        return SandboxHandle(
            provider_id=self.provider_id,
            external_id=self.external_id,
            metadata=metadata or {"org_id": self.org_id},
        )


def _recorded_live(session: Session, provider_id: str) -> dict[str, _Recorded]:
    """Live sandboxes of ``provider_id`` whose handle is recorded (made, not being made), by
    the id the provider lists each under: a work item's sandbox bound from a warm sandbox is
    listed under the warm sandbox's id. One statement, however many there are, its rows
    read as the driver gives them (no ORM rows, no JSON decoded)."""
    bound_from = (WarmSandbox.sandbox_id == Sandbox.id) & (
        WarmSandbox.state == WarmState.BOUND.value
    )
    rows = session.connection().execute(
        select(
            func.coalesce(WarmSandbox.id, Sandbox.id),
            Sandbox.id,
            Sandbox.external_id,
            cast(Sandbox.handle_metadata, Text),
            Sandbox.org_id,
        )
        .outerjoin(WarmSandbox, bound_from)
        .where(
            Sandbox.provider_id == provider_id,
            Sandbox.terminated_at.is_(None),
            Sandbox.external_id.is_not(None),
        )
    )
    return {
        listed_id: _Recorded(provider_id, sandbox_id, str(external_id), metadata, org_id)
        for listed_id, sandbox_id, external_id, metadata, org_id in rows
    }


def _live_among(session: Session, sandbox_ids: list[str]) -> set[str]:
    """The ids among ``sandbox_ids`` of live sandboxes, or of warm sandboxes not yet bound or
    ended (the warm tick ends those: docs/warm-pools.md), or bound to a live one: one
    statement per ``_CHUNK`` of ids (a pass's lookup is of what its live set lacks)."""
    live: set[str] = set()
    unbound = WarmSandbox.state.in_([WarmState.BOOTING.value, WarmState.WAITING.value])
    # Bound, and its item's sandbox not ended (its handle may not be recorded yet: the bind
    # commits first).
    bound = (WarmSandbox.state == WarmState.BOUND.value) & Sandbox.terminated_at.is_(None)
    for start in range(0, len(sandbox_ids), _CHUNK):
        chunk = sandbox_ids[start : start + _CHUNK]
        live_sandboxes = select(Sandbox.id).where(
            Sandbox.id.in_(chunk), Sandbox.terminated_at.is_(None)
        )
        live_warm = (
            select(WarmSandbox.id)
            .outerjoin(Sandbox, Sandbox.id == WarmSandbox.sandbox_id)
            .where(WarmSandbox.id.in_(chunk), unbound | bound)
        )
        live.update(session.scalars(union_all(live_sandboxes, live_warm)))
    return live


def _terminate_orphan(rt: Runtime, managed: ManagedSandbox, report: SweepReport) -> None:
    rt.provider(managed.handle.provider_id).terminate(managed.handle)
    report.orphans.append(managed.sandbox_id)
    report.ended[Reason.ORPHAN.value] += 1
    metrics.SANDBOXES_REAPED.labels(reason=Reason.ORPHAN.value).inc()
    log.warning(
        "terminated an orphan sandbox (unknown here, or ended here already)",
        extra={
            "sandbox_id": managed.sandbox_id,
            "provider_id": managed.handle.provider_id,
            # An orphan has no row: its org is its label's, it belongs to no pool here.
            "org_id": managed.labels.get("corral.org-id"),
            "pool_id": None,
        },
    )


def _confirm_ended(
    rt: Runtime, sandbox_id: str, handle: SandboxHandle, *, died: bool
) -> list[Stale]:
    """Ask the provider itself before acting on a listing (lists can lag behind)."""
    status = rt.provider(handle.provider_id).status(handle)
    if not status.state.is_final:
        return []
    reason = status.reason or "no reason given"
    if died or status.state is not SandboxState.TERMINATED:
        # It ended on its own before its work reported (killed, crashed, out of memory).
        return [
            Stale(sandbox_id, Reason.LOST, f"the sandbox ended before the work reported: {reason}")
        ]
    return [Stale(sandbox_id, Reason.GONE, f"the provider no longer has it: {reason}", kill=False)]
