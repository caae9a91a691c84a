"""The admin api's routes for pools, providers, provider configuration and credentials
(the profile and pool creation routes are in :mod:`corral.scheduler.api.app`). Every route
needs the admin scope: the deployment admin token, or an org key with ``admin``, which acts
on its own org's pools, budgets, credentials, keys and limits only (another org's answer
404). The deployment's provider configuration is the deployment admin's alone (403).

Errors: 404 for an unknown pool or provider (another org's answers the same), 409 for a pool
that still has work in flight, 422 for an invalid change (naming fields). No error answer
repeats an id, name, key or value the client sent.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from fastapi import APIRouter, Depends, HTTPException, Path, Query
from pydantic import BaseModel, ConfigDict, Field, SecretStr
from sqlalchemy import select

from corral.scheduler.admin import budgets as budget_admin
from corral.scheduler.admin import pools as admin
from corral.scheduler.admin import providers as provider_admin
from corral.scheduler.admin.responses import (
    ApiKeyCreated,
    ApiKeyList,
    BudgetList,
    BudgetRow,
    CredentialList,
    CredentialStored,
    Deleted,
    OrgLimitView,
    OrgPolicyView,
    PoolFieldOwners,
    PoolRow,
    ProviderCheck,
    ProviderConfigView,
    ProviderList,
    ProviderSchema,
)
from corral.scheduler.api.auth import (
    DEPLOYMENT_ADMIN,
    Principal,
    Scope,
    check_org,
    deployment_admin,
    key_cache,
    needs,
)
from corral.scheduler.api.bodies import StrictJSONRoute
from corral.scheduler.api.http_errors import CONFLICT_ANSWER, Conflict, InvalidRequest
from corral.scheduler.api.process_runtime import ApiRuntime
from corral.shared.errors import ConfigurationError
from corral.shared.store import api_keys, org_limits, org_policies
from corral.shared.store.db import Database
from corral.shared.store.models import ApiKey, Budget, Pool
from corral.shared.store.org_limits import MAX_CONCURRENT_LIMIT
from corral.shared.store.org_policies import MAX_PATTERNS
from corral.shared.text import IDENTIFIER, Printable

router = APIRouter(route_class=StrictJSONRoute)
Administrator = Annotated[Principal, Depends(needs(Scope.ADMIN))]
DeploymentAdmin = Annotated[Principal, Depends(deployment_admin)]

PoolId = Annotated[str, Path(pattern=IDENTIFIER, description="a pool id (pool-...)")]
ProviderId = Annotated[str, Path(pattern=IDENTIFIER, description="a provider id, e.g. local")]
OrgId = Annotated[str, Path(pattern=IDENTIFIER, description="an org id")]


class ProviderConfigBody(BaseModel):
    model_config = ConfigDict(extra="forbid")

    config: dict[str, Any] = Field(description="checked against the provider's config schema")


class CredentialBody(BaseModel):
    model_config = ConfigDict(extra="forbid")

    secret: SecretStr = Field(min_length=1, max_length=65_536)


def _check_pool(db: Database, pool_id: str, caller: Principal) -> None:
    with db.session() as session:
        org_id = session.scalar(select(Pool.org_id).where(Pool.id == pool_id))
    if org_id is not None and not caller.sees(org_id):
        # As for an id that does not exist (admin.update_pool's): nothing tells them apart,
        # and the client's id is not repeated.
        raise HTTPException(status_code=404, detail="no such pool")


def _check_budget(db: Database, budget_id: str, caller: Principal) -> None:
    with db.session() as session:
        org_id = session.scalar(select(Budget.org_id).where(Budget.id == budget_id))
    if org_id is not None and not caller.sees(org_id):
        raise HTTPException(status_code=404, detail=budget_admin.NO_SUCH_BUDGET)


POOLS_ARE_THE_DEPLOYMENTS = (
    "pools are created and deleted by the deployment admin; an org key may change its "
    "pools' name, active, priority and max_concurrent (up to the pool's ceiling)"
)


def placement_error(exc: admin.CapacityPlacementError) -> HTTPException:
    """A pool's capacity refused: 409 when another pool of the org is on it, else 422,
    naming the field."""
    if isinstance(exc, admin.CapacityTakenError):
        return Conflict(exc.code, exc.field, exc.message)
    return InvalidRequest(exc.field, exc.message)


def _admin_error(exc: admin.AdminError, field: str = "(body)") -> HTTPException:
    if isinstance(exc, admin.CapacityPlacementError):
        return placement_error(exc)
    if isinstance(exc, admin.FieldOwnedError):
        return HTTPException(status_code=403, detail=exc.message)
    if isinstance(exc, LookupError):
        return HTTPException(status_code=404, detail=exc.message)
    if isinstance(exc, admin.PoolInUseError):
        return HTTPException(status_code=409, detail=exc.message)
    return InvalidRequest(field, exc.message)


# -- pools ---------------------------------------------------------------------------------


@router.patch("/v1/admin/pools/{pool_id}", responses=CONFLICT_ANSWER)
def update_pool(
    pool_id: PoolId, body: admin.PoolUpdate, caller: Administrator, rt: ApiRuntime
) -> PoolRow:
    """Change a pool; `{"active": false}` disables it (routing stops sending it work, its
    items in flight run to their end), `{"active": true}` enables it again."""
    _check_pool(rt.db, pool_id, caller)
    deployment = caller.is_deployment_admin
    try:
        return PoolRow.model_validate(
            admin.update_pool(rt.db, pool_id, body, by_deployment=deployment)
        )
    except admin.AdminError as exc:
        raise _admin_error(exc) from exc


@router.delete("/v1/admin/pools/{pool_id}")
def delete_pool(pool_id: PoolId, caller: Administrator, rt: ApiRuntime) -> Deleted:
    """Delete a pool; 409 while it has work items in flight (disable it first). The
    deployment's to do: an org key may disable its pool, not delete it."""
    _check_pool(rt.db, pool_id, caller)
    if not caller.is_deployment_admin:
        with rt.db.session() as session:
            pool = session.get(Pool, pool_id)
        if pool is None or pool.deleted_at is not None:  # as _check_pool's: no such pool
            raise HTTPException(status_code=404, detail="no such pool")
        raise HTTPException(status_code=403, detail=POOLS_ARE_THE_DEPLOYMENTS)
    try:
        admin.delete_pool(rt.db, pool_id)
    except admin.AdminError as exc:
        raise _admin_error(exc) from exc
    return Deleted(id=pool_id, deleted=True)


