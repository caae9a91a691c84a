"""Pools and model profiles: what operators create, through the CLI or the admin api."""

from __future__ import annotations

import logging
import uuid
from collections.abc import Iterable
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator
from sqlalchemy import func, select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session, object_session

from corral.providers.capabilities import (
    ENFORCEMENT_FIELDS,
    BillingModel,
    ProviderCapabilities,
    Substrate,
    parse_substrate_override,
)
from corral.providers.errors import InvalidCapabilityOverrideError, ProviderError
from corral.providers.registry import default_registry
from corral.scheduler.publish import request_redrive
from corral.shared.errors import CorralError
from corral.shared.messages import describe_field_errors, field_errors
from corral.shared.store import shares
from corral.shared.store.db import Database, utcnow
from corral.shared.store.leases import LeaseSpec
from corral.shared.store.models import (
    FINAL_ITEM_STATES,
    AuthMode,
    Capacity,
    ModelProfile,
    Pool,
    WorkItem,
)
from corral.shared.store.pools import PoolView
from corral.shared.store.warm import WARM_MIN_LIMIT, WarmWindow
from corral.shared.text import IDENTIFIER, INT32_MAX, INT32_MIN, INT64_MAX, Printable

log = logging.getLogger(__name__)


class AdminError(CorralError, ValueError):
    """The admin request is invalid."""

    code = "invalid_request"


