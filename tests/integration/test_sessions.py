"""Interactive sessions against PostgreSQL: who may see one, what routing refuses, and the
reaper's session rule (the whole flow through real processes: tests/acceptance)."""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from fastapi import HTTPException, Request
from sqlalchemy import event, update

from corral.providers.base import ExecResult, SandboxHandle, SandboxState
from corral.providers.local.provider import LocalProvider
from corral.scheduler.admin.pools import PoolCreate, ProfileCreate, create_pool, create_profile
from corral.scheduler.api import interactive_api
from corral.scheduler.api.auth import EVERY_SCOPE, Principal, Scope
from corral.scheduler.api.http_errors import InvalidRequest
from corral.scheduler.api.interactive import (
    SessionCreate,
    SessionEndedError,
    SessionRefusedError,
    create_session,
    hold,
    load_session,
    release,
)
from corral.shared import runtime
from corral.shared.broker import celery_app
from corral.shared.settings import CoreSettings
from corral.shared.store.db import Database, make_engine, utcnow
from corral.shared.store.interactive_ends import lapsed_sessions
from corral.shared.store.lifecycle import transition
from corral.shared.store.models import (
    AuthMode,
    InteractiveSession,
    ItemState,
    LifecycleEvent,
    Sandbox,
    TerminationReason,
    WorkItem,
)
from tests import floods
from tests.conftest import SpecFactory
from tests.integration.api_clients import ClientFactory
from tests.integration.test_api import ADMIN

ORG = "acme"


@dataclass
class World:
    db: Database
    settings: CoreSettings

    def create(self, org: str = ORG, **fields: Any) -> str:
        body = SessionCreate(org=org, project="p", profile="default", **fields)
        session_id, _ = create_session(self.db, body, self.settings, actor="test")
        return session_id

    def item_of(self, session_id: str) -> WorkItem:
        with self.db.session() as session:
            row = session.get(InteractiveSession, session_id)
            assert row is not None and row.work_item_id is not None
            item = session.get(WorkItem, row.work_item_id)
            assert item is not None
            return item


@pytest.fixture
def world(fresh_pg_url: str) -> Iterator[World]:
    # A database of the test's own: the reaper's session rule reads every live session.
    settings = CoreSettings(database_url=fresh_pg_url, broker_url="memory://")
    celery_app.configure(settings)
    db = Database(make_engine(fresh_pg_url))
    runtime.install(runtime.Runtime(settings=settings, db=db))
    create_profile(db, ProfileCreate(name="default", model="m", auth_mode=AuthMode.BYOK))
    create_pool(db, PoolCreate(org_id=ORG, name="local", provider_id="local"))
    try:
        yield World(db, settings)
    finally:
        runtime.reset()
        db.dispose()


def _request(body: dict[str, Any]) -> Request:
    sent = json.dumps(body).encode()

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": sent, "more_body": False}

    return Request(
        {"type": "http", "method": "POST", "path": "/v1/sessions", "headers": []}, receive
    )


def test_a_principal_of_another_org_finds_no_session(world: World) -> None:
    session_id = world.create()
    rt = runtime.current()  # what the routes get from the api's runtime dependency
    own = Principal(scopes=EVERY_SCOPE, org_id=ORG)
    other = Principal(scopes=EVERY_SCOPE, org_id="globex")
    assert interactive_api.read(session_id, own, rt).id == session_id
    exec_body = interactive_api.ExecBody(command=["echo", "hi"])
    for call in (
        lambda: interactive_api.read(session_id, other, rt),
        lambda: interactive_api.close(session_id, other, rt),
        lambda: interactive_api.execute(session_id, exec_body, other, rt),
        lambda: interactive_api.download(session_id, "a.txt", other, rt),
    ):
        with pytest.raises(HTTPException) as refused:
            call()
        assert (refused.value.status_code, refused.value.detail) == (404, "session not found")
    body = {"org": ORG, "project": "p", "profile": "default"}
    with pytest.raises(HTTPException) as refused:
        asyncio.run(interactive_api.create(_request(body), other, rt))
    assert refused.value.status_code == 404
    # Nothing the other org did touched it.
    assert load_session(world.db, session_id).answer.state == "provisioning"
    assert interactive_api.read(session_id, Principal(scopes=frozenset({Scope.READ})), rt).id


