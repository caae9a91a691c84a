"""Provisioning one work item's sandbox (docs/architecture.md §5), idempotently.

A provision task may be delivered twice (a redelivery after a worker crash, or a duplicate
message). Each attempt of an item owns exactly one sandbox row, unique on
``(work_item_id, attempt)``, and the worker that inserted it holds a lease on it while it
calls the provider. A second delivery finds the row and reconciles: done already, still in
flight under a live lease, or abandoned (lease expired) and taken over. The registration
token is minted with the claim, stored as its hash, and handed only to the provider's spec.

The common case runs batched with the process's other provisions (:mod:`corral.worker.claims`):
claiming a routed item, and recording the handle of a sandbox still ours and still
provisioning. Every other case is decided here, one item at a time. No database
connection is held while the provider works.

A provision that fails ends its attempt's sandbox row and sends the item on: a permanent
error (or a provider bug) to the next qualifying pool (failover: routing passes the pool by
for the item, and fails it once every qualifying pool has failed it); a transient error past
the task's retries back to waiting (a brown-out: routed again after a back-off, the pool's
breaker deciding when that pool is tried again). An item whose message says
``failover: false`` fails instead, as every item did before.
"""

from __future__ import annotations

import enum
import logging
import time
from dataclasses import dataclass, field, replace
from datetime import datetime, timedelta

from pydantic import SecretStr
from sqlalchemy import select, update
from sqlalchemy.orm import Session

from corral.providers.base import (
    Egress,
    SandboxHandle,
    SandboxSpec,
    SandboxState,
    SecretBinding,
    SupportsCodeInterpreter,
)
from corral.providers.errors import (
    InvalidCapabilityOverrideError,
    InvalidProviderConfigError,
    RateLimitedError,
    SandboxPathError,
    TransientProviderError,
)
from corral.shared import logs, metrics
from corral.shared.errors import ConfigurationError, CorralError
from corral.shared.messages import (
    CodeWork,
    DispatchRequest,
    ShellWork,
    StoredMessageError,
    check_binding_value,
    stored_request,
)
from corral.shared.runtime import Runtime
from corral.shared.store import breaker, profiles, secrets, warm
from corral.shared.store.db import Database, utcnow
from corral.shared.store.ledger import record_cost_quietly
from corral.shared.store.lifecycle import (
    SandboxEnd,
    record_sandbox_ends,
    requeue,
    transition,
)
from corral.shared.store.models import (
    ItemState,
    Pool,
    RegistrationToken,
    Sandbox,
    TerminationReason,
    WorkItem,
)
from corral.shared.store.pools import session_limit_s
from corral.shared.store.secrets import SecretError, UnknownSecretError
from corral.shared.store.tokens import (
    hash_token,
    registration_token_row,
    revoke_registration_tokens,
    revoke_token,
)
from corral.worker.checkout_credential import GIT_CREDENTIAL, git_credential
from corral.worker.claims import (
    ClaimRequest,
    Delivery,
    Fresh,
    HandleWrite,
    ItemView,
    LockedHandle,
    batches,
    claim,
    write_handles,
)
from corral.worker.code_run import ExecuteGate, Superseded, record_failure, record_run
from corral.worker.pacing import PACE_REASONS, Grant, Paced, refused

log = logging.getLogger(__name__)


class Outcome(enum.StrEnum):
    PROVISIONED = "provisioned"
    ALREADY_PROVISIONED = "already_provisioned"
    IN_FLIGHT = "in_flight"
    SKIPPED = "skipped"
    FAILED = "failed"
    RAN = "ran"  # a code interpreter ran the item; its outcome is recorded
    WARM = "warm"  # bound to a waiting warm sandbox of its pool: nothing was made
    FAILED_OVER = "failed_over"  # the pool failed it: requeued, to be routed elsewhere now
    WAITING = "waiting"  # a brown-out: requeued, routed again once its back-off is over
    PACED = "paced"  # its provider's pace holds the create: the task is sent again for later


class Then(enum.Enum):
    """What a failed provision does to its item."""

    FAIL = "fail"  # the item fails with the error
    FAIL_OVER = "fail_over"  # requeued at once; routing passes this pool by for it
    WAIT = "wait"  # requeued after a back-off; its pool is not passed by


@dataclass(frozen=True)
class After:
    """What a failed provision does to its item, and when a requeued one is routed again."""

    then: Then = Then.FAIL
    not_before: datetime | None = None  # WAIT's back-off


FAILS = After()


