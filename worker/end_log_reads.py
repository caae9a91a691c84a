"""Reading the providers' own logs of sandboxes that end before their runner reported, for the
termination path (:mod:`corral.worker.termination`), without waiting on a provider that hangs.

Each read runs in a daemon thread of its own; a batch waits for its reads at most
``CORRAL_END_LOG_TIMEOUT_S`` in all, and what has not answered by then is not waited for (the
end is recorded without it). At most :data:`MAX_IN_FLIGHT` reads run in a process, hung ones
included: past that no read is started, so a provider that never answers costs a bounded
number of threads, and no sweep more than the timeout per batch.

What is kept of a log, and how it is redacted of the item's own env values (and the values
of the named secrets it used), is :mod:`corral.shared.end_logs`'s. An item whose env values
this process cannot open (another ``CORRAL_SECRET_KEY``) has no log read: it could not be
redacted.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import logging
import threading
from collections.abc import Sequence
from dataclasses import dataclass

from sqlalchemy import select
from sqlalchemy.orm import Session

from corral.providers.base import (
    END_LOG_MAX_BYTES,
    END_LOG_MAX_LINES,
    SandboxHandle,
    SupportsEndLog,
)
from corral.shared import end_logs
from corral.shared.runtime import Runtime
from corral.shared.store import secrets as named_secrets
from corral.shared.store.models import TerminationReason, WorkItem
from corral.shared.store.sealing import env_values

log = logging.getLogger(__name__)

# Ends whose sandbox's own log may say why: its runner never reported (it never claimed, was
# lost, or outran its deadline). Only while its work had not reported (no end requested).
WANTED = frozenset(
    {
        TerminationReason.NEVER_CLAIMED,
        TerminationReason.LOST,
        TerminationReason.GONE,
        TerminationReason.HEARTBEAT_LOST,
        TerminationReason.DEADLINE,
        TerminationReason.PROVISION_STUCK,
    }
)
MAX_IN_FLIGHT = 16
_IN_FLIGHT = threading.BoundedSemaphore(MAX_IN_FLIGHT)


@dataclass(frozen=True)
class LogRead:
    """A sandbox whose own log to read: its handle and its work item."""

    sandbox_id: str
    work_item_id: str
    handle: SandboxHandle


def read_end_logs(rt: Runtime, reads: Sequence[LogRead], *, timeout_s: float) -> dict[str, str]:
    """The kept end logs of ``reads`` that answered within ``timeout_s``, by sandbox id.
    Never raises: a provider that fails, hangs or has no log leaves its sandbox out."""
    if not reads:
        return {}
    try:
        secrets = _item_secrets(rt, {read.work_item_id for read in reads})
    except Exception:  # the database: the ends are recorded without their logs
        log.warning("could not read the items of sandboxes' end logs", exc_info=True)
        return {}
    started: dict[concurrent.futures.Future[str | None], LogRead] = {}
    for read in reads:
        if read.work_item_id not in secrets:
            continue
        future = _start(rt, read)
        if future is not None:
            started[future] = read
    done, late = concurrent.futures.wait(started, timeout=timeout_s)
    for future in late:
        log.warning(
            "a provider did not answer for a sandbox's end log in time: the end is recorded "
            "without it",
            extra={"sandbox_id": started[future].sandbox_id, "timeout_s": timeout_s},
        )
    kept: dict[str, str] = {}
    for future in done:
        read = started[future]
        text = _kept(future, read, secrets[read.work_item_id])
        if text is not None:
            kept[read.sandbox_id] = text
    return kept


def _item_secrets(rt: Runtime, item_ids: set[str]) -> dict[str, list[str]]:
    """Each item's env values, opened, and the values of the named secrets it used; an item
    whose values cannot be opened is left out."""
    with rt.db.session() as session:
        rows = session.execute(
            select(WorkItem.id, WorkItem.org_id, WorkItem.payload).where(WorkItem.id.in_(item_ids))
        ).all()
        named = _named_values(session, rt, {item_id: org_id for item_id, org_id, _ in rows})
        secrets: dict[str, list[str]] = {}
        for item_id, org_id, payload in rows:
            try:
                secrets[item_id] = [
                    *env_values(rt.db.sealer.open(payload or {}, org_id, item_id)),
                    *named[item_id],
                ]
            except Exception:  # another secret key: its log could not be redacted, so not read
                log.warning(
                    "an item's env values cannot be opened: no end log is read for it",
                    extra={"work_item_id": item_id},
                )
    return secrets


def _named_values(session: Session, rt: Runtime, items: dict[str, str]) -> dict[str, list[str]]:
    """The named secrets' values each item used: read for all at once, else (one cannot be
    opened here) item by item; an item whose values cannot be opened is missing (KeyError
    above, handled as its env's)."""
    keyring = rt.db.sealer.keyring
    try:
        return named_secrets.used_values(session, keyring, items)
    except Exception:
        values: dict[str, list[str]] = {}
        for item_id, org_id in items.items():
            with contextlib.suppress(Exception):
                values |= named_secrets.used_values(session, keyring, {item_id: org_id})
        return values


def _start(rt: Runtime, read: LogRead) -> concurrent.futures.Future[str | None] | None:
    """The read of one sandbox's log, started in a daemon thread; None when its provider has
    no log to read, or too many reads are in flight."""
    try:
        provider = rt.provider(read.handle.provider_id)
    except Exception:  # the end itself reports a provider that cannot be loaded
        return None
    if not isinstance(provider, SupportsEndLog):
        return None
    if not _IN_FLIGHT.acquire(blocking=False):
        log.warning(
            "too many end-log reads in flight (a provider hangs?): this one is not started",
            extra={"sandbox_id": read.sandbox_id, "in_flight": MAX_IN_FLIGHT},
        )
        return None
    future: concurrent.futures.Future[str | None] = concurrent.futures.Future()

    def run() -> None:
        try:
            answer = provider.end_log(
                read.handle, max_lines=END_LOG_MAX_LINES, max_bytes=END_LOG_MAX_BYTES
            )
        except BaseException as exc:  # the waiting side logs it
            future.set_exception(exc)
        else:
            future.set_result(answer)
        finally:
            _IN_FLIGHT.release()

    # A daemon: a read that never returns does not hold the process at its exit.
    threading.Thread(target=run, name="corral-end-log", daemon=True).start()
    return future


def _kept(
    future: concurrent.futures.Future[str | None], read: LogRead, secrets: list[str]
) -> str | None:
    try:
        raw = future.result()
    except Exception:
        log.warning(
            "a sandbox's end log could not be read",
            exc_info=True,
            extra={"sandbox_id": read.sandbox_id},
        )
        return None
    if raw is None:
        return None
    # As long as asked for: it may begin inside a line.
    cut = len(raw.encode(errors="replace")) >= END_LOG_MAX_BYTES
    return end_logs.keep(raw, secrets=secrets, cut=cut)
