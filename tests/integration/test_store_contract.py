"""The store's contract: each state change leaves the same rows whichever path runs it, on
SQLite (``corral dev``, the fast test tier) and on PostgreSQL.

The claim has one definition (:func:`corral.worker.claims.claim`) with a strategy per
database: Core steps on SQLite, one statement of CTEs on PostgreSQL. It is reached batched
(:func:`corral.worker.claims.claim_routed`, on a connection of its own) and one by one
(:func:`corral.worker.provision._claim`, for an item a batch skipped: on the transaction
that holds the item locked). The handle write likewise (:func:`corral.worker.claims.
write_handles`), batched (:func:`corral.worker.claims.record_handles`) and one by one
(:func:`corral.worker.provision._record_handle`). Each path starts from the same rows (a
routed item of the in-memory pool), and what it leaves — the item, its sandbox row, its
token's row (the hash of the token handed out, never the token), the audit rows, the pool's
slot counter — is compared with every other's and with :data:`CLAIMED` and :data:`HANDLED`,
on each database: so the steps SQLite runs are held to the rows of the statement
PostgreSQL runs. Ids are the item's (``<item>``); a time is ``before`` (written before the
change), or its offset from the change's instant: one change is one instant, its stamps,
events and the token's expiry all counted from it. Neither owes an outcome: no outbox row.

An item the intake ends (a dispatch error) is written batched
(:func:`corral.scheduler.batch.accept_batch`: the item made in its final state, its outcome
noted with it) and one by one (:func:`corral.scheduler.intake.take_one`: made, then moved by
its transition); both leave the same item and the same outbox row, the reply owed to the
Celery message that made it, due from the instant of its end.
"""

from __future__ import annotations

import dataclasses
import shutil
from collections.abc import Callable, Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import func, select

from corral.providers.base import SandboxHandle
from corral.providers.testing import InMemoryProvider
from corral.scheduler.batch import accept_batch
from corral.scheduler.intake import Origin, take_one
from corral.shared.broker.callbacks import Callback, Reply
from corral.shared.messages import DispatchRequest
from corral.shared.runtime import Runtime
from corral.shared.settings import CoreSettings
from corral.shared.store.db import Database, make_engine, utcnow
from corral.shared.store.models import (
    LifecycleEvent,
    OutcomeOutbox,
    Pool,
    RegistrationToken,
    Sandbox,
    WorkItem,
)
from corral.shared.store.tokens import hash_token
from corral.worker import provision
from corral.worker.claims import ClaimRequest, Delivery, Fresh, HandleWrite, claim_routed
from corral.worker.claims import record_handles as record_handles_batched
from tests.seeding import SETTINGS, in_memory_pool

LEASE_S, TOKEN_TTL_S, SESSION_LIMIT_S = 300, 900, 3600
DELIVERY = Delivery("task-1", 2)
ACTOR = "worker:contract"

Snapshot = dict[str, Any]


@pytest.fixture(params=["sqlite", "postgresql"])
def rt(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Runtime]:
    """A runtime with the in-memory provider and its pool, on a database of the test's own."""
    if request.param == "sqlite":
        path = tmp_path / "corral.db"
        shutil.copyfile(request.getfixturevalue("sqlite_template"), path)
        url = f"sqlite:///{path}"
    else:
        url = request.getfixturevalue("fresh_pg_url")
    settings = CoreSettings(state_dir=tmp_path, provision_lease_s=LEASE_S, token_ttl_s=TOKEN_TTL_S)
    db = Database(make_engine(url, settings=settings))
    in_memory_pool(db)
    runtime = Runtime(settings=settings, db=db)
    runtime.use_provider(InMemoryProvider())
    yield runtime
    db.dispose()


def routed(db: Database) -> str:
    """A new routed item of the in-memory pool (every one alike but for its id)."""
    request = DispatchRequest.model_validate(
        {
            "org": "acme",
            "project": "web",
            "profile": "default",
            "work": {"kind": "shell", "command": "echo same"},
        }
    )
    [taken] = accept_batch(db, [request], actor="test", settings=SETTINGS)
    assert taken.outcome.queue == "provision.in-memory"
    return taken.item_id