@dataclass(frozen=True)
class Claimed:
    """A sandbox row this worker holds the lease on, and the spec to provision it with."""

    sandbox_id: str
    provider_id: str
    spec: SandboxSpec
    lease_until: datetime  # the fence: writes after the provider call check it is still ours
    token_hash: str
    session_limit_s: int | None = None  # the deadline, counted from the sandbox's start
    takeover: bool = False  # an earlier holder's lease ran out; clear what it left first
    work: ShellWork | CodeWork | None = None  # what a code interpreter runs itself
    breaker_dirty: bool = False  # the pool's breaker is not at rest: a success closes it
    warm: bool = False  # the pool keeps warm sandboxes: try to bind one first
    failover: bool = True  # the message's: a failure sends the item on instead of failing it
    secret_env: dict[str, str] = field(default_factory=dict)  # var -> named secret (not values)
    profile: str | None = None  # the item's model profile, by name
    pace: Grant | None = None  # the provider's pace let this create go (worker/pacing.py)

    def redact(self, text: str) -> str:
        """``text`` without this attempt's token, in case a provider echoed its input."""
        return text.replace(self.spec.registration_token.get_secret_value(), "[redacted]")


class RetryLater(CorralError):  # noqa: N818 - a signal to the task, not a failure
    """The provider failed transiently; the task should retry."""

    code = "provider_transient"

    def __init__(self, cause: TransientProviderError, message: str) -> None:
        super().__init__(message)
        self.cause = cause


_PAST_PROVISIONING = frozenset({ItemState.AWAITING_CLAIM, ItemState.RUNNING, ItemState.SUCCEEDED})


def provision_item(
    rt: Runtime,
    item_id: str,
    *,
    actor: str,
    final_attempt: bool = False,
    delivery: Delivery | None = None,
    pace: Grant | None = None,
) -> Outcome:
    """Provision the sandbox of ``item_id``'s current attempt; ``delivery``: the provision
    task's try that asks (a later try takes over an earlier one's lease at once); ``pace``:
    its provider's pace let the create go (:func:`corral.worker.pacing.admit`).

    Raises:
        RetryLater: a transient provider error, unless ``final_attempt`` (then the item fails).
        Paced: the provider refused the create for its rate or quota, and ``pace`` is set:
            the item waits for its pace, its attempt given back.
    """
    claimed_or_outcome = _claim_routed(rt, item_id, actor, delivery) or _claim(
        rt, item_id, actor, delivery
    )
    if isinstance(claimed_or_outcome, Claimed):
        if claimed_or_outcome.takeover:
            _cleanup(rt, claimed_or_outcome)
            # A warm sandbox the last holder bound before it died is ended too.
            for left in warm.release_bound(rt.db, claimed_or_outcome.sandbox_id):
                terminate_quietly(rt, left)
        claimed_or_outcome = _bind_warm(rt, claimed_or_outcome, actor) or claimed_or_outcome
    if isinstance(claimed_or_outcome, Outcome):
        return claimed_or_outcome
    claimed = replace(claimed_or_outcome, pace=pace)
    started = time.monotonic()
    try:
        provider = rt.provider(claimed.provider_id)
        interpreter = isinstance(provider, SupportsCodeInterpreter)
        handle = None if interpreter else provider.provision(claimed.spec)
    except CorralError as exc:
        _count_error(rt, claimed, exc.code, started)
        return _provision_failed(rt, claimed, exc, actor=actor, final_attempt=final_attempt)
    except Exception as exc:
        # A provider bug: fail the item with what is known, keep the worker serving.
        log.exception("provider raised an unexpected error", extra={"work_item_id": item_id})
        _count_error(rt, claimed, "provider_error", started)
        _cleanup(rt, claimed)
        message = f"{type(exc).__name__}: {exc}"
        return _give_up(rt, claimed, "provider_error", message, actor, transient=False)
    if handle is None:
        assert isinstance(provider, SupportsCodeInterpreter)
        return _run_code(rt, claimed, provider, actor=actor, final_attempt=final_attempt)
    metrics.PROVISION_SECONDS.labels(provider=claimed.provider_id, outcome="ok").observe(
        time.monotonic() - started
    )
    # Made is not yet a success of the pool: its runner's claim is (breaker.record_claim).
    if not _record(rt, claimed, handle, actor):
        # Superseded, cancelled or finished while the provider worked: nothing may keep
        # running for it.
        terminate_quietly(rt, handle)
        record_cost_quietly(rt.db, claimed.sandbox_id)
        return Outcome.SKIPPED
    return Outcome.PROVISIONED