def test_commands_wait_for_a_ready_session(world: World) -> None:
    session_id = world.create()
    rt = runtime.current()
    caller = Principal(scopes=EVERY_SCOPE)
    with pytest.raises(HTTPException) as refused:
        interactive_api.execute(session_id, interactive_api.ExecBody(command=["true"]), caller, rt)
    assert refused.value.status_code == 409
    assert "still provisioning" in str(refused.value.detail)
    closed = interactive_api.close(session_id, caller, rt)
    assert (closed.state, closed.end_reason) == ("ended", "session_closed")
    assert world.item_of(session_id).state == ItemState.CANCELLED
    with pytest.raises(HTTPException) as ended:
        interactive_api.execute(session_id, interactive_api.ExecBody(command=["true"]), caller, rt)
    assert ended.value.status_code == 409 and "has ended (session_closed)" in ended.value.detail
    with pytest.raises(SessionEndedError):  # a call that read it just before it ended
        hold(world.db, session_id, busy_s=1)


def test_a_call_holds_the_idle_clock_until_it_ends(world: World) -> None:
    session_id = world.create(idle_ttl_s=30)

    def idle_until() -> datetime:
        return load_session(world.db, session_id).answer.idle_until

    long_call = hold(world.db, session_id, busy_s=600)
    assert idle_until() >= utcnow() + timedelta(seconds=629)
    short_call = hold(world.db, session_id, busy_s=1)
    assert short_call == long_call  # the longer hold stands
    release(world.db, session_id, short_call)
    assert idle_until() <= utcnow() + timedelta(seconds=30)  # idle from the end of the call
    later = hold(world.db, session_id, busy_s=100)
    release(world.db, session_id, long_call)  # a later call moved the clock: it stands
    assert idle_until() == later


def test_a_session_goes_only_where_commands_and_files_work(world: World) -> None:
    create_pool(world.db, PoolCreate(org_id="kube", name="k8s", provider_id="kubernetes"))
    with pytest.raises(SessionRefusedError) as refused:
        world.create(org="kube")
    assert "commands and files from outside (interactive sessions)" in refused.value.message
    with world.db.session() as session:
        row = session.query(InteractiveSession).filter_by(org_id="kube").one()
        assert row.end_reason == "session_refused" and row.ended_at is not None


def test_ttls_over_their_maxima_are_refused_naming_the_field(world: World) -> None:
    for field, value in (("idle_ttl_s", 10**6), ("ttl_s", 10**6)):
        with pytest.raises(InvalidRequest) as refused:
            world.create(**{field: value})
        assert refused.value.problems[0]["field"] == field


def _age(world: World, session_id: str, **columns: Any) -> None:
    with world.db.session() as session:
        session.execute(
            update(InteractiveSession).where(InteractiveSession.id == session_id).values(**columns)
        )


def _claim(world: World, session_id: str, claimed_ago_s: float) -> None:
    """The runner claimed the session's work ``claimed_ago_s`` ago (its sandbox is up)."""
    with world.db.session() as session:
        item = session.get(WorkItem, world.item_of(session_id).id)
        assert item is not None
        for state in (ItemState.PROVISIONING, ItemState.AWAITING_CLAIM, ItemState.RUNNING):
            transition(session, item, state, actor="test")
        item.claimed_at = utcnow() - timedelta(seconds=claimed_ago_s)


def test_the_reaper_ends_expired_and_idle_sessions_only(world: World) -> None:
    past = utcnow() - timedelta(seconds=5)
    expired, idle, provisioning, young, busy = (world.create(idle_ttl_s=30) for _ in range(5))
    _age(world, expired, expires_at=past)
    for session_id in (idle, provisioning, young):
        _age(world, session_id, idle_until=past)
    _claim(world, idle, claimed_ago_s=60)
    _claim(world, young, claimed_ago_s=10)  # ready 10 s ago: not idle for 30 s yet
    _claim(world, busy, claimed_ago_s=60)  # its clock runs (a call moved it on)

    lapsed = lapsed_sessions(world.db, utcnow(), limit=100, actor="reaper")

    reasons = {one.session_id: one.reason for one in lapsed}
    assert reasons == {
        expired: TerminationReason.SESSION_EXPIRED,
        idle: TerminationReason.SESSION_IDLE,
    }
    for session_id, reason in reasons.items():
        view = load_session(world.db, session_id).answer
        assert (view.state, view.end_reason) == ("ended", reason.value)
        assert world.item_of(session_id).state == ItemState.CANCELLED
    for session_id in (provisioning, young, busy):
        view = load_session(world.db, session_id).answer
        assert view.state != "ended" and view.idle_until > utcnow()
    with world.db.session() as session:
        ends = session.query(LifecycleEvent).filter_by(entity="session", to_state="ended").all()
        assert sorted(e.entity_id for e in ends) == sorted(reasons)
    # A second sweep finds nothing more to do.
    assert lapsed_sessions(world.db, utcnow(), limit=100, actor="reaper") == []


