"""The runner protocol: register, claim, heartbeat, logs, complete (docs/runner-protocol.md;
its tokens: docs/architecture.md §7).

``register`` trades a one-time registration token for a runner session token (and, asked,
claims the work item in the same call) and answers the same 401 for every bad token
(unknown, used, expired, or its sandbox gone), so the answer tells an attacker nothing.
The other calls need the session token and only ever reach the session's own sandbox and
work item.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Annotated, Any, Literal

from fastapi import APIRouter, BackgroundTasks, Depends, Header, HTTPException, Request, Response
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ConfigDict, Field
from sqlalchemy.orm import Session
from starlette.concurrency import run_in_threadpool

from corral.providers.base import SandboxState
from corral.scheduler.admin.responses import (
    BundleStored,
    ClaimBundle,
    Claimed,
    ClaimGit,
    ClaimInputs,
    ClaimProfile,
    Completed,
    HeartbeatAnswer,
    LogsAccepted,
    LogStream,
    Registered,
)
from corral.scheduler.api import bundle_api
from corral.scheduler.api.bodies import StrictJSONRoute
from corral.scheduler.api.process_runtime import ApiRuntime, runtime_of
from corral.scheduler.end_batches import END_BATCHES
from corral.scheduler.hand_on import HandOns
from corral.scheduler.publish import request_redrive
from corral.shared import kits, metrics
from corral.shared.broker.celery_app import app as celery_app
from corral.shared.errors import ConfigurationError
from corral.shared.logs import remember
from corral.shared.messages import StoredMessageError, stored_request
from corral.shared.runtime import Runtime
from corral.shared.settings import BundleSettings, RunnerSettings
from corral.shared.store import breaker, profiles, secrets
from corral.shared.store.completion import MAX_LINE, MAX_RESULT_BYTES, record_result, store_logs
from corral.shared.store.db import utcnow
from corral.shared.store.lifecycle import sandbox_transition, transition
from corral.shared.store.models import (
    ItemState,
    RunnerSession,
    Sandbox,
    TerminationReason,
    WorkItem,
)
from corral.shared.store.sealing import Sealer
from corral.shared.store.secrets import UnknownSecretError
from corral.shared.store.tokens import (
    SESSION_PREFIX,
    end_other_runner_sessions,
    find_runner_session,
    open_runner_session,
    redeem_registration_token,
)
from corral.shared.text import Int32

log = logging.getLogger(__name__)
ACTOR = "runner"
UNAUTHORIZED = HTTPException(status_code=401, detail="unauthorized")
# Where :func:`runner_token` leaves the call's token for :class:`RunnerRoute`.
SCOPE_KEY = "corral.runner_token"


class RunnerRoute(StrictJSONRoute):
    """A runner route: a call of a session that is not live is answered 401 whatever its
    body. FastAPI validates a body after the dependencies and before the endpoint, where
    the call's transaction reads its session; so a call whose body or parameters do not
    validate has its session read here (in a worker thread), before it is answered 422."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def session_first(request: Request) -> Response:
            try:
                return await handler(request)
            except RequestValidationError:
                token = request.scope.get(SCOPE_KEY)  # None: the body was not JSON at all
                if isinstance(token, RunnerToken):
                    await run_in_threadpool(_find_session, runtime_of(request.app), token)
                raise

        return session_first


# The slots runners' reports free are handed on in this process (corral.scheduler.hand_on).
HAND_ONS = HandOns(actor="api")

router = APIRouter(prefix="/v1/runner", tags=["runner"], route_class=RunnerRoute)
MAX_LINES = 1000
LATE_LOGS_S = 300


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")


class RegisterBody(_Body):
    token: str = Field(max_length=200)
    runner_version: str | None = Field(default=None, max_length=64)
    claim: bool = Field(
        default=False,
        description="claim the work item in the same call: the answer carries it as /claim "
        "would, or no claim when it cannot be claimed now (then /claim says why)",
    )


class SessionBody(_Body):
    work_item_id: str | None = Field(
        default=None, description="optional; when given it must be the session's own item"
    )


class LogLine(_Body):
    stream: LogStream = "stdout"
    line: str = Field(max_length=4 * MAX_LINE)
    ts: float | None = None