def _bind_warm(rt: Runtime, claimed: Claimed, actor: str) -> Outcome | None:
    """Give the item a waiting warm sandbox of its pool (docs/warm-pools.md): its handle
    becomes the item's sandbox's, the token minted with the claim is revoked (the api mints
    the item's own at hand-over, through the warm runner's channel). None: the pool keeps
    none, the item does not fit one (:func:`corral.shared.store.warm.binds_warm`), or none waits."""
    if not (claimed.warm and claimed.spec.pool_id and warm.binds_warm(claimed.spec)):
        return None
    bound = warm.bind(
        rt.db,
        claimed.spec.pool_id,
        claimed.spec.work_item_id,
        claimed.sandbox_id,
        revoke_hash=claimed.token_hash,
        seen_within_s=rt.settings.warm_wait_s + warm.SEEN_GRACE_S,
    )
    if bound is None:
        return None
    metrics.WARM_BOUND.labels(provider=claimed.provider_id).inc()
    if not _record(rt, claimed, bound.handle, actor):
        terminate_quietly(rt, bound.handle)
        record_cost_quietly(rt.db, claimed.sandbox_id)
        return Outcome.SKIPPED
    return Outcome.WARM


def _run_code(
    rt: Runtime,
    claimed: Claimed,
    provider: SupportsCodeInterpreter,
    *,
    actor: str,
    final_attempt: bool,
) -> Outcome:
    """A code interpreter runs the item itself (:mod:`corral.worker.code_run`): the token
    is never used, errors before the execute call are a provision's, errors after it final.

    Raises:
        RetryLater: a transient error before the execute call, unless ``final_attempt``.
    """
    work = claimed.work
    with rt.db.session() as session:
        revoke_token(session, claimed.token_hash)  # no runner will ever redeem it
    if not isinstance(work, CodeWork) or work.language != "python":
        kind: str = work.kind if work is not None else "unknown"
        if isinstance(work, CodeWork):
            kind = f"{work.language} code"
        message = f"provider {claimed.provider_id} runs python code work items only, not {kind}"
        _fail(rt, claimed, "unsupported_work", message, actor)
        return Outcome.FAILED
    try:
        spec = _code_spec(rt, claimed)
    except (ConfigurationError, UnknownSecretError) as exc:
        _fail(rt, claimed, exc.code, exc.message, actor)
        return Outcome.FAILED
    limit = float(claimed.session_limit_s or claimed.spec.resources.timeout_s or 30)
    gate = ExecuteGate(
        rt.db, claimed.spec.work_item_id, claimed.sandbox_id, claimed.lease_until, limit, actor
    )
    started = time.monotonic()
    try:
        run = provider.run_code(spec, work.code, work.arguments, timeout_s=limit, on_execute=gate)
    except Superseded:
        record_cost_quietly(rt.db, claimed.sandbox_id)
        return Outcome.SKIPPED
    except Exception as exc:
        _count_error(rt, claimed, getattr(exc, "code", "provider_error"), started)
        return _code_failed(rt, claimed, gate, exc, actor=actor, final_attempt=final_attempt)
    metrics.PROVISION_SECONDS.labels(provider=claimed.provider_id, outcome="ok").observe(
        time.monotonic() - started
    )
    _breaker_success(rt, claimed)
    record_run(rt.db, rt.settings, gate, run, provider_id=claimed.provider_id)
    return Outcome.RAN


def _code_spec(rt: Runtime, claimed: Claimed) -> SandboxSpec:
    """The spec with the env a runner would have claimed: a code interpreter has no runner,
    so the item's ``secret_env`` is read (its uses recorded) as it is run, and its model
    profile's variables are added (``CORRAL_MODEL``, ...: corral's own names, last).

    Raises:
        UnknownSecretError: a named secret is gone (deleted since the dispatch).
        ConfigurationError: it cannot be opened here.
    """
    spec = claimed.spec
    with rt.db.session() as session:
        named = {}
        if claimed.secret_env:
            item = (spec.work_item_id, spec.org_id)
            named = secrets.resolve_for_item(
                session, rt.db.sealer.keyring, item, claimed.secret_env, secrets.UsedIn.ENV
            )
        profile = profiles.profile_env(session, claimed.profile)
    return spec.model_copy(update={"env": {**spec.env, **named, **profile}})