def changed_by(db: Database, item_id: str, change: Callable[[], str | None]) -> Snapshot:
    """The rows of ``item_id`` after ``change`` (which answers the token it handed out, if
    any), the events it added and the slots it took, normalised (see the module)."""
    with db.session() as session:
        last_event = session.scalar(select(func.max(LifecycleEvent.id))) or 0
        slots_before = session.get_one(Pool, "pool-mem").slots_in_use
    started = utcnow()
    token = change()
    with db.session() as session:
        rows: Snapshot = {
            "item": _columns(session.get_one(WorkItem, item_id)),
            "sandboxes": [
                _columns(row)
                for row in session.scalars(
                    select(Sandbox).where(Sandbox.work_item_id == item_id).order_by(Sandbox.id)
                )
            ],
            "tokens": [
                _columns(row) | {"token_hash": _hash_of(row.token_hash, token)}
                for row in session.scalars(
                    select(RegistrationToken)
                    .where(RegistrationToken.work_item_id == item_id)
                    .order_by(RegistrationToken.id)
                )
            ],
            "events": [
                _columns(row)
                for row in session.scalars(
                    select(LifecycleEvent)
                    .where(LifecycleEvent.id > last_event)
                    .order_by(LifecycleEvent.id)
                )
            ],
            "slots taken": session.get_one(Pool, "pool-mem").slots_in_use - slots_before,
            "outbox": _outbox(session, item_id),
        }
    return _normalised(rows, item_id, started)


def _outbox(session: Any, item_id: str) -> list[dict[str, Any]]:
    query = select(OutcomeOutbox).where(OutcomeOutbox.work_item_id == item_id)
    return [_columns(row) for row in session.scalars(query.order_by(OutcomeOutbox.id))]


def _columns(row: Any) -> dict[str, Any]:
    """A row's columns by name, without its autoincremented id."""
    values = {
        attribute.columns[0].name: getattr(row, attribute.key)
        for attribute in row.__mapper__.column_attrs
    }
    if isinstance(values.get("id"), int):
        values.pop("id")
    return values


def _hash_of(stored: str, token: str | None) -> str:
    return "hash of the token handed out" if token and stored == hash_token(token) else stored


def _normalised(rows: Snapshot, item_id: str, started: datetime) -> Snapshot:
    """``rows`` with the item's id as ``<item>`` and each time as ``before``, or as its
    offset from the change's instant (its earliest time from ``started`` on)."""
    times: list[datetime] = []
    _walk(rows, lambda value: times.append(value) if isinstance(value, datetime) else None)
    during = [moment for moment in times if moment >= started]
    instant = min(during, default=started)
    mark = item_id.removeprefix("wi-")

    def normal(value: Any) -> Any:
        if isinstance(value, datetime):
            if value < started:
                return "before"
            return f"now+{(value - instant).total_seconds():g}s"
        if isinstance(value, str):
            return value.replace(mark, "<item>")
        return value

    normalised: Snapshot = _walk(rows, normal)
    return normalised


def differences(left: dict[str, Snapshot], expected: Snapshot) -> list[str]:
    """Where each implementation's rows differ from ``expected``, one line a value."""
    found = []
    for name, snapshot in left.items():
        flat, wanted = _flat(snapshot), _flat(expected)
        for path in sorted(flat.keys() | wanted.keys()):
            if flat.get(path, "(none)") != wanted.get(path, "(none)"):
                got, want = flat.get(path, "(none)"), wanted.get(path, "(none)")
                found.append(f"{name}: {path} is {got!r}, not {want!r}")
    return found


def _flat(value: Any, path: str = "") -> dict[str, Any]:
    if isinstance(value, dict) and value:
        return {
            k: v for key, inner in value.items() for k, v in _flat(inner, f"{path}.{key}").items()
        }
    if isinstance(value, list) and value:
        return {
            k: v for n, inner in enumerate(value) for k, v in _flat(inner, f"{path}[{n}]").items()
        }
    return {path.lstrip("."): value}


def _walk(value: Any, visit: Callable[[Any], Any]) -> Any:
    if isinstance(value, dict):
        return {key: _walk(inner, visit) for key, inner in value.items()}
    if isinstance(value, list):
        return [_walk(inner, visit) for inner in value]
    return visit(value)


# What the claim of a routed item leaves: the item provisioning, a sandbox row of its
# attempt under the delivery's lease, the hash of the token handed out, the sandbox's
# creation and the item's move in that order, all at one instant; no slot taken or freed.
CLAIMED_SANDBOX = {
    "id": "sb-<item>-1",
    "work_item_id": "wi-<item>",
    "attempt": 1,
    "org_id": "acme",
    "pool_id": "pool-mem",
    "provider_id": "in-memory",
    "external_id": None,
    "metadata": {},
    "status": "provisioning",
    "lease_until": f"now+{LEASE_S}s",
    "lease_holder": DELIVERY.holder,
    "created_at": "now+0s",
    "started_at": None,
    "deadline_at": None,
    "last_heartbeat_at": None,
    "terminated_at": None,
    "termination_reason": None,
    "end_log": None,
    "end_requested_at": None,
    "cost_due_at": None,
    "cpu_seconds": None,
}