class LogsBody(SessionBody):
    lines: list[LogLine] = Field(max_length=MAX_LINES)


class CompleteBody(SessionBody):
    exit_code: Int32
    result: Any = None
    duration_s: float | None = Field(default=None, ge=0)
    error: str | None = Field(default=None, max_length=10_000)
    phase: Literal["install", "input", "post_acquire", "work"] = "work"
    cancelled: bool = False
    error_code: Literal["result_too_large", "bundle_too_large", "out_of_memory"] | None = Field(
        default=None,
        description="result_too_large: the runner kept back a result over max_result_bytes; "
        "bundle_too_large: the workspace's changes were over the claim's bundle limits; "
        "out_of_memory: the phase ran out of the sandbox's memory",
    )
    lines: list[LogLine] = Field(
        default_factory=list,
        max_length=MAX_LINES,
        description="the work's last log lines, kept with the report as /logs keeps them "
        "(once: a repeated report keeps none)",
    )


@dataclass(frozen=True)
class RunnerToken:
    """The bearer token a runner call carries, read from its header alone: the session it
    names is found in the call's own transaction (:func:`_session_of`)."""

    token: str


async def runner_token(
    request: Request, authorization: Annotated[str | None, Header()] = None
) -> RunnerToken:
    """``Authorization: Bearer crs_...``'s token (401 without one, or for any other kind of
    token). A coroutine that reads nothing, so that FastAPI does not hand it to a worker
    thread of its own."""
    token = bearer(authorization)
    if token is None or not token.startswith(SESSION_PREFIX):
        raise UNAUTHORIZED
    found = request.scope[SCOPE_KEY] = RunnerToken(token)
    return found


def bearer(authorization: str | None) -> str | None:
    if not authorization:
        return None
    scheme, _, token = authorization.partition(" ")
    return token.strip() if scheme.lower() == "bearer" and token.strip() else None


Runner = Annotated[RunnerToken, Depends(runner_token)]


def _session_of(session: Session, runner: RunnerToken) -> RunnerSession:
    """The caller's live runner session, read in ``session`` (the call's one transaction)."""
    found = find_runner_session(session, runner.token)
    if found is None:
        raise UNAUTHORIZED
    return found


def _find_session(rt: Runtime, runner: RunnerToken) -> RunnerSession:
    with rt.db.session() as session:
        return _session_of(session, runner)


# Each call runs its whole body in one worker thread (its one transaction in it), from an
# endpoint that is a coroutine: FastAPI would hand a plain function's dependency, body and
# answer to a worker thread each.


@router.post("/register")
async def register(body: RegisterBody, rt: ApiRuntime) -> Registered:
    return await run_in_threadpool(_register, body, rt)


def _register(body: RegisterBody, rt: Runtime) -> Registered:
    with rt.db.session() as session:
        redeemed = redeem_registration_token(session, body.token)
        # Locked, as the claim locks it: a runner registers before a claim or not at all.
        sandbox = (
            session.get(Sandbox, redeemed.sandbox_id, with_for_update=True) if redeemed else None
        )
        if sandbox is None or sandbox.terminated_at is not None:
            raise UNAUTHORIZED
        if sandbox.status == SandboxState.RUNNING:
            # Claimed already, by the runner of an earlier try's token (the provider made the
            # sandbox twice): its work is that runner's alone.
            raise UNAUTHORIZED
        remember(
            org_id=sandbox.org_id,
            pool_id=sandbox.pool_id,
            work_item_id=sandbox.work_item_id,
            sandbox_id=sandbox.id,
        )
        expires = sandbox.deadline_at or utcnow() + timedelta(seconds=rt.settings.session_ttl_s)
        session_token = open_runner_session(session, sandbox, expires_at=expires)
        answer = Registered(
            session_token=session_token,
            sandbox_id=sandbox.id,
            work_item_id=sandbox.work_item_id,
            heartbeat_interval_s=rt.settings.heartbeat_interval_s,
            claim=None,
        )
    log.info("runner registered", extra={"sandbox_id": answer.sandbox_id})
    if body.claim:
        # In a transaction of its own, which locks the item before the sandbox as every
        # other does (the registration's locked the sandbox alone): one call fewer, the
        # same claim. What it cannot do here (a refusal, a conflict) /claim does and says.
        try:
            return answer.model_copy(
                update={"claim": _take(RunnerToken(session_token), rt, None, refuse=False)}
            )
        except HTTPException:
            return answer  # a conflict: /claim answers it, saying why
        except Exception as exc:  # the database: the registration holds, /claim is retried
            log.warning(
                "a claim with its registration failed; the runner claims apart",
                extra={"sandbox_id": answer.sandbox_id, "error": type(exc).__name__},
            )
    return answer