def _code_failed(
    rt: Runtime,
    claimed: Claimed,
    gate: ExecuteGate,
    exc: Exception,
    *,
    actor: str,
    final_attempt: bool,
) -> Outcome:
    """A code interpreter failed: before the execute call, as a provision fails (transient
    errors retried); after it, finally for this attempt (the code may have run).

    Raises:
        RetryLater: a transient error before the execute call, unless ``final_attempt``.
    """
    if isinstance(exc, CorralError):
        code, message = exc.code, exc.message
    else:  # a provider bug: fail the item with what is known, keep the worker serving
        log.error(
            "provider raised an unexpected error",
            exc_info=exc,
            extra={"work_item_id": claimed.spec.work_item_id},
        )
        code, message = "provider_error", f"{type(exc).__name__}: {exc}"
    if gate.sent:
        record_failure(rt.db, gate, code, claimed.redact(message))
        return Outcome.FAILED
    if isinstance(exc, CorralError):
        return _provision_failed(rt, claimed, exc, actor=actor, final_attempt=final_attempt)
    _cleanup(rt, claimed)
    return _give_up(rt, claimed, code, message, actor, transient=False)


# Failures of the item's own making (its options, paths) say nothing of the provider's health.
_THE_ITEMS_FAULT = frozenset(
    {
        InvalidProviderConfigError.code,
        InvalidCapabilityOverrideError.code,
        SandboxPathError.code,
        "unsupported_work",
    }
)
# When this process last counted a failure of each pool: a success after it resets the count
# even if the pool's breaker was at rest when that item was claimed.
_failed_here: dict[str, float] = {}


def _count_error(rt: Runtime, claimed: Claimed, code: str, started: float) -> None:
    """A failed provision, in the metrics and toward its pool's circuit breaker."""
    provider_id = claimed.provider_id
    metrics.PROVISION_ERRORS.labels(provider=provider_id, code=code).inc()
    metrics.PROVISION_SECONDS.labels(provider=provider_id, outcome="error").observe(
        time.monotonic() - started
    )
    pool_id = claimed.spec.pool_id
    paced = claimed.pace is not None and code == RateLimitedError.code  # a pace, not a failure
    if pool_id is None or code in _THE_ITEMS_FAULT or paced:
        return
    _failed_here[pool_id] = time.monotonic()
    try:
        with rt.db.session() as session:
            breaker.record_failure(
                session, pool_id, item_id=claimed.spec.work_item_id, code=code, settings=rt.settings
            )
    except Exception:  # the breaker is advice: the failure itself is still handled
        log.warning("could not count a provision failure toward the pool's breaker", exc_info=True)


def _breaker_success(rt: Runtime, claimed: Claimed) -> None:
    """A code interpreter ran the item (no runner claims it): a pool whose breaker was not
    at rest (when claimed, or failed in this process since, within the breaker's window)
    closes and its count restarts; a healthy pool costs nothing here."""
    pool_id = claimed.spec.pool_id
    if pool_id is None:
        return
    failed = _failed_here.get(pool_id)
    recent = failed is not None and time.monotonic() - failed < rt.settings.breaker_window_s
    if not (claimed.breaker_dirty or recent):
        return
    _failed_here.pop(pool_id, None)
    try:
        with rt.db.session() as session:
            breaker.record_success(session, [pool_id], item_id=claimed.spec.work_item_id)
    except Exception:
        log.warning("could not close the pool's breaker after a success", exc_info=True)


def _provision_failed(
    rt: Runtime, claimed: Claimed, exc: CorralError, *, actor: str, final_attempt: bool
) -> Outcome:
    """A provider error: retry later (transient, retries left), or give the attempt up
    (:func:`_give_up`).

    Raises:
        RetryLater: a transient error and not the final attempt.
        Paced: a rate-limit answer to a paced create (:func:`corral.worker.pacing.refused`),
            whatever the attempt: it is not counted.
    """
    if isinstance(exc, RateLimitedError) and claimed.pace is not None:
        _release(rt, claimed)
        raise Paced(refused(rt, claimed.pace)) from exc
    transient = isinstance(exc, TransientProviderError)
    if isinstance(exc, TransientProviderError) and not final_attempt:
        _release(rt, claimed)
        # Celery reports the retry's message in task events: no token in it.
        raise RetryLater(exc, claimed.redact(exc.message)) from exc
    _cleanup(rt, claimed)
    return _give_up(rt, claimed, exc.code, exc.message, actor, transient=transient)


def _give_up(
    rt: Runtime, claimed: Claimed, code: str, message: str, actor: str, *, transient: bool
) -> Outcome:
    """End a failed attempt and send its item on: a transient error (past the task's
    retries) back to waiting, any other to the next qualifying pool; with ``failover:
    false``, the item fails."""
    if not claimed.failover:
        suffix = " (gave up after retrying)" if transient else ""
        _fail(rt, claimed, code, f"{message}{suffix}", actor)
        return Outcome.FAILED
    if transient:
        not_before = utcnow() + timedelta(seconds=rt.settings.provision_backoff_max_s)
        _fail(rt, claimed, code, message, actor, after=After(Then.WAIT, not_before))
        return Outcome.WAITING
    _fail(rt, claimed, code, message, actor, after=After(Then.FAIL_OVER))
    return Outcome.FAILED_OVER


