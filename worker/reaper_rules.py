"""The reaper's rules, each declared once: a sandbox rule ends the sandboxes that meet its
conditions for its reason; the expiry rule fails the work items past their own expiry.

A rule's SQL (the sweep's query) and its re-check on a fresh row (just before the kill) are
both read from its declaration (:class:`Condition`); tests/unit/test_reaper_rules.py holds
each to the other. What a sweep does with them: :mod:`corral.worker.reaper`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any, Literal

from sqlalchemy import ColumnElement

from corral.providers.base import SandboxState
from corral.shared.settings import ReaperSettings
from corral.shared.store.budgets import BudgetState
from corral.shared.store.expiry import EXPIRED
from corral.shared.store.models import (
    FINAL_ITEM_STATES,
    ItemState,
    Sandbox,
    TerminationReason,
    WorkItem,
)

Reason = TerminationReason


@dataclass(frozen=True)
class Condition:
    """One test on a row (a sandbox's, or a work item's for the expiry rule), stated once
    and read both ways: as SQL for the sweep's query and in Python for the re-check on a
    fresh row just before the kill."""

    column: str
    test: Literal["is_null", "equals", "before", "one_of"]
    value: Any = None
    entity: type[Sandbox] | type[WorkItem] = Sandbox

    def sql(self) -> ColumnElement[bool]:
        column = getattr(self.entity, self.column)
        if self.test == "is_null":
            return column.is_(None)  # type: ignore[no-any-return]
        if self.test == "equals":
            return column == self.value  # type: ignore[no-any-return]
        if self.test == "one_of":
            return column.in_(self.value)  # type: ignore[no-any-return]
        return column < self.value  # type: ignore[no-any-return]

    def holds(self, row: Sandbox | WorkItem) -> bool:
        found = getattr(row, self.column)
        if self.test == "is_null":
            return found is None
        if self.test == "equals":
            return bool(found == self.value)
        if self.test == "one_of":
            return found in self.value
        return found is not None and bool(found < self.value)


def _where(conditions: Sequence[Condition]) -> tuple[ColumnElement[bool], ...]:
    return tuple(condition.sql() for condition in conditions)


def _all_hold(conditions: Sequence[Condition], row: Sandbox | WorkItem) -> bool:
    return all(condition.holds(row) for condition in conditions)


@dataclass(frozen=True)
class Rule:
    """Sandboxes meeting every condition end for ``reason``, oldest ``order_by`` first.
    Each rule is an equality and a range over one index (models.Sandbox): a live-rows
    partial index, or a (status, column) index; a spent budget's, equalities over the live
    sandboxes' org index."""

    reason: TerminationReason
    conditions: tuple[Condition, ...]
    order_by: str
    describe: Callable[[datetime | None, datetime | None], str]

    def where(self) -> tuple[ColumnElement[bool], ...]:
        return _where(self.conditions)

    def applies(self, sandbox: Sandbox) -> bool:
        return _all_hold(self.conditions, sandbox)


@dataclass(frozen=True)
class ItemRule:
    """Work items meeting every condition fail with ``code``, oldest ``order_by`` first:
    a range over a partial index of the items that carry that column (models.WorkItem)."""

    code: str
    conditions: tuple[Condition, ...]
    order_by: str

    def where(self) -> tuple[ColumnElement[bool], ...]:
        return _where(self.conditions)

    def applies(self, item: WorkItem) -> bool:
        return _all_hold(self.conditions, item)


_PENDING = tuple(sorted(state.value for state in ItemState if state not in FINAL_ITEM_STATES))


def expiry_rule(now: datetime) -> ItemRule:
    """The expiry rule at ``now``: items not final whose own ``expires_at`` has passed."""
    return ItemRule(
        EXPIRED,
        (
            Condition("expires_at", "before", now, WorkItem),
            # Every final state sets finished_at: the index holds the unfinished alone.
            Condition("finished_at", "is_null", None, WorkItem),
            Condition("state", "one_of", _PENDING, WorkItem),
        ),
        "expires_at",
    )


def _live_before(column: str, cutoff: datetime) -> tuple[Condition, ...]:
    return Condition("terminated_at", "is_null"), Condition(column, "before", cutoff)


def _in_status_before(status: SandboxState, column: str, cutoff: datetime) -> tuple[Condition, ...]:
    return Condition("status", "equals", status.value), Condition(column, "before", cutoff)


def rules(settings: ReaperSettings, now: datetime, spent: Sequence[BudgetState] = ()) -> list[Rule]:
    """The reaper's rules at ``now``, in the order they are applied: each declared once,
    its SQL and its re-check derived from the declaration; one more per budget of ``spent``
    (spent budgets whose policy is ``stop``), last."""

    def ago(seconds: float) -> datetime:
        return now - timedelta(seconds=seconds)

    heartbeat = f"no heartbeat from its runner for {settings.heartbeat_timeout_s:g} s"
    unclaimed = (
        "its runner did not claim the work before the registration token expired "
        f"({settings.token_ttl_s} s)"
    )
    stuck = f"still provisioning after {settings.provision_timeout_s:g} s"
    running, ready = SandboxState.RUNNING, SandboxState.READY
    provisioning = SandboxState.PROVISIONING
    return [
        Rule(
            Reason.FINISHED,
            _live_before("end_requested_at", ago(settings.finish_grace_s)),
            "end_requested_at",
            lambda *_: "its work item has ended",
        ),
        Rule(Reason.DEADLINE, _live_before("deadline_at", now), "deadline_at", _deadline_detail),
        Rule(
            Reason.HEARTBEAT_LOST,
            _in_status_before(running, "last_heartbeat_at", ago(settings.heartbeat_timeout_s)),
            "last_heartbeat_at",
            lambda *_: heartbeat,
        ),
        Rule(
            Reason.NEVER_CLAIMED,
            _in_status_before(ready, "started_at", ago(settings.token_ttl_s)),
            "started_at",
            lambda *_: unclaimed,
        ),
        Rule(
            Reason.PROVISION_STUCK,
            _in_status_before(provisioning, "created_at", ago(settings.provision_timeout_s)),
            "created_at",
            lambda *_: stuck,
        ),
        *(_budget_rule(state) for state in spent),
    ]


def _budget_rule(state: BudgetState) -> Rule:
    """Every live sandbox of a spent budget's org (or of its pool) ends."""
    budget = state.budget
    scope: tuple[Condition, ...] = (
        Condition("terminated_at", "is_null"),
        Condition("org_id", "equals", budget.org_id),
    )
    if budget.pool_id is not None:
        scope += (Condition("pool_id", "equals", budget.pool_id),)
    detail = f"its budget is spent and stops running work: {state.describe()}"
    return Rule(Reason.BUDGET_EXHAUSTED, scope, "created_at", lambda *_: detail)


def _deadline_detail(started: datetime | None, deadline: datetime | None) -> str:
    if started is None or deadline is None:
        return "it ran past its deadline"
    return f"it ran past its deadline ({(deadline - started).total_seconds():g} s after start)"
