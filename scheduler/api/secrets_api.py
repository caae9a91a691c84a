"""The admin api's routes for named secrets (corral.shared.store.secrets).

An org's secrets: ``/v1/admin/orgs/{org}/secrets``, for the deployment admin token or an org
key with ``admin`` acting on its own org (another org's answer 404, as provider credentials
do). The deployment's secrets, which every org's items may refer to: ``/v1/admin/secrets``,
for the deployment admin token only (403 for an org key). A value is sent in a PUT's body
and never answered by any route; 409 without ``CORRAL_SECRET_KEY`` (values are kept sealed
with it), 422 for a refused name or value (never echoed).
"""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, HTTPException, Path
from pydantic import BaseModel, ConfigDict, Field, SecretStr

from corral.scheduler.admin.responses import Deleted, SecretList, SecretStored
from corral.scheduler.api.admin_api import Administrator, DeploymentAdmin, OrgId
from corral.scheduler.api.auth import check_org
from corral.scheduler.api.bodies import StrictJSONRoute
from corral.scheduler.api.http_errors import InvalidRequest
from corral.scheduler.api.process_runtime import ApiRuntime
from corral.shared.errors import ConfigurationError
from corral.shared.runtime import Runtime
from corral.shared.store import secrets

router = APIRouter(route_class=StrictJSONRoute, tags=["secrets"])
SecretName = Annotated[
    str,
    Path(
        pattern=secrets.NAME_PATTERN,
        description="a secret's name: 1-63 letters, digits, '.', '_', '-'",
    ),
]


class SecretBody(BaseModel):
    model_config = ConfigDict(extra="forbid")

    value: SecretStr = Field(
        min_length=1,
        max_length=secrets.MAX_VALUE,
        description="the value, kept sealed; no answer ever shows it",
    )


def _listed(rt: Runtime, org: str | None) -> SecretList:
    rows = [info.as_json() for info in secrets.list_secrets(rt.db, org)]
    return SecretList.model_validate({"org": org, "secrets": rows})


def _stored(rt: Runtime, org: str | None, name: str, body: SecretBody) -> SecretStored:
    try:
        created = secrets.set_secret(rt.db, org, name, body.value.get_secret_value())
    except secrets.SecretError as exc:
        raise InvalidRequest("value", exc.message) from exc
    except ConfigurationError as exc:
        raise HTTPException(status_code=409, detail=exc.message) from exc
    scope = secrets.SecretScope.DEPLOYMENT if org is None else secrets.SecretScope.ORG
    return SecretStored(name=name, scope=scope.value, org=org, created=created)


def _deleted(rt: Runtime, org: str | None, name: str) -> Deleted:
    if not secrets.delete_secret(rt.db, org, name):
        raise HTTPException(status_code=404, detail="no such secret")
    return Deleted(id=f"{org or secrets.DEPLOYMENT}/{name}", deleted=True)


@router.get("/v1/admin/orgs/{org}/secrets")
def list_org_secrets(org: OrgId, caller: Administrator, rt: ApiRuntime) -> SecretList:
    """The org's named secrets: names and times, never values."""
    check_org(org, caller)
    return _listed(rt, org)


@router.put("/v1/admin/orgs/{org}/secrets/{name}")
def put_org_secret(
    org: OrgId, name: SecretName, body: SecretBody, caller: Administrator, rt: ApiRuntime
) -> SecretStored:
    """Create or replace the org's named secret; its value is stored sealed."""
    check_org(org, caller)
    return _stored(rt, org, name, body)


@router.delete("/v1/admin/orgs/{org}/secrets/{name}")
def delete_org_secret(
    org: OrgId, name: SecretName, caller: Administrator, rt: ApiRuntime
) -> Deleted:
    """Forget the org's named secret; 404 when it has none of that name. Items that refer to
    it and have not read it yet fail with unknown_secret."""
    check_org(org, caller)
    return _deleted(rt, org, name)


@router.get("/v1/admin/secrets")
def list_deployment_secrets(_: DeploymentAdmin, rt: ApiRuntime) -> SecretList:
    """The deployment's named secrets (every org's items may refer to them; an org's own
    secret of the same name wins): names and times, never values."""
    return _listed(rt, None)


@router.put("/v1/admin/secrets/{name}")
def put_deployment_secret(
    name: SecretName, body: SecretBody, _: DeploymentAdmin, rt: ApiRuntime
) -> SecretStored:
    """Create or replace a deployment-wide named secret; its value is stored sealed."""
    return _stored(rt, None, name, body)


@router.delete("/v1/admin/secrets/{name}")
def delete_deployment_secret(name: SecretName, _: DeploymentAdmin, rt: ApiRuntime) -> Deleted:
    """Forget a deployment-wide named secret; 404 when there is none of that name."""
    return _deleted(rt, None, name)