def _claim_routed(
    rt: Runtime, item_id: str, actor: str, delivery: Delivery | None
) -> Claimed | Outcome | None:
    """The common case, batched with the process's other claims: a routed item. None: the
    item is in any other state (or not there), for :func:`_claim` to decide."""
    holder = delivery.holder if delivery is not None else None
    fresh = batches(rt).claims.submit(ClaimRequest(item_id, actor, holder))
    if fresh is None:
        return None
    return _claimed(rt, fresh, provider_id=fresh.pool.provider_id, actor=actor)


def _claim(rt: Runtime, item_id: str, actor: str, delivery: Delivery | None) -> Claimed | Outcome:
    """Every case but the common one: a second delivery, a retry, a lease to take over, an
    item that is no longer routed, a routed item a batch skipped (its row was held)."""
    with rt.db.session() as session:
        item = session.get(WorkItem, item_id, with_for_update=True)
        if item is None:
            return Outcome.SKIPPED
        logs.remember(org_id=item.org_id, pool_id=item.pool_id, work_item_id=item.id)
        state = ItemState(item.state)
        if state in _PAST_PROVISIONING:
            return Outcome.ALREADY_PROVISIONED
        if state not in (ItemState.ROUTED, ItemState.PROVISIONING):
            return Outcome.SKIPPED  # cancelled or failed before it got a sandbox
        sandbox = session.scalars(
            select(Sandbox).where(Sandbox.work_item_id == item_id, Sandbox.attempt == item.attempts)
        ).one_or_none()
        if sandbox is None:
            taken = _claim_locked(rt, session, item, actor=actor, delivery=delivery)
        else:
            taken = _take_over(rt, session, item, sandbox, actor=actor, delivery=delivery)
        if isinstance(taken, Outcome):
            return taken
    # Committed first: _claimed may fail the attempt, which locks the rows anew.
    fresh, provider_id = taken
    return _claimed(rt, fresh, provider_id=provider_id, actor=actor, takeover=sandbox is not None)


def _claim_locked(
    rt: Runtime, session: Session, item: WorkItem, *, actor: str, delivery: Delivery | None
) -> tuple[Fresh, str] | Outcome:
    """Claim an item this session holds locked, which has no row for its attempt, through
    the claim's one definition (:func:`corral.worker.claims.claim`) on the session's
    connection: its own lock skips nothing."""
    if item.state != ItemState.ROUTED:
        # No path leaves this: a claim moves its item and makes the attempt's row at once.
        log.error("a provisioning item has no sandbox row", extra={"work_item_id": item.id})
        return Outcome.SKIPPED
    holder = delivery.holder if delivery is not None else None
    [fresh] = claim(
        session.connection(),
        [ClaimRequest(item.id, actor, holder)],
        lease_s=rt.settings.provision_lease_s,
        token_ttl_s=rt.settings.token_ttl_s,
    )
    if fresh is None:
        return Outcome.IN_FLIGHT  # a row of its attempt after all: another delivery's
    return fresh, fresh.pool.provider_id


def _take_over(
    rt: Runtime,
    session: Session,
    item: WorkItem,
    sandbox: Sandbox,
    *,
    actor: str,
    delivery: Delivery | None,
) -> tuple[Fresh, str] | Outcome:
    """The attempt's row exists: take its lease over with a new token, or say why not."""
    now = utcnow()
    lease = now + timedelta(seconds=rt.settings.provision_lease_s)
    outcome = _reconcile(session, item, sandbox, lease, actor, delivery=delivery)
    if outcome is not None:
        return outcome
    if item.wait_reason in PACE_REASONS:  # waited for its pace after a refusal: goes now
        item.wait_reason, item.not_before = None, None
    pool = session.get_one(Pool, item.pool_id)
    ttl_s = rt.settings.token_ttl_s
    token, row = registration_token_row(sandbox.id, item.id, ttl_s=ttl_s, now=now)
    session.add(RegistrationToken(**row, created_at=now))
    return Fresh(ItemView.of(item), pool, sandbox.id, lease, token), sandbox.provider_id


