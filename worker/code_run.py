"""The code-interpreter transport's database side: a ``code`` item the provider worker runs
itself, through a provider that executes code (``SupportsCodeInterpreter``), with no runner.

After the claim (the sandbox row under this worker's lease), the provider makes its
sandbox or context and, just before it sends the execute call, calls :class:`ExecuteGate`:
that moves the sandbox and the item to ``running`` and gives up the lease, in one
transaction. From then on the attempt counts as started, so a redelivered task finds the
item running and does nothing (a work item never runs twice), and an error is final for the
attempt. Before it, a transient error is retried like a provision's (nothing ran).

The outcome is recorded as a runner's completion would be (:mod:`corral.shared.store.completion`):
stdout and stderr as the item's log lines within its budget, the exit code, the result,
``succeeded`` or ``failed``; the sandbox ``terminated`` (the provider ended it already), and
its one cost event through the ledger. The registration token minted with the claim is
never used: it is revoked at once.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import datetime, timedelta

from sqlalchemy.orm import Session

from corral.providers.base import CodeRun, SandboxHandle, SandboxState
from corral.shared.errors import CorralError
from corral.shared.settings import CoreSettings
from corral.shared.store.completion import MAX_LINE, record_result, store_logs
from corral.shared.store.db import Database, utcnow
from corral.shared.store.ledger import record_cost_quietly
from corral.shared.store.lifecycle import (
    SandboxEnd,
    record_sandbox_ends,
    sandbox_transition,
    transition,
)
from corral.shared.store.models import ItemState, Sandbox, TerminationReason, WorkItem

log = logging.getLogger(__name__)

# The reaper's deadline for a running code item: its limit plus this, for the worker to
# record the outcome (the provider enforces the limit itself).
RECORD_GRACE_S = 30
TIMEOUT_EXIT_CODE = 124  # what `timeout` answers for a command it stopped


class Superseded(CorralError):  # noqa: N818 - a signal to the provision path
    """The attempt is no longer this worker's (taken over, or its item ended): the code
    must not be executed."""

    code = "superseded"


@dataclass
class ExecuteGate:
    """The ``on_execute`` hook the worker hands the provider: marks the attempt started."""

    db: Database
    work_item_id: str
    sandbox_id: str
    lease_until: datetime
    limit_s: float
    actor: str
    sent: bool = field(default=False, init=False)

    def __call__(self, handle: SandboxHandle) -> None:
        """Move the sandbox and item to ``running`` if the attempt is still ours.

        Raises:
            Superseded: the lease was taken over, or the item ended meanwhile (then the
                sandbox's end is recorded).
        """
        with self.db.session() as session:
            item = session.get(WorkItem, self.work_item_id, with_for_update=True)
            sandbox = session.get(Sandbox, self.sandbox_id, with_for_update=True)
            assert item is not None and sandbox is not None
            superseded = self._superseded(session, item, sandbox)
            if superseded is None:
                self._start(session, item, sandbox, handle)
        if superseded is not None:
            raise Superseded(superseded)
        self.sent = True  # committed: from here on the attempt has started

    def _superseded(self, session: Session, item: WorkItem, sandbox: Sandbox) -> str | None:
        if sandbox.lease_until != self.lease_until or sandbox.terminated_at is not None:
            return "another delivery took this attempt over"
        if ItemState(item.state) is not ItemState.PROVISIONING:
            _end_unstarted(session, sandbox, item, self.actor)
            return f"the work item is {item.state}"
        return None

    def _start(
        self, session: Session, item: WorkItem, sandbox: Sandbox, handle: SandboxHandle
    ) -> None:
        now = utcnow()
        sandbox.external_id = handle.external_id
        sandbox.handle_metadata = dict(handle.metadata)
        sandbox.started_at = sandbox.last_heartbeat_at = now
        sandbox.deadline_at = now + timedelta(seconds=self.limit_s + RECORD_GRACE_S)
        sandbox.lease_until = None
        detail = f"code interpreter: executing in {handle.external_id}"
        sandbox_transition(session, sandbox, SandboxState.RUNNING, actor=self.actor, at=now)
        # Made and started at once: the table stamps it provisioned as well as claimed.
        transition(session, item, ItemState.RUNNING, actor=self.actor, detail=detail, at=now)


def _end_unstarted(session: Session, sandbox: Sandbox, item: WorkItem, actor: str) -> None:
    """The item ended (cancelled) while its sandbox was made: record the sandbox's end."""
    reason = (
        TerminationReason.CANCELLED
        if item.state == ItemState.CANCELLED
        else TerminationReason.FINISHED
    )
    end = SandboxEnd(
        sandbox.id,
        sandbox.work_item_id,
        sandbox.status,
        SandboxState.TERMINATED,
        reason,
        "its work item ended before the code was executed",
    )
    record_sandbox_ends(session, [end], actor=actor)


def record_run(
    db: Database,
    settings: CoreSettings,
    gate: ExecuteGate,
    run: CodeRun,
    *,
    provider_id: str,
) -> ItemState | None:
    """Record what the code did, as a runner's completion is recorded; bill the sandbox.
    None when the item had ended meanwhile (cancelled: its end was recorded there)."""
    error, error_code = run.error, None
    if run.timed_out:
        error_code = "work_timeout"
        error = (
            f"the code ran past its time limit of {gate.limit_s:g} s at {provider_id} and "
            "was stopped"
        )
    final: ItemState | None = None
    with db.session() as session:
        item, sandbox = _lock(session, gate)
        if ItemState(item.state) is ItemState.RUNNING:
            store_logs(
                session,
                item,
                _log_lines(run, provider_id, error),
                max_bytes=settings.log_budget_bytes,
                max_lines=settings.log_budget_lines,
            )
            _end_sandbox(session, sandbox, gate.actor, "the code ran to its end")
            final = record_result(
                session,
                item,
                exit_code=run.exit_code,
                result=run.result,
                duration_s=run.duration_s,
                error=error,
                error_code=error_code,
                actor=gate.actor,
                max_attempts=settings.max_attempts,
            )
        else:
            _end_sandbox(session, sandbox, gate.actor, f"its work item is {item.state}")
    record_cost_quietly(db, gate.sandbox_id)
    return final


def record_failure(db: Database, gate: ExecuteGate, code: str, message: str) -> bool:
    """The attempt failed after the execute call was sent: fail the item (unless it ended
    meanwhile) with ``code``; end and bill the sandbox. True when the item was failed."""
    failed = False
    with db.session() as session:
        item, sandbox = _lock(session, gate)
        now = utcnow()
        _end_sandbox(session, sandbox, gate.actor, message, state=SandboxState.FAILED, at=now)
        if ItemState(item.state) is ItemState.RUNNING:
            item.error_code = code
            item.error_message = message
            transition(session, item, ItemState.FAILED, actor=gate.actor, detail=code, at=now)
            failed = True
    record_cost_quietly(db, gate.sandbox_id)
    log.warning(
        "code run failed",
        extra={"work_item_id": gate.work_item_id, "sandbox_id": gate.sandbox_id, "code": code},
    )
    return failed


def _lock(session: Session, gate: ExecuteGate) -> tuple[WorkItem, Sandbox]:
    # Item first, then sandbox: the order every path that locks both uses.
    item = session.get(WorkItem, gate.work_item_id, with_for_update=True)
    sandbox = session.get(Sandbox, gate.sandbox_id, with_for_update=True)
    assert item is not None and sandbox is not None
    return item, sandbox


def _end_sandbox(
    session: Session,
    sandbox: Sandbox,
    actor: str,
    detail: str,
    *,
    state: SandboxState = SandboxState.TERMINATED,
    at: datetime | None = None,
) -> None:
    """The provider ended the sandbox after the run: record it (once), before the item's
    end would ask for it."""
    if sandbox.terminated_at is not None:
        return
    end = SandboxEnd(
        sandbox.id, sandbox.work_item_id, sandbox.status, state, TerminationReason.FINISHED, detail
    )
    record_sandbox_ends(session, [end], actor=actor, at=at)


def _log_lines(run: CodeRun, provider_id: str, error: str | None) -> Iterator[tuple[str, str]]:
    yield "system", f"work: python code, main(**arguments), at {provider_id}"
    for stream, text in (("stdout", run.stdout), ("stderr", run.stderr)):
        for line in text.splitlines():
            yield stream, line[:MAX_LINE]
    if error:
        yield "system", error