def _event(entity: str, from_state: str | None, to_state: str, detail: str | None = None) -> Any:
    return {
        "entity": entity,
        "entity_id": "sb-<item>-1" if entity == "sandbox" else "wi-<item>",
        "work_item_id": "wi-<item>",
        "from_state": from_state,
        "to_state": to_state,
        "actor": ACTOR,
        "detail": detail,
        "created_at": "now+0s",
    }


CLAIMED_ITEM = {"state": "provisioning", "updated_at": "now+0s", "attempts": 1}
CLAIMED = {
    "sandboxes": [CLAIMED_SANDBOX],
    "tokens": [
        {
            "token_hash": "hash of the token handed out",
            "sandbox_id": "sb-<item>-1",
            "work_item_id": "wi-<item>",
            "expires_at": f"now+{TOKEN_TTL_S}s",
            "redeemed_at": None,
            "created_at": "now+0s",
        }
    ],
    "events": [
        _event("sandbox", None, "provisioning"),
        _event("work_item", "routed", "provisioning"),
    ],
    "slots taken": 0,
    "outbox": [],
}
# What recording the handle of that claim leaves: the sandbox ready with its handle, started
# and given its deadline, its lease cleared; the item awaiting its runner; their events.
HANDLED_ITEM = {"state": "awaiting_claim", "updated_at": "now+0s", "provisioned_at": "now+0s"}
HANDLED = {
    "sandboxes": [
        CLAIMED_SANDBOX
        | {
            "external_id": "ext-<item>",
            "metadata": {"org_id": "acme", "region": "here"},
            "status": "ready",
            "lease_until": None,
            "created_at": "before",
            "started_at": "now+0s",
            "deadline_at": f"now+{SESSION_LIMIT_S}s",
        }
    ],
    "events": [
        _event("sandbox", "provisioning", "ready", "handle ext-<item>"),
        _event("work_item", "provisioning", "awaiting_claim"),
    ],
    "slots taken": 0,
    "outbox": [],
}


def _claim_one_by_one(rt: Runtime, item_id: str) -> str:
    claimed = provision._claim(rt, item_id, ACTOR, DELIVERY)
    assert isinstance(claimed, provision.Claimed)
    return claimed.spec.registration_token.get_secret_value()


def _claim_batched(rt: Runtime, item_id: str) -> str:
    # Beside another item the batch does not claim (not routed): only this one's rows change.
    requests = [ClaimRequest(item_id, ACTOR, DELIVERY.holder), ClaimRequest("wi-none", ACTOR)]
    fresh, none = claim_routed(rt.db, requests, lease_s=LEASE_S, token_ttl_s=TOKEN_TTL_S)
    assert fresh is not None and none is None
    return fresh.token


CLAIMS: dict[str, Callable[[Runtime, str], str]] = {
    "one by one": _claim_one_by_one,
    "batched": _claim_batched,  # steps on SQLite, one statement on PostgreSQL
}


def test_every_claim_of_a_routed_item_leaves_the_same_rows(rt: Runtime) -> None:
    left = {}
    for name, claim in CLAIMS.items():
        item_id = routed(rt.db)
        snapshot = changed_by(rt.db, item_id, lambda: claim(rt, item_id))  # noqa: B023
        item = snapshot.pop("item")
        assert item["state"] == "provisioning" and item["routed_at"] == "before"
        left[name] = snapshot | {"item": {key: item[key] for key in CLAIMED_ITEM}}
    found = differences(left, CLAIMED | {"item": CLAIMED_ITEM})
    assert not found, "\n".join(found)


def _claimed(rt: Runtime) -> tuple[str, provision.Claimed]:
    """A routed item claimed (batched), and what the provider worker then knows of it."""
    item_id = routed(rt.db)
    [fresh] = claim_routed(
        rt.db,
        [ClaimRequest(item_id, ACTOR, DELIVERY.holder)],
        lease_s=LEASE_S,
        token_ttl_s=TOKEN_TTL_S,
    )
    assert isinstance(fresh, Fresh)
    claimed = provision._claimed(rt, fresh, provider_id="in-memory", actor=ACTOR)
    assert isinstance(claimed, provision.Claimed)
    return item_id, dataclasses.replace(claimed, session_limit_s=SESSION_LIMIT_S)