def _claimed(
    rt: Runtime, fresh: Fresh, *, provider_id: str, actor: str, takeover: bool = False
) -> Claimed | Outcome:
    """The spec of a claimed attempt; :attr:`Outcome.FAILED` when its env values cannot be
    opened (the secret key changed), a named secret of its bindings is gone or unfit, or its
    message no longer validates: no retry or later attempt could ever run it."""
    item = fresh.item
    logs.remember(
        org_id=item.org_id, pool_id=item.pool_id, work_item_id=item.id, sandbox_id=fresh.sandbox_id
    )
    try:
        # The stored message's env values are sealed (shared/store/sealing.py): opened for the
        # spec, and its bindings' named secrets read (the message never carries them).
        request = stored_request(rt.db.sealer.open(item.payload, item.org_id, item.id))
        bound = _named_bindings(rt, item.id, item.org_id, request)
        checkout = git_credential(rt, (item.id, item.org_id), request.inputs.git)
    except (ConfigurationError, SecretError, UnknownSecretError, StoredMessageError) as exc:
        attempt = _Attempt(
            fresh.item.id, fresh.sandbox_id, fresh.lease_until, hash_token(fresh.token)
        )
        _fail_attempt(rt, attempt, exc.code, exc.message, actor)
        return Outcome.FAILED
    spec = _spec(rt, request, fresh, bound, checkout)
    return Claimed(
        fresh.sandbox_id,
        provider_id,
        spec,
        lease_until=fresh.lease_until,
        token_hash=hash_token(fresh.token),
        takeover=takeover,
        session_limit_s=session_limit_s(fresh.pool, spec.resources.timeout_s),
        work=request.work,
        breaker_dirty=breaker.dirty(fresh.pool),
        warm=warm.keeps_warm(fresh.pool),
        failover=request.failover,
        secret_env=dict(request.secret_env),
        profile=request.profile,
    )


def _named_bindings(
    rt: Runtime, item_id: str, org_id: str, request: DispatchRequest
) -> dict[str, str]:
    """The values of the item's secret bindings that name a secret, read now (each use
    recorded) and held to a binding value's rules.

    Raises:
        UnknownSecretError: a named secret is gone (deleted since the dispatch).
        SecretError: its value cannot be a binding's (too long, or not one line).
        ConfigurationError: it cannot be opened here.
    """
    refs = request.binding_secrets
    if not refs:
        return {}
    with rt.db.session() as session:
        keyring, used_in = rt.db.sealer.keyring, secrets.UsedIn.BINDING
        values = secrets.resolve_for_item(session, keyring, (item_id, org_id), refs, used_in)
        for name, value in values.items():
            try:
                check_binding_value(value)
            except ValueError as exc:
                # Raised in the transaction: it is rolled back, no use recorded.
                raise SecretError(
                    f"egress.secret_bindings.{name}: the named secret {refs[name]} cannot be a "
                    f"binding's value: {exc}"
                ) from exc
    return values


def _reconcile(
    session: Session,
    item: WorkItem,
    sandbox: Sandbox,
    lease: datetime,
    actor: str,
    *,
    delivery: Delivery | None,
) -> Outcome | None:
    """What an existing sandbox row means for this delivery; None: take it over."""
    if sandbox.external_id is not None or sandbox.status != SandboxState.PROVISIONING:
        if item.state == ItemState.PROVISIONING and sandbox.external_id is not None:
            transition(
                session,
                item,
                ItemState.AWAITING_CLAIM,
                actor=actor,
                detail="reconciled with the sandbox already made",
            )
        return Outcome.ALREADY_PROVISIONED
    now = utcnow()
    earlier_try = delivery is not None and delivery.follows(sandbox.lease_holder)
    if sandbox.lease_until is not None and sandbox.lease_until > now and not earlier_try:
        return Outcome.IN_FLIGHT
    # The last holder's lease ran out (its worker died mid-provision), or it was an earlier
    # try of this task (which had done its work when it sent this one; see Delivery): take
    # over. Its token can no longer be redeemed, and provision_item terminates whatever it
    # made.
    taken = session.execute(
        update(Sandbox)
        .where(Sandbox.id == sandbox.id, Sandbox.lease_until == sandbox.lease_until)
        .values(lease_until=lease, lease_holder=delivery.holder if delivery else None)
        .execution_options(synchronize_session=False)
    )
    if getattr(taken, "rowcount", 0) != 1:
        return Outcome.IN_FLIGHT
    revoke_registration_tokens(session, sandbox.id)
    return None


