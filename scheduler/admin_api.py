"""The admin api's routes for pools, providers, provider configuration and credentials
(the profile and pool creation routes are in :mod:`corral.scheduler.api`). Every route
needs the admin token: the router is included with that dependency.

Errors: 404 for an unknown pool or provider, 409 for a pool that still has work in flight,
422 for an invalid change (naming fields, never echoing values).
"""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, HTTPException, Path, Query
from pydantic import BaseModel, ConfigDict, Field, SecretStr

from corral.scheduler import admin, budget_admin, provider_admin
from corral.scheduler.answers import (
    BudgetList,
    BudgetRow,
    CredentialList,
    CredentialStored,
    Deleted,
    PoolRow,
    ProviderCheck,
    ProviderConfigView,
    ProviderList,
    ProviderSchema,
)
from corral.scheduler.bodies import StrictJSONRoute
from corral.scheduler.problems import InvalidRequest
from corral.shared import runtime
from corral.shared.errors import ConfigurationError
from corral.shared.text import IDENTIFIER

router = APIRouter(route_class=StrictJSONRoute)

PoolId = Annotated[str, Path(pattern=IDENTIFIER, description="a pool id (pool-...)")]
ProviderId = Annotated[str, Path(pattern=IDENTIFIER, description="a provider id, e.g. local")]
OrgId = Annotated[str, Path(pattern=IDENTIFIER, description="an org id")]


class ProviderConfigBody(BaseModel):
    model_config = ConfigDict(extra="forbid")

    config: dict[str, Any] = Field(description="checked against the provider's config schema")


class CredentialBody(BaseModel):
    model_config = ConfigDict(extra="forbid")

    secret: SecretStr = Field(min_length=1, max_length=65_536)


def _admin_error(exc: admin.AdminError, field: str = "(body)") -> HTTPException:
    if isinstance(exc, LookupError):
        return HTTPException(status_code=404, detail=exc.message)
    if isinstance(exc, admin.PoolInUseError):
        return HTTPException(status_code=409, detail=exc.message)
    return InvalidRequest(field, exc.message)


# -- pools ---------------------------------------------------------------------------------


@router.patch("/v1/admin/pools/{pool_id}")
def update_pool(pool_id: PoolId, body: admin.PoolUpdate) -> PoolRow:
    """Change a pool; `{"active": false}` disables it (routing stops sending it work, its
    items in flight run to their end), `{"active": true}` enables it again."""
    try:
        return PoolRow.model_validate(admin.update_pool(runtime.current().db, pool_id, body))
    except admin.AdminError as exc:
        raise _admin_error(exc) from exc


@router.delete("/v1/admin/pools/{pool_id}")
def delete_pool(pool_id: PoolId) -> Deleted:
    """Delete a pool; 409 while it has work items in flight (disable it first)."""
    try:
        admin.delete_pool(runtime.current().db, pool_id)
    except admin.AdminError as exc:
        raise _admin_error(exc) from exc
    return Deleted(id=pool_id, deleted=True)


# -- budgets -------------------------------------------------------------------------------


@router.put("/v1/admin/budgets")
def set_budget(body: budget_admin.BudgetSet) -> BudgetRow:
    """Set the org's (or, with `pool`, one pool's) spend cap for a period: `day`, `week` or
    `month` (UTC); it replaces the one of the same period. Routing refuses new work once the
    period's spend reaches it (`budget_exhausted`)."""
    try:
        return BudgetRow.model_validate(budget_admin.set_budget(runtime.current().db, body))
    except admin.AdminError as exc:
        raise _admin_error(exc, "pool") from exc


@router.get("/v1/admin/budgets")
def list_budgets(org: Annotated[str | None, Query(pattern=IDENTIFIER)] = None) -> BudgetList:
    """Every budget (of `org`), with the current period's spend against its cap."""
    rows = budget_admin.list_budgets(runtime.current().db, org)
    return BudgetList.model_validate({"budgets": rows})


@router.delete("/v1/admin/budgets/{budget_id}")
def delete_budget(budget_id: Annotated[str, Path(pattern=IDENTIFIER)]) -> Deleted:
    try:
        budget_admin.delete_budget(runtime.current().db, budget_id)
    except admin.AdminError as exc:
        raise _admin_error(exc) from exc
    return Deleted(id=budget_id, deleted=True)


# -- providers -----------------------------------------------------------------------------