# -- budgets -------------------------------------------------------------------------------


@router.put("/v1/admin/budgets")
def set_budget(body: budget_admin.BudgetSet, caller: Administrator, rt: ApiRuntime) -> BudgetRow:
    """Set the org's (or, with `pool`, one pool's) spend cap for a period: `day`, `week` or
    `month` (UTC); it replaces the one of the same period and owner (`set_by`). Routing
    refuses new work once the period's spend reaches it (`budget_exhausted`); with
    `on_cap: stop` the reaper also ends the running sandboxes. An org key sets its org's own
    budget, which applies beside the deployment's (the strictest wins); 403 for
    `set_by: deployment`."""
    check_org(body.org_id, caller)
    try:
        stored = budget_admin.set_budget(rt.db, body, by_deployment=caller.is_deployment_admin)
    except budget_admin.BudgetOwnedError as exc:
        raise HTTPException(status_code=403, detail=exc.message) from exc
    except admin.AdminError as exc:
        raise _admin_error(exc, "pool") from exc
    return BudgetRow.model_validate(stored)


@router.get("/v1/admin/budgets")
def list_budgets(
    caller: Administrator,
    rt: ApiRuntime,
    org: Annotated[str | None, Query(pattern=IDENTIFIER)] = None,
) -> BudgetList:
    """Every budget (of `org`), with the current period's spend against its cap."""
    rows = budget_admin.list_budgets(rt.db, caller.org_filter(org))
    return BudgetList.model_validate({"budgets": rows})


@router.delete("/v1/admin/budgets/{budget_id}")
def delete_budget(
    budget_id: Annotated[str, Path(pattern=IDENTIFIER)], caller: Administrator, rt: ApiRuntime
) -> Deleted:
    """Delete a budget. An org key deletes only its org's own (`set_by: org`): 403 for the
    deployment's."""
    _check_budget(rt.db, budget_id, caller)
    try:
        budget_admin.delete_budget(rt.db, budget_id, by_deployment=caller.is_deployment_admin)
    except budget_admin.BudgetOwnedError as exc:
        raise HTTPException(status_code=403, detail=exc.message) from exc
    except admin.AdminError as exc:
        raise _admin_error(exc) from exc
    return Deleted(id=budget_id, deleted=True)


# -- providers -----------------------------------------------------------------------------


@router.get("/v1/admin/providers")
def list_providers(_: Administrator) -> ProviderList:
    """Every provider this deployment knows: capabilities, and whether its SDK is installed."""
    return ProviderList.model_validate({"providers": provider_admin.list_providers()})


@router.get("/v1/admin/providers/{provider_id}/schema")
def provider_schema(provider_id: ProviderId, _: Administrator) -> ProviderSchema:
    """The JSON schemas of the provider's configuration and of a pool's sandbox_config."""
    try:
        return ProviderSchema.model_validate(provider_admin.provider_schema(provider_id))
    except admin.AdminError as exc:
        raise _admin_error(exc) from exc