class ProfileCreate(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field(pattern=IDENTIFIER)
    model: Printable = Field(min_length=1, max_length=255)
    auth_mode: AuthMode


class PoolLease(LeaseSpec):
    """A pool's default lease policy: the fields it sets for its items (docs/operations.md)."""


class PoolSettings(BaseModel):
    """What an operator may set on a pool, at creation and later (:class:`PoolUpdate`)."""

    model_config = ConfigDict(extra="forbid")

    # Ranges of the columns they are stored in (INTEGER), so a value is refused, not overflowed.
    priority: int = Field(default=0, ge=INT32_MIN, le=INT32_MAX)
    active: bool = True
    max_concurrent: int = Field(default=10, gt=0, le=INT32_MAX)
    runtime_provides: dict[str, Any] | None = Field(
        default=None, description="substrate override: runtimeKinds, requirementKinds"
    )
    capabilities: dict[str, Any] | None = Field(
        default=None, description="capability-matrix fields this pool overrides"
    )
    sandbox_config: dict[str, Any] = Field(default_factory=dict)
    billing_model: BillingModel | None = Field(
        default=None, description="wall-clock, fixed or active-cpu; default: the provider's"
    )
    rate_micros: int = Field(
        default=0,
        ge=0,
        le=INT64_MAX,
        description="micro-units per second (wall-clock), per session (fixed) or per CPU "
        "second (active-cpu)",
    )
    lease: PoolLease | None = Field(
        default=None,
        description="the pool's default lease policy: what its items get for the lease "
        "fields their message leaves out (docs/operations.md#lease-policies); an update "
        "replaces it as a whole, {} or null clears it",
    )

    warm_min: int = Field(
        default=0,
        ge=0,
        le=WARM_MIN_LIMIT,
        description="idle warm sandboxes beat keeps ready for the pool (docs/warm-pools.md); "
        "0: none, every item's sandbox is made when it is routed",
    )
    warm_idle_ttl_s: int = Field(
        default=600,
        ge=10,
        le=7 * 86_400,
        description="seconds a warm sandbox may wait unbound before it is ended (and replaced)",
    )
    routed_ttl_s: int | None = Field(
        default=None,
        ge=0,
        le=30 * 86_400,
        description="seconds an item may stay routed to this pool's queue while no worker "
        "consumes it before it fails as no_worker; 0: it waits for ever; null: the "
        "deployment's CORRAL_ROUTED_TTL_S (docs/operations.md)",
    )
    warm_schedule: list[WarmWindow] | None = Field(
        default=None,
        max_length=50,
        description="windows of the week (UTC) with a warm_min of their own, e.g. "
        '[{"days": ["mon", "tue"], "start": "08:00", "end": "18:00", "warm_min": 5}]; the '
        "first that holds the time wins, outside them warm_min holds",
    )
    capacity: str | None = Field(
        default=None,
        pattern=IDENTIFIER,
        description="the shared capacity (by name) the pool draws on, divided among orgs by "
        "weight (docs/operations.md#shared-capacity-and-weights); its share is the re-drive's "
        "to set; null: none (an update's null takes the pool off its capacity)",
    )

    @field_validator("runtime_provides")
    @classmethod
    def _valid_substrate(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        if value is not None:
            try:
                parse_substrate_override(value)
            except InvalidCapabilityOverrideError as exc:
                # Its message may name what the client sent: say where and what instead.
                cause = exc.__cause__
                problems = (
                    describe_field_errors(field_errors(cause, Substrate))
                    if isinstance(cause, ValidationError)
                    else "expected an object with runtimeKinds and requirementKinds lists"
                )
                raise ValueError(f"invalid runtime_provides override: {problems}") from exc
        return value

    @field_validator("capabilities")
    @classmethod
    def _valid_matrix(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        if value is not None:
            known = set(ProviderCapabilities.model_fields) - {"substrate"}
            if set(value) - known:
                raise ValueError(
                    f"unknown capability field(s); known: {', '.join(sorted(known))} "
                    "(runtime_provides holds the substrate)"
                )
            fixed = sorted(ENFORCEMENT_FIELDS & set(value))
            if fixed:
                raise ValueError(
                    f"{', '.join(fixed)} cannot be overridden: they say what the provider's "
                    "code enforces (see `corral providers list`), not a pool setting"
                )
        return value


class PoolCreate(PoolSettings):
    org_id: str = Field(pattern=IDENTIFIER)
    name: str = Field(pattern=IDENTIFIER)
    provider_id: str = Field(pattern=IDENTIFIER)
    max_concurrent_ceiling: int | None = Field(
        default=None,
        gt=0,
        le=INT32_MAX,
        description="the most max_concurrent an org key may set; default: max_concurrent",
    )


class PoolUpdate(PoolSettings):
    """The fields to change; those not given keep their value. ``active: false`` disables
    the pool: routing stops sending it work, its items in flight run to their end."""

    name: str | None = Field(default=None, pattern=IDENTIFIER)
    max_concurrent_ceiling: int | None = Field(
        default=None,
        gt=0,
        le=INT32_MAX,
        description="the most max_concurrent an org key may set",
    )

    @classmethod
    def given(cls, cleared: Iterable[str] = (), **fields: Any) -> PoolUpdate:
        """An update of the fields whose value is not None (CLI options left out), and of
        those ``cleared``: set back to null (the default they stand for)."""
        given = {k: v for k, v in fields.items() if v is not None}
        return cls.model_validate(given | dict.fromkeys(cleared))


# Who decides each pool field (docs/operations.md: what an org may change). An org admin key
# may change the org's fields of its own pools, max_concurrent up to the pool's ceiling; the
# rest (the provider, pricing, sandbox_config and options, capability overrides, the lease
# policy, warm sandboxes, the ceiling, the shared capacity it draws on) only the deployment
# admin. Creating and deleting a pool are the deployment's too. So is routed_ttl_s: how long
# work may wait for a provider worker is about the workers the deployment runs (it alone
# knows whether one is coming), and an org that set 0 would keep its items' slots and their
# provision tasks re-sent on the deployment's broker for ever.
ORG_FIELDS = frozenset({"name", "active", "priority", "max_concurrent"})
DEPLOYMENT = "deployment"
ORG = "org"


def field_owners() -> dict[str, str]:
    """Each pool field a request may set, and who may set it: ``org`` or ``deployment``."""
    fields = set(PoolCreate.model_fields) | set(PoolUpdate.model_fields)
    return {name: ORG if name in ORG_FIELDS else DEPLOYMENT for name in sorted(fields)}


class FieldOwnedError(AdminError):
    """An org key tried to change what only the deployment decides."""

    code = "field_owned_by_deployment"


def check_org_update(update: PoolUpdate, ceiling: int) -> None:
    """What an org key may change of its own pool (``ceiling``: the pool's).

    Raises:
        FieldOwnedError: naming the first field it may not change.
    """
    owned = sorted(update.model_fields_set - ORG_FIELDS)
    if owned:
        raise FieldOwnedError(
            f"{owned[0]}: only the deployment admin may change it (an org key may change "
            f"{', '.join(sorted(ORG_FIELDS))}; `corral pools fields` lists whose each is)"
        )
    if update.max_concurrent is not None and update.max_concurrent > ceiling:
        raise FieldOwnedError(
            f"max_concurrent: at most {ceiling} for this pool (its ceiling, which the "
            "deployment admin sets)"
        )


class PoolInUseError(AdminError):
    """The pool has work items in flight."""

    code = "pool_in_use"


class PoolNotFoundError(AdminError, LookupError):
    """No such pool."""

    code = "pool_not_found"


class CapacityPlacementError(AdminError):
    """The pool cannot draw on that shared capacity."""

    code = "invalid_capacity_placement"

    def __init__(self, message: str, *, field: str = "capacity") -> None:
        super().__init__(message)
        self.field = field  # the request field it is about


class UnknownCapacityError(CapacityPlacementError):
    """No shared capacity of that name."""

    code = "unknown_capacity"


class CapacityTakenError(CapacityPlacementError):
    """The org already has a pool on that shared capacity."""

    code = "capacity_already_linked"


class WarmOnCapacityError(CapacityPlacementError):
    """A pool on a shared capacity keeps no warm sandboxes."""

    code = "warm_on_capacity"


def create_profile(db: Database, request: ProfileCreate) -> dict[str, Any]:
    """Create the profile, or update the one of that name."""
    try:
        return _upsert_profile(db, request)
    except IntegrityError:  # created concurrently: update it instead
        return _upsert_profile(db, request)


def _upsert_profile(db: Database, request: ProfileCreate) -> dict[str, Any]:
    with db.session() as session:
        profile = session.get(ModelProfile, request.name)
        if profile is None:
            profile = ModelProfile(name=request.name)
            session.add(profile)
        profile.model = request.model
        profile.auth_mode = request.auth_mode.value
        session.flush()
        return profile_view(profile)


def list_profiles(db: Database) -> list[dict[str, Any]]:
    with db.session() as session:
        return [profile_view(p) for p in session.scalars(select(ModelProfile).order_by("name"))]


def create_pool(db: Database, request: PoolCreate) -> dict[str, Any]:
    """Create a pool; its capability overrides are checked against the provider's matrix.

    Raises:
        AdminError: the org already has a pool of that name, or the overrides are invalid.
    """
    if not default_registry.is_known(request.provider_id):
        # The id is not echoed: the api's error answers never repeat what a client sent.
        raise AdminError(
            f"unknown provider; known providers: {', '.join(default_registry.known_ids())}"
        )
    _check_sandbox_config(request.provider_id, request.sandbox_config)
    _check_warm(request)
    _check_warm_off_capacity(request, request.model_fields_set)
    pool_id = f"pool-{uuid.uuid4().hex[:16]}"
    _check_capabilities(pool_id, request)
    try:
        with db.session() as session:
            capacity = _capacity_named(session, request.capacity)
            pool = Pool(id=pool_id, **_columns(request, PoolCreate.model_fields))
            pool.max_concurrent_ceiling = max(
                request.max_concurrent_ceiling or 0, request.max_concurrent
            )
            linked = _place(session, pool, capacity)
            session.add(pool)
            session.flush()
            document = pool_document(pool)
    except IntegrityError as exc:
        raise AdminError("the org already has a pool of that name") from exc
    if linked:
        redrive_soon()
    return document


def _check_capabilities(pool_id: str, request: PoolCreate) -> None:
    """Raises: AdminError: the capability overrides do not make a valid matrix."""
    try:
        PoolView.build(
            id=pool_id,
            name=request.name,
            org_id=request.org_id,
            provider_id=request.provider_id,
            priority=request.priority,
            max_concurrent=request.max_concurrent,
            runtime_provides=request.runtime_provides,
            capabilities=request.capabilities,
        )
    except ValidationError as exc:
        problems = describe_field_errors(field_errors(exc, ProviderCapabilities))
        raise AdminError(f"invalid capabilities: {problems}") from exc
    except ValueError as exc:
        raise AdminError("invalid capabilities") from exc


def _columns(settings: PoolSettings, names: Iterable[str]) -> dict[str, Any]:
    """The pool columns of ``names``, as stored: a lease policy as the fields it sets (none:
    null). The capacity is no column of its own: :func:`_place` links the pool to it."""
    columns = settings.model_dump(include=set(names) - {"lease", "capacity"})
    if "lease" in names:
        columns["lease"] = (settings.lease.given() or None) if settings.lease else None
    return columns


def find_pool(db: Database, org_id: str | None, name_or_id: str) -> dict[str, Any]:
    """The pool (not deleted) with that id, or of that name in ``org_id``.

    Raises:
        PoolNotFoundError: none, or a name without an org.
    """
    with db.session() as session:
        pool = session.get(Pool, name_or_id)
        if pool is None and org_id is not None:
            pool = session.scalars(
                select(Pool).where(Pool.org_id == org_id, Pool.name == name_or_id)
            ).one_or_none()
        if pool is None or pool.deleted_at is not None:
            hint = "" if org_id else " (a pool name needs --org)"
            raise PoolNotFoundError(f"no such pool{hint}; `corral pools list` lists them")
        return pool_document(pool)


def update_pool(
    db: Database, pool_id: str, update: PoolUpdate, *, by_deployment: bool
) -> dict[str, Any]:
    """Change the fields ``update`` gives, checked as at creation. ``by_deployment``: the
    deployment admin asks; else an org key, which may change only the org's fields
    (:data:`ORG_FIELDS`). The deployment raising max_concurrent raises the ceiling with it.

    Raises:
        PoolNotFoundError: no such pool (or a deleted one).
        FieldOwnedError: an org key asked for a field of the deployment's.
        AdminError: the changed pool would be invalid, or its name is taken.
    """
    try:
        with db.session() as session:
            document, moved = _update_pool(session, pool_id, update, by_deployment=by_deployment)
    except IntegrityError as exc:
        raise AdminError("the org already has a pool of that name") from exc
    if moved:
        redrive_soon()
    return document


def _update_pool(
    session: Session, pool_id: str, update: PoolUpdate, *, by_deployment: bool
) -> tuple[dict[str, Any], bool]:
    """The changed pool's document, and whether it was put on a capacity or taken off."""
    placed = "capacity" in update.model_fields_set
    # The capacity's row is locked before the pool's, in the re-drive's order (a capacity,
    # then its pools). An org key never gets this far with a capacity (check_org_update).
    capacity = _capacity_named(session, update.capacity) if placed and by_deployment else None
    pool = session.get(Pool, pool_id, with_for_update=True)
    if pool is None or pool.deleted_at is not None:
        raise PoolNotFoundError("no such pool")
    ceiling = pool.max_concurrent_ceiling or pool.max_concurrent
    if not by_deployment:
        check_org_update(update, ceiling)
    kept = {name: getattr(pool, name) for name in set(PoolCreate.model_fields) - {"capacity"}}
    kept["capacity"] = _capacity_name(session, pool.capacity_id)
    current = PoolCreate.model_validate({**kept, **update.model_dump(exclude_unset=True)})
    # The capacity it is on, given again (a form sends every field), is not a change.
    changed = update.model_fields_set - (
        {"capacity"} if current.capacity == kept["capacity"] else set()
    )
    if "sandbox_config" in update.model_fields_set:
        _check_sandbox_config(pool.provider_id, current.sandbox_config)
    _check_capabilities(pool.id, current)
    _check_warm(current)
    _check_warm_off_capacity(current, changed)
    for name, value in _columns(current, update.model_fields_set).items():
        setattr(pool, name, value)
    if by_deployment and "max_concurrent_ceiling" not in update.model_fields_set:
        pool.max_concurrent_ceiling = max(ceiling, current.max_concurrent)
    moved = _place(session, pool, capacity) if placed else False
    session.flush()
    return pool_document(pool), moved


def _capacity_named(session: Session, name: str | None) -> Capacity | None:
    """The capacity of that name, its row locked (None: none asked).

    Raises:
        UnknownCapacityError: no capacity has that name.
    """
    if name is None:
        return None
    capacity = session.scalars(
        select(Capacity).where(Capacity.name == name).with_for_update()
    ).one_or_none()
    if capacity is None:
        raise UnknownCapacityError(
            "capacity: no shared capacity of that name; `corral capacities list` lists them"
        )
    return capacity


def _capacity_name(session: Session, capacity_id: str | None) -> str | None:
    capacity = session.get(Capacity, capacity_id) if capacity_id is not None else None
    return capacity.name if capacity is not None else None


def _place(session: Session, pool: Pool, capacity: Capacity | None) -> bool:
    """Put ``pool`` on ``capacity`` (None: on none); whether that moved it, and the
    re-drive is to divide or hand on now. A pool linked starts at a share of 0 (it takes no
    slot of the capacity) until the re-drive divides the capacity again; a pool taken off
    stays closed to fresh arrivals until the re-drive has served its waiting items
    (:func:`corral.shared.store.shares.take_off`).

    Raises:
        CapacityTakenError: another pool of its org draws on the capacity.
    """
    if capacity is None:
        if pool.capacity_id is None:
            return False
        shares.take_off(session, pool)
        return True
    if capacity.id == pool.capacity_id:
        return False
    other = session.scalar(
        select(Pool.name)
        .where(
            Pool.capacity_id == capacity.id,
            Pool.org_id == pool.org_id,
            Pool.id != pool.id,
            Pool.deleted_at.is_(None),
        )
        .limit(1)
    )
    if other is not None:
        raise CapacityTakenError(
            f"capacity: the org's pool {other} draws on that capacity already, and an org "
            "draws on a capacity through one pool: take that pool off it first (capacity "
            "null, `corral pools update --no-capacity`) or change that pool instead"
        )
    shares.put_on(pool, capacity)
    return True


def _check_warm_off_capacity(request: PoolCreate, given: Iterable[str]) -> None:
    """A pool on a shared capacity keeps no warm sandboxes: they hold no slot, so they would
    not be counted against the capacity.

    Raises:
        WarmOnCapacityError: naming the field the request gave (the capacity, or the warm
            setting that conflicts with it).
    """
    warm = request.warm_min > 0 or bool(request.warm_schedule)
    if request.capacity is None or not warm:
        return
    if "capacity" in given:
        raise WarmOnCapacityError(
            "capacity: a pool with warm sandboxes (warm_min or a warm_schedule) cannot draw "
            "on a shared capacity, whose division does not count them: set warm_min to 0 "
            "and warm_schedule to null first"
        )
    field = "warm_min" if request.warm_min > 0 else "warm_schedule"
    raise WarmOnCapacityError(
        f"{field}: a pool on a shared capacity keeps no warm sandboxes (its division does "
        "not count them): take the pool off its capacity first (capacity null, `corral "
        "pools update --no-capacity`)",
        field=field,
    )


def redrive_soon() -> None:
    """Ask for a re-drive now, so that a changed division takes effect at once; best
    effort: beat's next re-drive (CORRAL_REDRIVE_INTERVAL_S) divides it anyway."""
    try:
        request_redrive()
    except Exception:  # the broker out of reach: the scheduled re-drive does it
        log.warning("could not ask for a re-drive; the next scheduled one divides the shares")


def delete_pool(db: Database, pool_id: str) -> None:
    """Delete a pool that has no work item in flight. Its row stays, marked deleted and
    inactive (its items, sandboxes and cost events refer to it), its name free again.

    Raises:
        PoolNotFoundError: no such pool.
        PoolInUseError: items of the pool have not finished; disable it and wait.
    """
    with db.session() as session:
        pool = session.get(Pool, pool_id, with_for_update=True)
        if pool is None or pool.deleted_at is not None:
            raise PoolNotFoundError("no such pool")
        in_flight = session.scalar(
            select(func.count())
            .select_from(WorkItem)
            .where(
                WorkItem.pool_id == pool.id,
                WorkItem.state.not_in([state.value for state in FINAL_ITEM_STATES]),
            )
        )
        if in_flight:
            raise PoolInUseError(
                f"the pool has {in_flight} work item(s) in flight: disable it (no new work "
                "is routed to it), wait for them to end or cancel them, then delete it"
            )
        pool.deleted_at = utcnow()
        pool.active = False
        if pool.capacity_id is not None:
            shares.take_off(session, pool)  # a deleted pool draws on nothing
        pool.name = f"{pool.name[:40]}~deleted~{pool.id[-12:]}"


def _check_warm(request: PoolCreate) -> None:
    """Raises: AdminError: warm_min > 0 where it cannot be kept: a provider without a runner
    (a code interpreter runs each item's code itself), or more than the pool's slots."""
    most = max([request.warm_min, *(w.warm_min for w in request.warm_schedule or [])])
    if most == 0:
        return
    matrix = default_registry.capabilities_of(request.provider_id)
    if "shell" not in matrix.work_kinds:
        raise AdminError(
            "warm_min: this provider runs code itself, with no runner to keep waiting; "
            "warm pools need a provider whose sandboxes run corral's runner (local, docker, "
            "kubernetes, ...): set warm_min to 0"
        )
    if most > request.max_concurrent:
        raise AdminError(
            "warm_min: more warm sandboxes than the pool's max_concurrent could ever use; "
            "set warm_min (and each warm_schedule window's) at most max_concurrent"
        )


def _check_sandbox_config(provider_id: str, sandbox_config: dict[str, Any]) -> None:
    """A pool's sandbox_config is its provider's options for every sandbox of the pool:
    refused now, naming the bad keys, rather than at each provision.

    Raises:
        AdminError: invalid for the provider's options model, or the provider cannot be
            loaded here to check it.
    """
    try:
        model = default_registry.descriptor(provider_id).options_model
    except ProviderError as exc:
        raise AdminError(exc.message) from exc
    try:
        model.model_validate(sandbox_config)
    except ValidationError as exc:
        problems = describe_field_errors(field_errors(exc, model))
        allowed = ", ".join(sorted(model.model_fields)) or "none"
        raise AdminError(
            f"invalid sandbox_config for this provider: {problems} (its keys: {allowed}; "
            "`corral providers schema NAME` describes them)"
        ) from exc


def list_pools(db: Database, org_id: str | None = None) -> list[dict[str, Any]]:
    with db.session() as session:
        query = (
            select(Pool)
            .where(Pool.deleted_at.is_(None))
            .order_by(Pool.org_id, Pool.priority.desc(), Pool.name)
        )
        if org_id is not None:
            query = query.where(Pool.org_id == org_id)
        return [pool_document(p) for p in session.scalars(query)]


def profile_view(profile: ModelProfile) -> dict[str, Any]:
    return {"name": profile.name, "model": profile.model, "auth_mode": profile.auth_mode}


def pool_document(pool: Pool) -> dict[str, Any]:
    """The pool as the admin api answers it (read in its session)."""
    session = object_session(pool)
    assert session is not None  # every caller reads the pool in a session still open
    return {
        "id": pool.id,
        "org_id": pool.org_id,
        "name": pool.name,
        "provider_id": pool.provider_id,
        "priority": pool.priority,
        "active": pool.active,
        "max_concurrent": pool.max_concurrent,
        "max_concurrent_ceiling": pool.max_concurrent_ceiling or pool.max_concurrent,
        "runtime_provides": pool.runtime_provides,
        "capabilities": pool.capabilities,
        "sandbox_config": pool.sandbox_config,
        "billing_model": pool.billing_model,
        "rate_micros": pool.rate_micros,
        "lease": pool.lease,
        "warm_min": pool.warm_min,
        "warm_idle_ttl_s": pool.warm_idle_ttl_s,
        "warm_schedule": pool.warm_schedule,
        "routed_ttl_s": pool.routed_ttl_s,
        "slots_in_use": pool.slots_in_use,
        "capacity_id": pool.capacity_id,
        "capacity": _capacity_name(session, pool.capacity_id),
        "share_limit": pool.share_limit,
        "breaker": {
            "state": pool.breaker_state,
            "failures": pool.breaker_failures,
            "opened_at": pool.breaker_opened_at.isoformat() if pool.breaker_opened_at else None,
        },
    }
