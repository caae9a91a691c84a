"""Interactive sessions (docs/sessions.md): a live sandbox a caller runs commands in and moves
files to and from, ended by its caller, by the reaper when idle or past its total life.

A session is a work item whose work idles (``exec sleep``), routed exactly like any other
(capability match, slots, budgets, breaker) with the ``exec-files`` sandbox feature, so only
pools whose provider runs commands and moves files from outside take it; a provider worker
provisions its sandbox and the runner inside claims the work and heartbeats, as for any
item. Its row in ``interactive_sessions`` holds what is the session's own: its clock
(``idle_until``, ``expires_at``) and how it ended. It is *ready* once the runner runs the
idle work; ending it cancels the work item, whose sandbox is ended and billed through the
ordinary path (:mod:`corral.worker.termination`, one cost event per sandbox).
"""

from __future__ import annotations

import re
import uuid
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError
from sqlalchemy import select, update

from corral.providers.base import SandboxHandle, ToolchainDemand
from corral.scheduler.admin.responses import Answer, Timestamp
from corral.scheduler.api.http_errors import InvalidFields, InvalidRequest
from corral.scheduler.errors import DispatchError
from corral.scheduler.intake import RouteOutcome, take_one
from corral.shared.env_names import EnvMap
from corral.shared.messages import (
    AgentCard,
    DispatchRequest,
    EgressRequest,
    field_errors,
    stored_request,
)
from corral.shared.settings import CoreSettings, SessionSettings
from corral.shared.store import profiles
from corral.shared.store.db import Database, utcnow
from corral.shared.store.interactive_ends import (
    close_session,
    current_sandbox,
    session_item_key,
)
from corral.shared.store.lifecycle import record_session_start
from corral.shared.store.models import (
    InteractiveSession,
    ItemState,
    Sandbox,
    WorkItem,
)
from corral.shared.store.profiles import DEFAULT_PROFILE
from corral.shared.text import IDENTIFIER, INT32_MAX, Printable

# The idle work and the sandbox's deadline outlive ttl_s by this much: the reaper's session
# rule ends the session first, for its own reason; the deadline is only the backstop.
GRACE_S = 120
MAX_PATH = 1024
_SEGMENT = re.compile(r"^[^\x00-\x1f\x7f/]+$")

SessionStateName = Literal["provisioning", "ready", "ended"]


class SessionResources(BaseModel):
    """What the session's sandbox may use (its life is ``ttl_s``, not a timeout)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    cpu: float | None = Field(default=None, gt=0, le=1_000_000, description="vCPUs")
    memory_mb: int | None = Field(default=None, gt=0, le=INT32_MAX)
    gpu: int = Field(default=0, ge=0, le=INT32_MAX)


class SessionCreate(BaseModel):
    """``POST /v1/sessions``: where the sandbox runs (routed like a dispatch) and its TTLs."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    org: str = Field(pattern=IDENTIFIER)
    project: str = Field(pattern=IDENTIFIER)
    profile: str = Field(
        default=DEFAULT_PROFILE,
        pattern=IDENTIFIER,
        description="name of a model profile; its model is CORRAL_MODEL in the session's "
        "commands. Default: `default`",
    )
    provider: str | None = Field(default=None, pattern=IDENTIFIER)
    agent_card: AgentCard = Field(default_factory=AgentCard)
    toolchain: ToolchainDemand = Field(default_factory=ToolchainDemand)
    resources: SessionResources = Field(default_factory=SessionResources)
    env: EnvMap = Field(default_factory=dict, repr=False)
    egress: EgressRequest = Field(default_factory=EgressRequest)
    image: Printable | None = Field(default=None, min_length=1, max_length=512)
    region: Printable | None = Field(default=None, max_length=255)
    arch: Printable | None = Field(default=None, max_length=255)
    idle_ttl_s: int | None = Field(
        default=None,
        gt=0,
        le=INT32_MAX,
        description="seconds without an exec or file call after which the session ends "
        "(default CORRAL_INTERACTIVE_IDLE_TTL_S)",
    )
    ttl_s: int | None = Field(
        default=None,
        gt=0,
        le=INT32_MAX,
        description="the session's whole life from creation (default CORRAL_INTERACTIVE_TTL_S)",
    )