@router.get("/v1/admin/providers/{provider_id}/config")
def get_provider_config(
    provider_id: ProviderId, _: DeploymentAdmin, rt: ApiRuntime
) -> ProviderConfigView:
    """The configuration this deployment's workers use, and where it comes from."""
    try:
        document = provider_admin.config_document(rt, provider_id)
    except admin.AdminError as exc:
        raise _admin_error(exc) from exc
    return ProviderConfigView.model_validate(document)


@router.put("/v1/admin/providers/{provider_id}/config")
def put_provider_config(
    provider_id: ProviderId, body: ProviderConfigBody, _: DeploymentAdmin, rt: ApiRuntime
) -> ProviderConfigView:
    """Store the provider's configuration (it replaces CORRAL_PROVIDER_CONFIG's entry);
    workers use it from their next provision after CORRAL_PROVIDER_CONFIG_REFRESH_S."""
    try:
        document = provider_admin.set_config(rt, provider_id, body.config)
    except admin.AdminError as exc:
        raise _admin_error(exc, "config") from exc
    return ProviderConfigView.model_validate(document)


@router.delete("/v1/admin/providers/{provider_id}/config")
def delete_provider_config(
    provider_id: ProviderId, _: DeploymentAdmin, rt: ApiRuntime
) -> ProviderConfigView:
    """Forget the stored configuration: CORRAL_PROVIDER_CONFIG's entry (or the defaults)
    applies again."""
    try:
        document = provider_admin.remove_config(rt, provider_id)
    except admin.AdminError as exc:
        raise _admin_error(exc) from exc
    return ProviderConfigView.model_validate(document)


@router.post("/v1/admin/providers/{provider_id}/check")
def check_provider(
    provider_id: ProviderId,
    caller: Administrator,
    rt: ApiRuntime,
    org: Annotated[str | None, Query(pattern=IDENTIFIER, description="with its credential")] = None,
) -> ProviderCheck:
    """The provider's health as a worker of this deployment would see it: one authenticated,
    read-only call; a configuration the provider refuses is unhealthy, with the reason.
    An org key checks with its own org's credential."""
    org = caller.org_filter(org)
    try:
        health = provider_admin.check_provider(rt, provider_id, org)
    except admin.AdminError as exc:
        raise _admin_error(exc) from exc
    return ProviderCheck(
        provider=provider_id, org=org, healthy=health.healthy, message=health.message
    )


# -- credentials ---------------------------------------------------------------------------


@router.get("/v1/admin/orgs/{org}/credentials")
def list_credentials(org: OrgId, caller: Administrator, rt: ApiRuntime) -> CredentialList:
    """The providers the org has a stored credential for (names, never secrets)."""
    check_org(org, caller)
    rows = provider_admin.list_credentials(rt, org)
    return CredentialList.model_validate({"org": org, "credentials": rows})


@router.put("/v1/admin/orgs/{org}/credentials/{provider_id}")
def put_credential(
    org: OrgId, provider_id: ProviderId, body: CredentialBody, caller: Administrator, rt: ApiRuntime
) -> CredentialStored:
    """Store the org's credential for the provider, encrypted with CORRAL_SECRET_KEY."""
    check_org(org, caller)
    try:
        provider_admin.set_credential(rt, org, provider_id, body.secret.get_secret_value())
    except admin.AdminError as exc:
        raise _admin_error(exc) from exc
    except ConfigurationError as exc:
        raise HTTPException(status_code=409, detail=exc.message) from exc
    return CredentialStored(org=org, provider=provider_id)


@router.delete("/v1/admin/orgs/{org}/credentials/{provider_id}")
def delete_credential(
    org: OrgId, provider_id: ProviderId, caller: Administrator, rt: ApiRuntime
) -> Deleted:
    """Forget the org's credential for the provider; 404 when it has none."""
    check_org(org, caller)
    if not provider_admin.delete_credential(rt, org, provider_id):
        raise HTTPException(status_code=404, detail="no such credential")
    return Deleted(id=f"{org}/{provider_id}", deleted=True)


@router.post("/v1/admin/orgs/{org}/credentials/{provider_id}/test")
def check_credential(
    org: OrgId, provider_id: ProviderId, caller: Administrator, rt: ApiRuntime
) -> ProviderCheck:
    """One authenticated, read-only call to the provider with the org's credential."""
    check_org(org, caller)
    return check_provider(provider_id, caller, rt, org)


# -- org keys and limits -------------------------------------------------------------------