@router.get("/v1/admin/providers")
def list_providers() -> ProviderList:
    """Every provider this deployment knows: capabilities, and whether its SDK is installed."""
    return ProviderList.model_validate({"providers": provider_admin.list_providers()})


@router.get("/v1/admin/providers/{provider_id}/schema")
def provider_schema(provider_id: ProviderId) -> ProviderSchema:
    """The JSON schemas of the provider's configuration and of a pool's sandbox_config."""
    try:
        return ProviderSchema.model_validate(provider_admin.provider_schema(provider_id))
    except admin.AdminError as exc:
        raise _admin_error(exc) from exc


@router.get("/v1/admin/providers/{provider_id}/config")
def get_provider_config(provider_id: ProviderId) -> ProviderConfigView:
    """The configuration this deployment's workers use, and where it comes from."""
    try:
        document = provider_admin.config_document(runtime.current(), provider_id)
    except admin.AdminError as exc:
        raise _admin_error(exc) from exc
    return ProviderConfigView.model_validate(document)


@router.put("/v1/admin/providers/{provider_id}/config")
def put_provider_config(provider_id: ProviderId, body: ProviderConfigBody) -> ProviderConfigView:
    """Store the provider's configuration (it replaces CORRAL_PROVIDER_CONFIG's entry);
    workers use it from their next provision after CORRAL_PROVIDER_CONFIG_REFRESH_S."""
    try:
        document = provider_admin.set_config(runtime.current(), provider_id, body.config)
    except admin.AdminError as exc:
        raise _admin_error(exc, "config") from exc
    return ProviderConfigView.model_validate(document)


@router.delete("/v1/admin/providers/{provider_id}/config")
def delete_provider_config(provider_id: ProviderId) -> ProviderConfigView:
    """Forget the stored configuration: CORRAL_PROVIDER_CONFIG's entry (or the defaults)
    applies again."""
    try:
        document = provider_admin.remove_config(runtime.current(), provider_id)
    except admin.AdminError as exc:
        raise _admin_error(exc) from exc
    return ProviderConfigView.model_validate(document)


@router.post("/v1/admin/providers/{provider_id}/check")
def check_provider(
    provider_id: ProviderId,
    org: Annotated[str | None, Query(pattern=IDENTIFIER, description="with its credential")] = None,
) -> ProviderCheck:
    """The provider's health as a worker of this deployment would see it: one authenticated,
    read-only call; a configuration the provider refuses is unhealthy, with the reason."""
    try:
        health = provider_admin.check_provider(runtime.current(), provider_id, org)
    except admin.AdminError as exc:
        raise _admin_error(exc) from exc
    return ProviderCheck(
        provider=provider_id, org=org, healthy=health.healthy, message=health.message
    )


# -- credentials ---------------------------------------------------------------------------


@router.get("/v1/admin/orgs/{org}/credentials")
def list_credentials(org: OrgId) -> CredentialList:
    """The providers the org has a stored credential for (names, never secrets)."""
    rows = provider_admin.list_credentials(runtime.current(), org)
    return CredentialList.model_validate({"org": org, "credentials": rows})


@router.put("/v1/admin/orgs/{org}/credentials/{provider_id}")
def put_credential(org: OrgId, provider_id: ProviderId, body: CredentialBody) -> CredentialStored:
    """Store the org's credential for the provider, encrypted with CORRAL_SECRET_KEY."""
    try:
        provider_admin.set_credential(
            runtime.current(), org, provider_id, body.secret.get_secret_value()
        )
    except admin.AdminError as exc:
        raise _admin_error(exc) from exc
    except ConfigurationError as exc:
        raise HTTPException(status_code=409, detail=exc.message) from exc
    return CredentialStored(org=org, provider=provider_id)


@router.delete("/v1/admin/orgs/{org}/credentials/{provider_id}")
def delete_credential(org: OrgId, provider_id: ProviderId) -> Deleted:
    """Forget the org's credential for the provider; 404 when it has none."""
    if not provider_admin.delete_credential(runtime.current(), org, provider_id):
        raise HTTPException(status_code=404, detail="no such credential")
    return Deleted(id=f"{org}/{provider_id}", deleted=True)


@router.post("/v1/admin/orgs/{org}/credentials/{provider_id}/test")
def check_credential(org: OrgId, provider_id: ProviderId) -> ProviderCheck:
    """One authenticated, read-only call to the provider with the org's credential."""
    return check_provider(provider_id, org)