def _spec(
    rt: Runtime,
    request: DispatchRequest,
    fresh: Fresh,
    bound: dict[str, str],
    checkout: SecretBinding | None = None,
) -> SandboxSpec:
    item, pool = fresh.item, fresh.pool
    settings = rt.settings
    control_url = settings.control_url
    egress = _egress(request, bound, checkout)
    if control_through_socket(rt, pool.provider_id, egress):
        # No network in the box (or only corral's egress proxy, through its own socket): the
        # runner comes through the api's Unix socket instead. (Other providers keep the
        # network URL and allow egress to the api alone.)
        control_url = f"unix://{settings.resolved_api_socket()}"
    resources = request.resources
    if request.needs_gpu and not resources.gpu:
        # Routed to a GPU queue by its agent card's `gpu` requirement alone: one GPU.
        resources = resources.model_copy(update={"gpu": 1})
    return SandboxSpec(
        work_item_id=item.id,
        sandbox_id=fresh.sandbox_id,
        org_id=item.org_id,
        project_id=item.project_id,
        registration_token=SecretStr(fresh.token),
        control_url=control_url,
        env=dict(request.env),
        image=request.image,
        resources=resources,
        pool_id=pool.id,
        provider_options=dict(pool.sandbox_config),
        toolchain=request.toolchain,
        egress=egress,
        labels={"corral.project-id": item.project_id},
    )


def _egress(
    request: DispatchRequest, bound: dict[str, str], checkout: SecretBinding | None = None
) -> Egress:
    """The whole egress of the message, as the provider's spec carries it; ``bound``: the
    values of the bindings that name a secret, read for it; ``checkout``: the git input's
    credential, a binding of its own (:mod:`corral.worker.checkout_credential`)."""
    asked = request.egress
    bindings = {
        name: SecretBinding(
            host=b.host, value=SecretStr(bound.get(name, b.value or "")), header=b.header
        )
        for name, b in asked.secret_bindings.items()
    }
    if checkout is not None:
        bindings[GIT_CREDENTIAL] = checkout
    return Egress(
        allow_network=asked.allow_network,
        allowed_hosts=asked.allowed_hosts,
        http_proxy=asked.http_proxy,
        https_proxy=asked.https_proxy,
        no_proxy=asked.no_proxy,
        ca_cert_pem=None if asked.ca_cert_pem is None else SecretStr(asked.ca_cert_pem),
        secret_bindings=bindings,
    )


def mounts_api_socket(rt: Runtime, provider_id: str) -> bool:
    try:
        return type(rt.provider(provider_id)).mounts_api_socket
    except CorralError:
        return False  # the provision call itself reports what is wrong with the provider


def control_through_socket(rt: Runtime, provider_id: str, egress: Egress) -> bool:
    """Whether the runner reaches the api through its Unix socket: the provider mounts it,
    and the sandbox has no network of its own (none, or corral's egress proxy alone)."""
    if not mounts_api_socket(rt, provider_id):
        return False
    if not egress.allow_network or egress.proxied:
        return True
    return type(rt.provider(provider_id)).egress_through_proxy


def _record(rt: Runtime, claimed: Claimed, handle: SandboxHandle, actor: str) -> bool:
    """Store the handle, batched with the process's other handles in the common case; False
    when this attempt no longer owns the sandbox or its item ended."""
    if batches(rt).handles.submit(_handle_write(claimed, handle, actor)):
        return True
    return _record_handle(rt.db, claimed, handle, actor)


def _handle_write(claimed: Claimed, handle: SandboxHandle, actor: str) -> HandleWrite:
    return HandleWrite(
        claimed.spec.work_item_id,
        claimed.sandbox_id,
        claimed.lease_until,
        handle,
        claimed.session_limit_s,
        actor,
    )


def _record_handle(db: Database, claimed: Claimed, handle: SandboxHandle, actor: str) -> bool:
    """Store the handle one by one (every case but the common one), through the handle
    write's one definition (:func:`corral.worker.claims.write_handles`); False when this
    attempt no longer owns the sandbox or its item ended."""
    now = utcnow()
    with db.session() as session:
        # Item first, then sandbox: the order every path that locks both uses.
        item = session.get(WorkItem, claimed.spec.work_item_id, with_for_update=True)
        sandbox = session.get(Sandbox, claimed.sandbox_id, with_for_update=True)
        assert sandbox is not None and item is not None
        if sandbox.lease_until != claimed.lease_until:
            return False  # superseded: whoever took the row over records its end
        locked = LockedHandle(_handle_write(claimed, handle, actor), item.state, sandbox.status)
        write_handles(session.connection(), [locked], now)
        if not ItemState(item.state).is_final:
            return True
        # Cancelled (or ended) while the provider worked: the caller kills the sandbox; its
        # end is recorded here, so that it is billed and nothing waits on it.
        cancelled = item.state == ItemState.CANCELLED
        reason = TerminationReason.CANCELLED if cancelled else TerminationReason.FINISHED
        end = SandboxEnd(
            sandbox.id,
            item.id,
            sandbox.status,
            SandboxState.TERMINATED,
            reason,
            "its work item ended while it was made",
        )
        record_sandbox_ends(session, [end], actor=actor, at=now)
    return False