def test_a_session_read_while_the_reaper_ends_it_shows_one_moment(world: World) -> None:
    """The reaper ends an idle session and cancels its item in one transaction, committed
    here between the view's first read and whatever it reads after: the view is live, or
    ended ``session_idle``, never ended for its item's sake (``work_item_cancelled``)."""
    session_id = world.create(idle_ttl_s=30)
    _claim(world, session_id, claimed_ago_s=60)
    _age(world, session_id, idle_until=utcnow() - timedelta(seconds=5))
    lapsed: list[Any] = []
    reaped = False

    def reap_once(_conn: Any, _cursor: Any, statement: str, *_rest: Any) -> None:
        nonlocal reaped
        if not reaped and "interactive_sessions" in statement:
            reaped = True
            lapsed.extend(lapsed_sessions(world.db, utcnow(), limit=10, actor="reaper"))

    event.listen(world.db.engine, "after_cursor_execute", reap_once)
    try:
        view = load_session(world.db, session_id).answer
    finally:
        event.remove(world.db.engine, "after_cursor_execute", reap_once)

    assert [one.session_id for one in lapsed] == [session_id]  # it ended mid-read
    assert (view.state, view.end_reason) in {("ready", None), ("provisioning", None)}
    after = load_session(world.db, session_id).answer
    assert (after.state, after.end_reason) == ("ended", "session_idle")


def test_a_session_whose_creation_stopped_midway_still_ends_its_item(world: World) -> None:
    session_id = world.create()
    item_id = world.item_of(session_id).id
    # The api died after routing the item, before it noted the item on the session.
    _age(world, session_id, work_item_id=None, expires_at=utcnow() - timedelta(seconds=1))

    (lapsed,) = lapsed_sessions(world.db, utcnow(), limit=100, actor="reaper")

    assert lapsed.reason is TerminationReason.SESSION_EXPIRED
    assert world.item_of(session_id).id == item_id  # found by its key, and noted
    assert world.item_of(session_id).state == ItemState.CANCELLED


def test_an_upload_over_the_file_limit_is_refused_unread(make_client: ClientFactory) -> None:
    client = make_client(interactive_file_max_bytes=16)
    headers = {"Authorization": f"Bearer {ADMIN}"}
    answer = client.put("/v1/sessions/se-x/files/a.bin", content=b"x" * 17, headers=headers)
    assert answer.status_code == 413, answer.text
    assert answer.json()["limit_bytes"] == 16
    # Within the limit, the call reaches the route (no such session).
    answer = client.put("/v1/sessions/se-x/files/a.bin", content=b"x" * 16, headers=headers)
    assert answer.status_code == 404


def test_a_session_is_never_requeued_whatever_its_pools_lease(world: World) -> None:
    create_pool(
        world.db,
        PoolCreate.model_validate(
            {
                "org_id": "leased",
                "name": "local",
                "provider_id": "local",
                "lease": {"on_heartbeat_lost": "requeue", "retry_on_work_failed": True},
            }
        ),
    )
    item = world.item_of(world.create(org="leased"))
    assert item.state == ItemState.ROUTED.value
    assert item.lease is not None
    assert item.lease["on_heartbeat_lost"] == "fail"
    assert item.lease["retry_on_work_failed"] is False


def _claimed_in(world: World, session_id: str, handle: SandboxHandle) -> None:
    """The session's work item claimed by a runner in ``handle``'s sandbox: the session is
    ready, and its calls go to that sandbox."""
    with world.db.session() as session:
        row = session.get(InteractiveSession, session_id)
        assert row is not None and row.work_item_id is not None
        item = session.get(WorkItem, row.work_item_id)
        assert item is not None and item.pool_id is not None
        session.add(
            Sandbox(
                id=f"sb-{uuid.uuid4().hex}",
                work_item_id=item.id,
                attempt=item.attempts,
                org_id=item.org_id,
                pool_id=item.pool_id,
                provider_id=handle.provider_id,
                external_id=handle.external_id,
                handle_metadata=dict(handle.metadata),
                status=SandboxState.RUNNING.value,
            )
        )
        session.flush()
        for state in (ItemState.PROVISIONING, ItemState.AWAITING_CLAIM, ItemState.RUNNING):
            transition(session, item, state, actor="test")