def _own_item(session: Session, runner: RunnerSession, asked: str | None) -> WorkItem:
    if asked is not None and asked != runner.work_item_id:
        raise HTTPException(status_code=404, detail="work item not found")
    item = session.get(WorkItem, runner.work_item_id, with_for_update=True)
    if item is None or item.org_id != runner.org_id:
        raise HTTPException(status_code=404, detail="work item not found")
    return item


@router.post("/claim")
async def claim(runner: Runner, rt: ApiRuntime, body: SessionBody | None = None) -> Claimed:
    return await run_in_threadpool(_claim, runner, rt, body)


def _claim(token: RunnerToken, rt: Runtime, body: SessionBody | None) -> Claimed:
    work = _take(token, rt, body, refuse=True)
    assert work is not None  # with refuse, work that cannot be opened raised
    return work


def _take(
    token: RunnerToken, rt: Runtime, body: SessionBody | None, *, refuse: bool
) -> Claimed | None:
    """The claim's answer. Without ``refuse`` (the claim made with the registration), an
    item whose work cannot be opened is left as it is, and None answered: the runner's
    /claim then fails it and says why."""
    claimed: tuple[str, datetime, datetime | None, datetime] | None = None
    refused: ConfigurationError | UnknownSecretError | StoredMessageError | None = None
    with rt.db.session() as session:
        runner = _session_of(session, token)
        item = _own_item(session, runner, body.work_item_id if body else None)
        sandbox = session.get(Sandbox, runner.sandbox_id, with_for_update=True)
        assert sandbox is not None
        state = ItemState(item.state)
        fresh = state in (ItemState.PROVISIONING, ItemState.AWAITING_CLAIM)
        if sandbox.attempt != item.attempts:  # an earlier attempt's: the item moved on
            raise HTTPException(status_code=409, detail="this sandbox's attempt has ended")
        if not fresh and not (
            state is ItemState.RUNNING and sandbox.status == SandboxState.RUNNING
        ):
            raise HTTPException(status_code=409, detail=f"work item is {state.value}")
        try:
            work = _work_of(session, item, rt.db.sealer, rt.settings, first=fresh)
        except (ConfigurationError, UnknownSecretError, StoredMessageError) as exc:
            if not refuse:
                return None
            # The secret key changed since the item was sealed, a named secret it refers to
            # was deleted since its dispatch, or its message no longer validates: no runner
            # can ever get its work, so the item fails now (committed below) rather than
            # waiting for the reaper.
            item.error_code, item.error_message = exc.code, exc.message
            transition(session, item, ItemState.FAILED, actor=ACTOR, detail=exc.code)
            refused = exc
        else:
            if fresh:
                transition(session, item, ItemState.RUNNING, actor=ACTOR, detail=sandbox.id)
                sandbox_transition(session, sandbox, SandboxState.RUNNING, actor=ACTOR)
                sandbox.last_heartbeat_at = utcnow()
                # One runner works: another that registered for this sandbox (a pod of an
                # earlier try of its provision) can no longer claim, heartbeat or report.
                end_other_runner_sessions(session, sandbox.id, keep=runner.id)
                breaker.record_claim(session, sandbox.pool_id, item_id=item.id)
                claimed = (
                    sandbox.provider_id,
                    item.created_at,
                    sandbox.started_at,
                    sandbox.last_heartbeat_at,
                )
    if refused is not None:
        celery_app.send_task(
            "corral.terminate", args=[runner.sandbox_id, TerminationReason.FINISHED]
        )
        request_redrive()  # the failed item's slot: a waiting item's now
        raise HTTPException(
            status_code=409, detail={"error": refused.code, "message": refused.message}
        )
    if claimed is not None:  # observed once the claim is committed, so a retry cannot repeat it
        _observe_claim(*claimed)
    return work