def _release(rt: Runtime, claimed: Claimed) -> None:
    """Undo a failed attempt so that a retry starts clean: no token, no partial sandbox."""
    _cleanup(rt, claimed)
    with rt.db.session() as session:
        revoke_token(session, claimed.token_hash)
        session.execute(
            update(Sandbox)
            .where(Sandbox.id == claimed.sandbox_id, Sandbox.lease_until == claimed.lease_until)
            .values(lease_until=None)
        )


def _cleanup(rt: Runtime, claimed: Claimed) -> None:
    """Best-effort terminate of whatever a failed provision left behind.

    Providers that name sandboxes by corral's sandbox id (all built-ins) find it by that id;
    others treat the unknown id as already gone.
    """
    terminate_quietly(
        rt,
        SandboxHandle(
            provider_id=claimed.provider_id,
            external_id=claimed.sandbox_id,
            metadata={"org_id": claimed.spec.org_id, "sandbox_id": claimed.sandbox_id},
        ),
    )


def terminate_quietly(rt: Runtime, handle: SandboxHandle) -> None:
    try:
        rt.provider(handle.provider_id).terminate(handle)
    except Exception:  # a cleanup path: the reaper's inventory sweep catches what is left
        log.warning(
            "cleanup terminate failed", extra={"sandbox_id": handle.external_id}, exc_info=True
        )


@dataclass(frozen=True)
class _Attempt:
    """What failing an attempt needs to know of it."""

    work_item_id: str
    sandbox_id: str
    lease_until: datetime
    token_hash: str


def _fail(
    rt: Runtime, claimed: Claimed, code: str, message: str, actor: str, *, after: After = FAILS
) -> None:
    attempt = _Attempt(
        claimed.spec.work_item_id, claimed.sandbox_id, claimed.lease_until, claimed.token_hash
    )
    _fail_attempt(rt, attempt, code, claimed.redact(message), actor, after=after)


def _fail_attempt(
    rt: Runtime, claimed: _Attempt, code: str, message: str, actor: str, *, after: After = FAILS
) -> None:
    """End the attempt's sandbox row (no token left to redeem), if still ours, and fail or
    requeue its item as ``after`` says. The item keeps the error either way: a requeued one
    shows why it waits, and fails with it when no qualifying pool is left."""
    with rt.db.session() as session:
        revoke_token(session, claimed.token_hash)
        item = session.get(WorkItem, claimed.work_item_id, with_for_update=True)
        sandbox = session.get(Sandbox, claimed.sandbox_id, with_for_update=True)
        assert sandbox is not None and item is not None
        if sandbox.lease_until != claimed.lease_until:
            return  # another delivery took the sandbox over; the outcome is its to record
        now = utcnow()
        reason = (
            TerminationReason.PROVISION_UNAVAILABLE
            if after.then is Then.WAIT
            else TerminationReason.PROVISION_FAILED
        )
        end = SandboxEnd(sandbox.id, item.id, sandbox.status, SandboxState.FAILED, reason, message)
        record_sandbox_ends(session, [end], actor=actor, at=now)
        if not ItemState(item.state).is_final:
            item.error_code = code
            item.error_message = message
            if after.then is Then.FAIL:
                transition(session, item, ItemState.FAILED, actor=actor, detail=code, at=now)
            else:
                detail = _requeued(sandbox.pool_id, sandbox.attempt, code, after)
                requeue(session, item, not_before=after.not_before, actor=actor, detail=detail)
    record_cost_quietly(rt.db, claimed.sandbox_id)
    log.warning(
        "provision failed",
        extra={
            "work_item_id": claimed.work_item_id,
            "sandbox_id": claimed.sandbox_id,
            "code": code,
            "then": after.then.value,
        },
    )


def _requeued(pool_id: str, attempt: int, code: str, after: After) -> str:
    """The audit row of a failed provision's requeue: what failed, and what happens next."""
    failed = f"requeued: attempt {attempt} could not be provisioned on pool {pool_id} ({code})"
    if after.then is Then.FAIL_OVER:
        return f"{failed}; failover: routed to the next qualifying pool"
    not_before = after.not_before
    when = not_before.isoformat(timespec="seconds") if not_before else "now"
    return (
        f"{failed}, the provider failing transiently past the provision's retries; waits, "
        f"routed again from {when} to a pool whose breaker lets work through"
    )