@dataclass(frozen=True)
class Lifetimes:
    idle_ttl_s: int
    ttl_s: int

    @classmethod
    def of(cls, body: SessionCreate, settings: SessionSettings) -> Lifetimes:
        """The TTLs asked for, else the defaults; over a maximum is a 422 naming the field.

        Raises:
            InvalidRequest: a TTL over its maximum.
        """
        idle = body.idle_ttl_s or settings.interactive_idle_ttl_s
        total = body.ttl_s or settings.interactive_ttl_s
        if idle > settings.interactive_idle_ttl_max_s:
            raise InvalidRequest(
                "idle_ttl_s",
                f"at most {settings.interactive_idle_ttl_max_s} s "
                "(CORRAL_INTERACTIVE_IDLE_TTL_MAX_S)",
            )
        if total > settings.interactive_ttl_max_s:
            raise InvalidRequest(
                "ttl_s",
                f"at most {settings.interactive_ttl_max_s} s (CORRAL_INTERACTIVE_TTL_MAX_S)",
            )
        return cls(idle, total)


class SessionRefusedError(DispatchError):
    """No pool can hold the session (the message says what each lacked)."""

    code = "session_refused"


def new_session_id() -> str:
    return f"se-{uuid.uuid4().hex}"


def dispatch_request(body: SessionCreate, session_id: str, ttl_s: int) -> DispatchRequest:
    """The work item of a session: idle work, routed only where commands and files work.

    Raises:
        InvalidFields: what the dispatch message refuses (an unknown provider or kit...).
    """
    life = ttl_s + GRACE_S
    fields: dict[str, Any] = body.model_dump(exclude={"idle_ttl_s", "ttl_s", "resources"})
    message = {
        **fields,
        "work": {"kind": "shell", "command": f"exec sleep {life}"},
        "resources": {**body.resources.model_dump(), "timeout_s": life},
        "sandbox_features": ["exec-files"],
        "idempotency_key": session_item_key(session_id),
        # A session's sandbox holds what the caller put in it: once its runner has claimed,
        # losing it ends the session, whatever lease the pool gives its items (a new
        # sandbox in its place would be a different, empty one behind the same id).
        "lease": {"on_heartbeat_lost": "fail", "retry_on_work_failed": False},
    }
    try:
        return DispatchRequest.model_validate(message)
    except ValidationError as exc:
        raise InvalidFields(field_errors(exc)) from exc


def create_session(
    db: Database, body: SessionCreate, settings: CoreSettings, *, actor: str
) -> tuple[str, RouteOutcome]:
    """Write the session and its work item, and route the item; what to publish for it.

    Raises:
        InvalidRequest, InvalidFields: a field the session or the dispatch message refuses.
        SessionRefusedError: routing failed at once (no pool qualifies, over budget...);
            the session is ended.
    """
    life = Lifetimes.of(body, settings)
    session_id = new_session_id()
    request = dispatch_request(body, session_id, life.ttl_s)
    now = utcnow()
    with db.session() as session:
        row = InteractiveSession(
            id=session_id,
            org_id=body.org,
            project_id=body.project,
            idle_ttl_s=life.idle_ttl_s,
            ttl_s=life.ttl_s,
            created_at=now,
            expires_at=now + timedelta(seconds=life.ttl_s),
            idle_until=now + timedelta(seconds=life.idle_ttl_s),
        )
        session.add(row)
        session.flush()
        record_session_start(session, row, actor=actor)
    # The row comes first: should this process die now, the reaper still ends the session.
    accepted, outcome = take_one(db, request, actor=actor, settings=settings)
    with db.session() as session:
        session.execute(
            update(InteractiveSession)
            .where(InteractiveSession.id == session_id)
            .values(work_item_id=accepted.item_id)
        )
    if outcome.state is ItemState.DISPATCH_ERROR:
        close_session(db, session_id, "session_refused", actor=actor, detail=outcome.detail or "")
        raise SessionRefusedError(outcome.detail or "no pool can hold the session")
    return session_id, outcome


class SessionAnswer(Answer):
    """A session as its caller sees it (``GET /v1/sessions/{id}``)."""

    id: str
    org_id: str
    project_id: str
    state: SessionStateName
    work_item_id: str | None
    idle_ttl_s: int
    ttl_s: int
    created_at: Timestamp
    expires_at: Timestamp
    idle_until: Timestamp
    ended_at: Timestamp | None
    end_reason: str | None
    error: str | None


@dataclass(frozen=True)
class SessionView:
    """A session, and where its sandbox is while it is ready."""

    answer: SessionAnswer
    handle: SandboxHandle | None

    @property
    def id(self) -> str:
        return self.answer.id