def _observe_claim(
    provider_id: str, received: datetime, made: datetime | None, claimed: datetime
) -> None:
    """Both dispatch latencies, known together once the runner claims. ``made`` is when this
    attempt's sandbox was recorded as made (None: the runner claimed first, so just now)."""
    made = made or claimed
    metrics.DISPATCH_TO_PROVISIONED.labels(provider=provider_id).observe(
        max((made - received).total_seconds(), 0.0)
    )
    metrics.PROVISIONED_TO_CLAIMED.labels(provider=provider_id).observe(
        max((claimed - made).total_seconds(), 0.0)
    )


def _work_of(
    session: Session, item: WorkItem, sealer: Sealer, settings: BundleSettings, *, first: bool
) -> Claimed:
    """What the runner gets: the work, with its env values opened and its named secrets
    read (this answer alone carries them). Their uses are recorded at the attempt's
    ``first`` claim alone: a sandbox repeating its claim writes nothing more.

    Raises:
        ConfigurationError: an env value or named secret cannot be opened here.
        UnknownSecretError: a named secret it refers to is gone (deleted since dispatch).
        StoredMessageError: its message no longer validates (the rules changed since).
    """
    request = stored_request(sealer.open(item.payload, item.org_id, item.id))
    toolchain = request.toolchain
    resolved = kits.resolve(toolchain.kits)  # checked when the item was accepted
    named = secrets.resolve_for_item(
        session,
        sealer.keyring,
        (item.id, item.org_id),
        request.secret_env,
        secrets.UsedIn.ENV,
        record=first,
    )
    profile = profiles.read_profile(session, item.profile)
    return Claimed(
        work_item_id=item.id,
        work=request.work,
        install_commands=[*resolved.install_commands, *toolchain.install_commands],
        post_acquire=list(toolchain.post_acquire),
        pre_release=list(toolchain.pre_release),
        # The profile's variables last: corral's own names, which no message may set.
        env={
            **resolved.env,
            **toolchain.env,
            **request.env,
            **named,
            **(profile.env() if profile else {}),
        },
        profile=ClaimProfile.of(profile) if profile else None,
        path=list(resolved.path),
        timeout_s=request.resources.timeout_s,
        max_result_bytes=MAX_RESULT_BYTES,
        bundle=_bundle_limits(settings) if request.collects_bundle else None,
        inputs=ClaimInputs(git=ClaimGit.of(request.inputs.git)) if request.inputs.git else None,
    )


def _bundle_limits(settings: BundleSettings) -> ClaimBundle:
    return ClaimBundle(
        max_bytes=settings.bundle_max_bytes,
        max_manifest_bytes=settings.bundle_max_manifest_bytes,
        max_patches=settings.bundle_max_patches,
    )


@router.post("/heartbeat")
async def heartbeat(
    runner: Runner, rt: ApiRuntime, body: SessionBody | None = None
) -> HeartbeatAnswer:
    return await run_in_threadpool(_heartbeat, runner, rt, body)


def _heartbeat(token: RunnerToken, rt: Runtime, body: SessionBody | None) -> HeartbeatAnswer:
    with rt.db.session() as session:
        runner = _session_of(session, token)
        item = _own_item(session, runner, body.work_item_id if body else None)
        sandbox = session.get(Sandbox, runner.sandbox_id)
        assert sandbox is not None
        sandbox.last_heartbeat_at = utcnow()
        # An item ended from outside (cancelled, or failed by the control plane) stops its
        # work, and so does an attempt the item has moved on from (requeued).
        ended = item.state in (ItemState.CANCELLED, ItemState.FAILED)
        return HeartbeatAnswer(cancel=ended or sandbox.attempt != item.attempts)


@router.post("/logs")
async def logs(runner: Runner, body: LogsBody, rt: ApiRuntime) -> LogsAccepted:
    """Store the lines that fit in the item's log budget; ``dropped`` counts the others."""
    return await run_in_threadpool(_logs, runner, body, rt)