class KeyBody(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field(min_length=1, max_length=100, pattern=r"^[\w .:@/-]+$")
    scopes: list[Literal["dispatch", "read", "review", "admin"]] = Field(min_length=1, max_length=4)


class LimitBody(BaseModel):
    model_config = ConfigDict(extra="forbid")

    max_concurrent: int | None = Field(
        ge=1, le=MAX_CONCURRENT_LIMIT, description="null removes the limit"
    )


class PolicyBody(BaseModel):
    model_config = ConfigDict(extra="forbid")

    item_images: list[Printable] | None = Field(
        default=None,
        max_length=MAX_PATTERNS,
        description="image patterns (globs on the full reference) the org's items may name; "
        "null: the deployment's default (CORRAL_ITEM_IMAGES)",
    )
    regions: list[Printable] | None = Field(
        default=None,
        max_length=MAX_PATTERNS,
        description="region patterns the org's items may ask for; null: any",
    )


@router.get("/v1/admin/orgs/{org}/policy")
def get_policy(org: OrgId, caller: Administrator, rt: ApiRuntime) -> OrgPolicyView:
    """What the deployment lets the org's work ask for: the images its items may name and
    the regions they may ask for (null: the deployment's default)."""
    check_org(org, caller)
    with rt.db.session() as session:
        stored = org_policies.stored_of(session, [org])
    return OrgPolicyView.model_validate(org_policies.policy_document(org, stored))


@router.put("/v1/admin/orgs/{org}/policy")
def put_policy(org: OrgId, body: PolicyBody, _: DeploymentAdmin, rt: ApiRuntime) -> OrgPolicyView:
    """Set the org's policy (the deployment's alone): routing refuses an item naming an image
    outside it (`image_not_allowed`) or asking for a region outside it (`region_not_allowed`)."""
    try:
        with rt.db.session() as session:
            org_policies.set_policy(
                session, org, item_images=body.item_images, regions=body.regions
            )
    except ValueError as exc:
        raise InvalidRequest("(body)", str(exc)) from exc
    return get_policy(org, DEPLOYMENT_ADMIN, rt)


@router.get("/v1/admin/pools/fields")
def pool_field_owners(_: Administrator) -> PoolFieldOwners:
    """Who may change each pool field: `org` (an org admin key; max_concurrent up to the
    pool's ceiling) or `deployment` (the admin token alone)."""
    return PoolFieldOwners(owners=admin.field_owners())


@router.post("/v1/admin/orgs/{org}/keys", status_code=201)
def create_key(org: OrgId, body: KeyBody, caller: Administrator, rt: ApiRuntime) -> ApiKeyCreated:
    """A new api key for the org; the answer is the only place the key ever appears. An
    org key with the admin scope (which holds every scope) may make keys for its own org."""
    check_org(org, caller)
    with rt.db.session() as session:
        try:
            key_id, token = api_keys.create_key(session, org, body.name, body.scopes)
        except api_keys.ApiKeyError as exc:
            raise HTTPException(status_code=409, detail=str(exc)) from exc
        session.flush()
        document = api_keys.key_document(session.get_one(ApiKey, key_id))
    return ApiKeyCreated.model_validate({**document, "key": token})


@router.get("/v1/admin/orgs/{org}/keys")
def list_keys(org: OrgId, caller: Administrator, rt: ApiRuntime) -> ApiKeyList:
    """The org's keys, revoked ones included; never the keys themselves."""
    check_org(org, caller)
    with rt.db.session() as session:
        rows = api_keys.list_keys(session, org)
    return ApiKeyList.model_validate({"keys": rows})


@router.delete("/v1/admin/orgs/{org}/keys/{key_id}")
def revoke_key(
    org: OrgId,
    key_id: Annotated[str, Path(pattern=IDENTIFIER)],
    caller: Administrator,
    rt: ApiRuntime,
) -> Deleted:
    """Revoke one of the org's keys: this api process refuses it from the next request
    on, every other within `CORRAL_API_KEY_CACHE_TTL_S` (5 s)."""
    check_org(org, caller)
    with rt.db.session() as session:
        if not api_keys.revoke_key(session, org, key_id):
            raise HTTPException(status_code=404, detail="no such live key")
    key_cache(rt).forget(key_id)  # committed: this process refuses it from now on
    return Deleted(id=key_id, deleted=True)


@router.get("/v1/admin/orgs/{org}/limits")
def get_limits(org: OrgId, caller: Administrator, rt: ApiRuntime) -> OrgLimitView:
    """The org's limit on work in flight across its pools, and what it holds now."""
    check_org(org, caller)
    with rt.db.session() as session:
        limit, held = org_limits.org_limit(session, org), org_limits.in_flight(session, org)
    return OrgLimitView(org_id=org, max_concurrent=limit, in_flight=held)


@router.put("/v1/admin/orgs/{org}/limits")
def put_limits(org: OrgId, body: LimitBody, _: DeploymentAdmin, rt: ApiRuntime) -> OrgLimitView:
    """Set (or, with null, remove) the org's limit: routing holds its new work waiting for
    capacity while its pools together hold that many slots. The deployment sets it."""
    with rt.db.session() as session:
        org_limits.set_limit(session, org, body.max_concurrent)
    return get_limits(org, DEPLOYMENT_ADMIN, rt)