def load_session(db: Database, session_id: str) -> SessionView:
    """The session, its state read from its work item and sandbox.

    Raises:
        LookupError: no such session.
    """
    with db.session() as session:
        # One statement, so one snapshot: the reaper ends a session and cancels its item in
        # one transaction, and two reads could see the item cancelled but the session live.
        found = session.execute(
            select(InteractiveSession, WorkItem)
            .outerjoin(WorkItem, WorkItem.id == InteractiveSession.work_item_id)
            .where(InteractiveSession.id == session_id)
        ).one_or_none()
        if found is None:
            raise LookupError(f"session {session_id} does not exist")
        row, item = found
        sandbox = current_sandbox(session, item) if item is not None else None
        return _view(row, item, sandbox)


def _view(row: InteractiveSession, item: WorkItem | None, sandbox: Sandbox | None) -> SessionView:
    state: SessionStateName = "provisioning"
    handle = None
    ended_item = item is not None and ItemState(item.state).is_final
    if row.ended_at is not None or ended_item:
        state = "ended"
    elif (
        item is not None
        and item.state == ItemState.RUNNING
        and sandbox is not None
        and sandbox.external_id is not None
        and sandbox.terminated_at is None
    ):
        state = "ready"
        handle = SandboxHandle(
            provider_id=sandbox.provider_id,
            external_id=sandbox.external_id,
            metadata=dict(sandbox.handle_metadata) or {"org_id": sandbox.org_id},
        )
    error = None
    if item is not None and item.error_message and state == "ended":
        error = f"{item.error_code}: {item.error_message}"
    end_reason = row.end_reason or (f"work_item_{item.state}" if ended_item and item else None)
    answer = SessionAnswer(
        id=row.id,
        org_id=row.org_id,
        project_id=row.project_id,
        state=state,
        work_item_id=row.work_item_id,
        idle_ttl_s=row.idle_ttl_s,
        ttl_s=row.ttl_s,
        created_at=row.created_at,
        expires_at=row.expires_at,
        idle_until=row.idle_until,
        ended_at=row.ended_at,
        end_reason=end_reason,
        error=error,
    )
    return SessionView(answer, handle)


def session_env(db: Database, work_item_id: str) -> dict[str, str]:
    """The environment the session was created with (its toolchain's, then its own, then
    its model profile's variables), for its commands: opened from the stored message, never
    kept or logged here.

    Raises:
        SecretKeyMismatchError: the values are sealed with a key this process lacks.
        StoredMessageError: the message no longer validates (never quoting a value).
    """
    with db.session() as session:
        row = session.execute(
            select(WorkItem.org_id, WorkItem.payload, WorkItem.profile).where(
                WorkItem.id == work_item_id
            )
        ).first()
        profile = profiles.profile_env(session, row.profile) if row is not None else {}
    if row is None or not row.payload:
        return {}
    request = stored_request(db.sealer.open(row.payload, row.org_id, work_item_id))
    return {**request.toolchain.env, **request.env, **profile}


class SessionEndedError(LookupError):
    """The session ended (or went) between its read and the call."""


def hold(db: Database, session_id: str, *, busy_s: float) -> datetime:
    """A call starts: the session is not idle before it can have ended (``busy_s``) plus its
    idle TTL. The value written, for :func:`release`.

    Raises:
        SessionEndedError: it ended since it was read (the reaper, a close).
    """
    with db.session() as session:
        row = session.get(InteractiveSession, session_id, with_for_update=True)
        if row is None or row.ended_at is not None:
            raise SessionEndedError(f"session {session_id} has ended; create a new one")
        until = utcnow() + timedelta(seconds=busy_s + row.idle_ttl_s)
        row.idle_until = max(row.idle_until, until)
        return row.idle_until


def release(db: Database, session_id: str, held: datetime) -> None:
    """A call ended: idle from now, unless a later call moved the clock since (its hold
    stands until it ends)."""
    with db.session() as session:
        row = session.get(InteractiveSession, session_id, with_for_update=True)
        if row is not None and row.idle_until == held:
            row.idle_until = utcnow() + timedelta(seconds=row.idle_ttl_s)


def sandbox_path(value: str, field: str) -> str:
    """A path in the session's sandbox, relative to its work directory, with no way out.

    Raises:
        InvalidRequest: naming ``field``; the value is never echoed.
    """
    segments = value.split("/")
    if (
        not value
        or len(value) > MAX_PATH
        or value.startswith("/")
        or any(s in ("", ".", "..") or not _SEGMENT.match(s) for s in segments)
    ):
        raise InvalidRequest(
            field,
            "must be a path relative to the session's work directory: no leading /, no empty, "
            f". or .. segments, no control characters, at most {MAX_PATH} characters",
        )
    return value