def _logs(token: RunnerToken, body: LogsBody, rt: Runtime) -> LogsAccepted:
    settings = rt.settings
    with rt.db.session() as session:
        runner = _session_of(session, token)
        item = _own_item(session, runner, body.work_item_id)
        # pre_release output after completion is still welcome; much later, nothing is.
        finished = item.finished_at
        if finished is not None and (utcnow() - finished).total_seconds() > LATE_LOGS_S:
            raise HTTPException(status_code=409, detail=f"work item is {item.state}")
        kept = _keep_lines(session, item, body.lines, settings)
    return LogsAccepted(accepted=kept, dropped=len(body.lines) - kept)


def _keep_lines(
    session: Session, item: WorkItem, lines: list[LogLine], settings: RunnerSettings
) -> int:
    """Store the lines that fit in the item's log budget; how many."""
    if not lines:
        return 0
    return store_logs(
        session,
        item,
        ((line.stream, line.line) for line in lines),
        max_bytes=settings.log_budget_bytes,
        max_lines=settings.log_budget_lines,
    )


@router.put("/bundle", response_model=BundleStored, openapi_extra=bundle_api.UPLOAD_BODY)
async def bundle(runner: Runner, request: Request, rt: ApiRuntime) -> Any:
    """Keep the result bundle of the session's item (a gzipped tar, docs/runner-protocol.md),
    sent before ``complete``; a repeated upload replaces it. Refused: 413 ``bundle_too_large``
    or 422 ``bundle_invalid``, and the item fails with that code."""
    found = await run_in_threadpool(_find_session, rt, runner)  # before the upload is read
    return await bundle_api.receive_upload(rt, found.work_item_id, found.sandbox_id, request)


@router.post("/complete")
async def complete(
    runner: Runner, body: CompleteBody, rt: ApiRuntime, after: BackgroundTasks
) -> Completed:
    completed, freed = await run_in_threadpool(_complete, runner, body, rt)
    if freed:  # handed on by this process once answered, not by a message to maintenance
        after.add_task(HAND_ONS.run, rt)
    return completed


def _complete(token: RunnerToken, body: CompleteBody, rt: Runtime) -> tuple[Completed, bool]:
    """The report's answer, and whether it freed the item's slot."""
    route_now = freed = False
    with rt.db.session() as session:
        runner = _session_of(session, token)
        item = _own_item(session, runner, body.work_item_id)
        sandbox = session.get(Sandbox, runner.sandbox_id)
        assert sandbox is not None
        state = ItemState(item.state)
        if state.is_final:
            final = state  # ended from outside (cancelled, failed by the control plane)
            if item.exit_code is None:  # not a repeat of this report: its lines are new
                _keep_lines(session, item, body.lines, rt.settings)
        elif sandbox.attempt == item.attempts and state is ItemState.RUNNING:
            _keep_lines(session, item, body.lines, rt.settings)
            final = _record_result(session, item, body, max_attempts=rt.settings.max_attempts)
            route_now = final is ItemState.RECEIVED and item.not_before is None
            freed = True  # its slot: a waiting item's now, without waiting for the sandbox's end
        elif sandbox.end_requested_at is not None:
            # This attempt reported already and the item was requeued (its lease retries
            # failed work): a repeated report, answered as the first was.
            final = ItemState.RECEIVED
        elif sandbox.attempt != item.attempts:
            raise HTTPException(status_code=409, detail="this sandbox's attempt has ended")
        else:
            raise HTTPException(status_code=409, detail=f"work item is {state.value}")
    END_BATCHES.add(runner.sandbox_id, window_s=rt.settings.end_batch_s)
    if route_now:  # requeued (its lease retries failed work)
        celery_app.send_task("corral.route", args=[runner.work_item_id])
    return Completed(state=final), freed


def _record_result(
    session: Session, item: WorkItem, body: CompleteBody, *, max_attempts: int
) -> ItemState:
    return record_result(
        session,
        item,
        exit_code=body.exit_code,
        result=body.result,
        duration_s=body.duration_s,
        error=body.error,
        actor=ACTOR,
        phase=body.phase,
        cancelled=body.cancelled,
        error_code=body.error_code,
        max_attempts=max_attempts,
    )
