"""The admin api's routes for shared capacities and org weights
(:mod:`corral.scheduler.admin.capacities`). Both are the deployment's to decide: every route
that changes them takes the deployment admin token alone (403 for an org key); an org admin
key may read its own org's weight.

Errors: 404 for an unknown capacity, 409 ``capacity_name_taken`` (a name another capacity
has) and ``capacity_in_use`` (pools still draw on it; the message names them), 422 for an
invalid value (naming the field).
"""

from __future__ import annotations

from datetime import datetime
from typing import Annotated

from fastapi import APIRouter, HTTPException, Path
from pydantic import Field

from corral.scheduler.admin import capacities
from corral.scheduler.admin.pools import AdminError
from corral.scheduler.admin.responses import Answer, Count, Deleted
from corral.scheduler.api.admin_api import Administrator, DeploymentAdmin, OrgId
from corral.scheduler.api.auth import check_org
from corral.scheduler.api.bodies import StrictJSONRoute
from corral.scheduler.api.http_errors import CONFLICT_ANSWER, Conflict, InvalidRequest
from corral.scheduler.api.process_runtime import ApiRuntime
from corral.shared.text import IDENTIFIER

router = APIRouter(route_class=StrictJSONRoute)
CapacityName = Annotated[
    str, Path(pattern=IDENTIFIER, description="a capacity's name (or its id, cap-...)")
]


class CapacityMember(Answer):
    pool_id: str
    pool: str = Field(description="the pool's name")
    org_id: str
    active: bool
    weight: int = Field(description="its org's weight in the division")
    slots_in_use: Count = Field(description="slots its items hold now")
    share_limit: Count | None = Field(
        description="its share now: the most slots it may hold (the re-drive sets it)"
    )
    waiting: Count = Field(description="its org's items waiting for it, counted up to a cap")
    waiting_counted_all: bool = Field(
        description="false: the org has more waiting items than were counted (a lower bound)"
    )


class CapacityRow(Answer):
    id: str
    name: str
    slots: Count = Field(description="sandboxes at once across every pool on it")
    slots_in_use: Count = Field(description="slots its pools' items hold now")
    created_at: datetime
    updated_at: datetime
    pools: list[CapacityMember] = Field(description="the pools that draw on it, by org")


class CapacityList(Answer):
    capacities: list[CapacityRow]


class OrgWeightView(Answer):
    org_id: str
    weight: int = Field(description="its weight in the division of shared capacity")
    default: bool = Field(description="true: none set, it weighs the default")


def _capacity_error(exc: AdminError) -> HTTPException:
    if isinstance(exc, capacities.CapacityNotFoundError):
        return HTTPException(status_code=404, detail="no such capacity")
    if isinstance(exc, capacities.CapacityNameTakenError):
        return Conflict(exc.code, "name", exc.message)
    if isinstance(exc, capacities.CapacityInUseError):
        return Conflict(exc.code, "(request)", exc.message)
    return InvalidRequest("(body)", exc.message)


@router.post("/v1/admin/capacities", status_code=201, responses=CONFLICT_ANSWER)
def create_capacity(
    body: capacities.CapacityCreate, _: DeploymentAdmin, rt: ApiRuntime
) -> CapacityRow:
    """Create a shared capacity: `{"name", "slots"}`. Pools are put on it by their
    `capacity` (`PATCH /v1/admin/pools/{id}`), one pool an org."""
    try:
        return CapacityRow.model_validate(capacities.create_capacity(rt.db, body))
    except AdminError as exc:
        raise _capacity_error(exc) from exc


@router.get("/v1/admin/capacities")
def list_capacities(_: DeploymentAdmin, rt: ApiRuntime) -> CapacityList:
    """Every capacity, with each pool on it: its org, weight, slots held, share and items
    waiting."""
    return CapacityList.model_validate({"capacities": capacities.list_capacities(rt.db)})


@router.get("/v1/admin/capacities/{capacity}")
def get_capacity(capacity: CapacityName, _: DeploymentAdmin, rt: ApiRuntime) -> CapacityRow:
    """One capacity, with each pool on it."""
    try:
        return CapacityRow.model_validate(capacities.find_capacity(rt.db, capacity))
    except AdminError as exc:
        raise _capacity_error(exc) from exc


@router.patch("/v1/admin/capacities/{capacity}", responses=CONFLICT_ANSWER)
def update_capacity(
    capacity: CapacityName, body: capacities.CapacityUpdate, _: DeploymentAdmin, rt: ApiRuntime
) -> CapacityRow:
    """Change its slots (`{"slots": N}`); the re-drive divides them again at once. Fewer
    slots than its pools hold end nothing: no item starts on it until they are under."""
    try:
        return CapacityRow.model_validate(capacities.update_capacity(rt.db, capacity, body))
    except AdminError as exc:
        raise _capacity_error(exc) from exc


@router.delete("/v1/admin/capacities/{capacity}", responses=CONFLICT_ANSWER)
def delete_capacity(capacity: CapacityName, _: DeploymentAdmin, rt: ApiRuntime) -> Deleted:
    """Delete a capacity; 409 `capacity_in_use`, naming the pools, while pools draw on it."""
    try:
        capacities.delete_capacity(rt.db, capacity)
    except AdminError as exc:
        raise _capacity_error(exc) from exc
    return Deleted(id=capacity, deleted=True)


@router.get("/v1/admin/orgs/{org}/weight")
def get_weight(org: OrgId, caller: Administrator, rt: ApiRuntime) -> OrgWeightView:
    """The org's weight in the division of shared capacity (1 unless set)."""
    check_org(org, caller)
    return OrgWeightView.model_validate(capacities.org_weight(rt.db, org))


@router.put("/v1/admin/orgs/{org}/weight")
def put_weight(
    org: OrgId, body: capacities.WeightSet, _: DeploymentAdmin, rt: ApiRuntime
) -> OrgWeightView:
    """Set the org's weight (`{"weight": N}`, 1 to 1000): on every capacity, its pool gets
    a part of the slots in proportion to it. The deployment sets it."""
    return OrgWeightView.model_validate(capacities.set_org_weight(rt.db, org, body.weight))


@router.delete("/v1/admin/orgs/{org}/weight")
def delete_weight(org: OrgId, _: DeploymentAdmin, rt: ApiRuntime) -> OrgWeightView:
    """Set the org's weight back to the default (1)."""
    return OrgWeightView.model_validate(capacities.set_org_weight(rt.db, org, None))