FLOOD = 50 * 1024 * 1024  # what a command prints, or a file holds, far past the limits
LIMIT = floods.LIMIT


def test_a_flood_of_output_and_a_file_over_the_limit_never_reach_the_api_whole(
    world: World, sandbox_root: Path, make_spec: SpecFactory
) -> None:
    limits = {"interactive_output_max_bytes": LIMIT, "interactive_file_max_bytes": LIMIT}
    runtime.install(runtime.Runtime(settings=world.settings.model_copy(update=limits), db=world.db))
    provider = LocalProvider({"root_dir": sandbox_root, "isolation": "required"})
    rt = runtime.current()
    rt.use_provider(provider)
    handle = provider.provision(make_spec(provider_options={"command": ["sleep", "300"]}))
    session_id = world.create()
    _claimed_in(world, session_id, handle)
    caller = Principal(scopes=EVERY_SCOPE)
    flood = f"head -c {FLOOD} /dev/zero | tr '\\0' x; head -c {FLOOD} /dev/zero > big.bin"
    try:
        body = interactive_api.ExecBody(shell=True, command=flood)
        answer, peak = floods.peak_while(
            lambda: interactive_api.execute(session_id, body, caller, rt)
        )
        written_before = floods.bytes_written()
        with pytest.raises(InvalidRequest) as refused:
            interactive_api.download(session_id, "big.bin", caller, rt)
        written = floods.bytes_written() - written_before
    finally:
        provider.terminate(handle)
    assert (answer.stdout, answer.exit_code, answer.truncated) == ("x" * LIMIT, 0, True)
    assert peak < 4 * 1024 * 1024, peak  # the api held a few chunks of 50 MB, not all of it
    assert refused.value.status_code == 422
    assert refused.value.problems == [
        {
            "field": "path",
            "message": f"the file is larger than the download limit of {LIMIT} bytes "
            "(CORRAL_INTERACTIVE_FILE_MAX_BYTES)",
        }
    ]
    # Refused by its size: none of its 50 MB went to the api's disk (what was written is the
    # database's traffic for the call).
    assert written < LIMIT, written


class _BeforeBounds(LocalProvider):
    """A provider plugin written before the contract bounded output and downloads."""

    ran: list[object]

    def exec_command(  # type: ignore[override]
        self,
        handle: SandboxHandle,
        command: str | list[str],
        *,
        env: Mapping[str, str] | None = None,
        cwd: str | None = None,
        timeout_s: float | None = None,
    ) -> ExecResult:
        self.ran.append(command)
        raise AssertionError("a provider that cannot bound its output is never called")

    def download_file(  # type: ignore[override]
        self, handle: SandboxHandle, source: str, target: Path
    ) -> None:
        self.ran.append(source)
        raise AssertionError("a provider that cannot bound a download is never called")


def test_a_provider_that_cannot_bound_what_it_holds_is_refused_not_called(
    world: World, sandbox_root: Path, make_spec: SpecFactory
) -> None:
    provider = _BeforeBounds({"root_dir": sandbox_root, "isolation": "required"})
    provider.ran = []
    rt = runtime.current()
    rt.use_provider(provider)
    handle = provider.provision(make_spec(provider_options={"command": ["sleep", "300"]}))
    session_id = world.create()
    _claimed_in(world, session_id, handle)
    caller = Principal(scopes=EVERY_SCOPE)
    try:
        with pytest.raises(HTTPException) as refused_exec:
            interactive_api.execute(
                session_id, interactive_api.ExecBody(command=["true"]), caller, rt
            )
        with pytest.raises(HTTPException) as refused_download:
            interactive_api.download(session_id, "file.txt", caller, rt)
    finally:
        provider.terminate(handle)
    assert (refused_exec.value.status_code, refused_download.value.status_code) == (409, 409)
    assert "takes no max_output_bytes" in str(refused_exec.value.detail)
    assert "takes no max_bytes" in str(refused_download.value.detail)
    assert provider.ran == []
