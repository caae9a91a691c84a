"""Recording a work item's outcome: its log lines within the item's budget, and its end.

Two paths finish work items this way: a runner's ``logs`` and ``complete`` calls
(:mod:`corral.scheduler.api.runner_api`), and the provider worker that ran a ``code`` item at a
code interpreter itself (:mod:`corral.worker.code_run`). Both store the same rows, so an
item's outcome reads the same whichever way it ran.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any

from sqlalchemy.orm import Session

from corral.shared.store import attempts
from corral.shared.store.db import utcnow
from corral.shared.store.leases import Lease, gave_up, in_force
from corral.shared.store.lifecycle import requeue, transition
from corral.shared.store.models import ItemState, WorkItem, WorkItemLog

MAX_LINE = 8192  # characters of one stored log line
MAX_RESULT_BYTES = 1_000_000  # of JSON: a larger result is not stored, the item fails
RESULT_TOO_LARGE = "result_too_large"
WORK_FAILED = "work_failed"


def within_budget(
    item: WorkItem, lines: Iterable[tuple[str, str]], *, max_bytes: int, max_lines: int
) -> list[tuple[str, str]]:
    """The ``(stream, line)`` pairs that still fit in ``item``'s log budget, counted on the
    item (whose row the caller holds locked). Once one does not fit, no later line is kept
    either, so a stored log is always the beginning of what was sent; the others are
    counted as dropped."""
    kept: list[tuple[str, str]] = []
    for stream, line in lines:
        # PostgreSQL text cannot hold NUL; a process's output may.
        text = line[:MAX_LINE].replace("\x00", "\ufffd")
        size = len(text.encode("utf-8"))
        full = item.log_lines >= max_lines or item.log_bytes + size > max_bytes
        if item.log_dropped_lines or full:
            item.log_dropped_lines += 1
            continue
        item.log_lines += 1
        item.log_bytes += size
        kept.append((stream, text))
    return kept


def store_logs(
    session: Session,
    item: WorkItem,
    lines: Iterable[tuple[str, str]],
    *,
    max_bytes: int,
    max_lines: int,
) -> int:
    """Store the lines of ``lines`` that fit in the item's budget; how many were kept."""
    kept = within_budget(item, lines, max_bytes=max_bytes, max_lines=max_lines)
    session.add_all(
        WorkItemLog(work_item_id=item.id, stream=stream, line=text) for stream, text in kept
    )
    return len(kept)


def record_result(
    session: Session,
    item: WorkItem,
    *,
    exit_code: int,
    result: Any,
    duration_s: float | None,
    error: str | None,
    actor: str,
    phase: str = "work",
    cancelled: bool = False,
    error_code: str | None = None,
    max_attempts: int,
) -> ItemState:
    """End a running ``item`` with its exit code and result: ``succeeded`` when the work
    exited 0 without an error, else ``failed`` (``<phase>_failed``, or ``error_code``) or
    ``cancelled``. The caller holds the item's row locked. A result over
    :data:`MAX_RESULT_BYTES` of JSON (or one a runner kept back for that reason, saying
    ``result_too_large``) is not stored: the item fails ``result_too_large``.

    A work phase that failed (``work_failed``) of an item whose lease policy retries failed
    work, with attempts left, is requeued instead (``received``, nothing of the result
    kept); ``max_attempts`` is the deployment's, for an item with no policy stored."""
    size = len(json.dumps(result))
    if size > MAX_RESULT_BYTES:
        result, error_code = None, RESULT_TOO_LARGE
        error = (
            f"the work's result is {size} bytes of JSON, more than the limit of "
            f"{MAX_RESULT_BYTES} bytes; return less (write large output to files or logs)"
        )
    elif error_code == RESULT_TOO_LARGE:  # the runner measured it and kept it back
        result = None
        error = error or f"the work's result is larger than the limit of {MAX_RESULT_BYTES} bytes"
    failed = exit_code != 0 or bool(error) or cancelled or error_code is not None
    if failed and not cancelled and error_code is None and phase == "work":
        lease = in_force(item.lease, max_attempts=max_attempts)
        made = _made_attempts(session, item) if lease.retry_on_work_failed else item.attempts
        if lease.retry_on_work_failed and made < lease.max_attempts:
            what = f"work exited with code {exit_code}"
            _retry(session, item, lease, made=made, what=what, actor=actor)
            return ItemState.RECEIVED
        if lease.retry_on_work_failed:
            error = f"{error or f'work exited with code {exit_code}'}; {gave_up(made)}"
    item.exit_code = exit_code
    item.result = result
    item.duration_s = duration_s
    if not failed:
        final = ItemState.SUCCEEDED
    else:
        final = ItemState.CANCELLED if cancelled else ItemState.FAILED
        item.error_code = "cancelled" if cancelled else error_code or f"{phase}_failed"
        error = error.replace("\x00", "\ufffd") if error else None
        item.error_message = error or f"{phase} exited with code {exit_code}"
    transition(session, item, final, actor=actor, detail=f"exit code {exit_code}")
    return final


def _made_attempts(session: Session, item: WorkItem) -> int:
    """The item's attempts that got a sandbox: what its lease's ``max_attempts`` counts."""
    unmade = attempts.unmade_attempts(session, [item.id]).get(item.id, 0)
    return attempts.made_attempts(item.attempts, unmade)


def _retry(
    session: Session, item: WorkItem, lease: Lease, *, made: int, what: str, actor: str
) -> None:
    """Route ``item`` again after its work failed (its lease retries failed work): nothing
    of this attempt's outcome is kept on the item but its logs and the audit row. ``made``:
    its attempts that got a sandbox (the back-off counts those)."""
    not_before = lease.not_before(made, utcnow())
    detail = f"requeued: attempt {item.attempts} ended ({WORK_FAILED}: {what})"
    if not_before is not None:
        detail += f"; routed again from {not_before.isoformat(timespec='seconds')}"
    requeue(session, item, not_before=not_before, actor=actor, detail=detail)