def _handle(item_id: str) -> SandboxHandle:
    mark = item_id.removeprefix("wi-")
    return SandboxHandle(
        provider_id="in-memory",
        external_id=f"ext-{mark}",
        metadata={"org_id": "acme", "region": "here"},
    )


def _handle_one_by_one(rt: Runtime, item_id: str, claimed: provision.Claimed) -> None:
    assert provision._record_handle(rt.db, claimed, _handle(item_id), ACTOR)


def _handle_batched(rt: Runtime, item_id: str, claimed: provision.Claimed) -> None:
    write = HandleWrite(
        item_id,
        claimed.sandbox_id,
        claimed.lease_until,
        _handle(item_id),
        claimed.session_limit_s,
        ACTOR,
    )
    assert record_handles_batched(rt.db, [write]) == [True]


HANDLES: dict[str, Callable[[Runtime, str, provision.Claimed], None]] = {
    "one by one": _handle_one_by_one,
    "batched": _handle_batched,
}


def test_every_handle_write_leaves_the_same_rows(rt: Runtime) -> None:
    left = {}
    for name, write in HANDLES.items():
        item_id, claimed = _claimed(rt)

        def change(item_id: str = item_id, claimed: provision.Claimed = claimed) -> None:
            write(rt, item_id, claimed)  # noqa: B023

        snapshot = changed_by(rt.db, item_id, change)
        item = snapshot.pop("item")
        snapshot.pop("tokens")  # the claim's, untouched
        left[name] = snapshot | {"item": {key: item[key] for key in HANDLED_ITEM}}
    found = differences(left, HANDLED | {"item": HANDLED_ITEM})
    assert not found, "\n".join(found)


# An item the intake ends: its dispatch error, and the outcome it owes its message's sender.

REPLY = {
    "task_id": "<task>",
    "link": [],
    "link_error": [
        {"task": "tenant.failed", "args": [1], "kwargs": {}, "queue": "celery", "immutable": False}
    ],
}
ENDED_AT_INTAKE = {
    "item": {
        "state": "dispatch_error",
        "error_code": "no_eligible_pool",
        "task_id": "<task>",
        "replies": [REPLY],
        "finished_at": "at its end",
    },
    "outbox": [
        {
            "work_item_id": "wi-<item>",
            "org_id": "poolless",
            "sink": "celery",
            "target": REPLY,
            "created_at": "at its end",
            "due_at": "at its end",
            "attempts": 0,
            "last_error": None,
            "failed_at": None,
        }
    ],
}


def _ended_batched(db: Database, request: DispatchRequest, origin: Origin) -> str:
    [taken] = accept_batch(db, [request], actor=ACTOR, settings=SETTINGS, origins=[origin])
    return taken.item_id


def _ended_one_by_one(db: Database, request: DispatchRequest, origin: Origin) -> str:
    accepted, _ = take_one(db, request, actor=ACTOR, settings=SETTINGS, origin=origin)
    return accepted.item_id


INTAKE_ENDS: dict[str, Callable[[Database, DispatchRequest, Origin], str]] = {
    "batched": _ended_batched,
    "one by one": _ended_one_by_one,
}


def _ended_at_intake(db: Database, end: Callable[[Database, DispatchRequest, Origin], str]) -> Any:
    """What ``end`` leaves for an item of an org with no pool, made by a Celery message."""
    task_id = f"task-{utcnow().timestamp()}"
    reply = Reply(task_id, link_error=(Callback("tenant.failed", (1,)),))
    request = DispatchRequest.model_validate(
        {
            "org": "poolless",
            "project": "web",
            "profile": "default",
            "work": {"kind": "shell", "command": "true"},
        }
    )
    item_id = end(db, request, Origin(task_id, reply))
    with db.session() as session:
        item = session.get_one(WorkItem, item_id)
        rows = {
            "item": {key: getattr(item, key) for key in ENDED_AT_INTAKE["item"]},
            "outbox": _outbox(session, item_id),
        }
        ended = item.finished_at

    def normal(value: Any) -> Any:
        if isinstance(value, datetime):
            return "at its end" if value == ended else value.isoformat()
        if isinstance(value, str):
            return value.replace(task_id, "<task>").replace(item_id, "wi-<item>")
        return value

    return _walk(rows, normal)


def test_every_intake_path_that_ends_an_item_owes_the_same_outcome(rt: Runtime) -> None:
    left = {name: _ended_at_intake(rt.db, end) for name, end in INTAKE_ENDS.items()}
    found = differences(left, ENDED_AT_INTAKE)
    assert not found, "\n".join(found)
