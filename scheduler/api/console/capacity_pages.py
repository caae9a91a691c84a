"""The console's shared capacity page: every capacity with the pools that draw on it (each
org's weight, slots held, share and items waiting), and forms that create a capacity,
change its slots, delete it and set an org's weight. The admin api's functions behind forms
(corral.scheduler.admin.capacities), with its rule: the deployment admin's alone (403 for an
org login, which sees other orgs here)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated

from fastapi import APIRouter, Depends, HTTPException, Path, Request
from fastapi.responses import HTMLResponse, Response
from pydantic import BaseModel, ValidationError

from corral.scheduler.admin import capacities
from corral.scheduler.admin.pools import AdminError
from corral.scheduler.api.auth import DEPLOYMENT_ONLY, Scope
from corral.scheduler.api.console import session as sessions
from corral.scheduler.api.console.render import page, read_form, redirect
from corral.scheduler.api.console.session import ConsoleSession
from corral.scheduler.api.process_runtime import ApiRuntime
from corral.shared.messages import describe_field_errors, field_errors
from corral.shared.runtime import Runtime
from corral.shared.store import shares
from corral.shared.text import IDENTIFIER

router = APIRouter(prefix="/console", include_in_schema=False)
Session = Annotated[ConsoleSession, Depends(sessions.current)]
CapacityId = Annotated[str, Path(pattern=IDENTIFIER)]


def _deployment(session: ConsoleSession) -> None:
    """403 unless the deployment admin is logged in (capacities and weights are its)."""
    principal = session.principal
    if not (principal.is_deployment_admin and Scope.ADMIN in principal.scopes):
        raise HTTPException(status_code=403, detail=DEPLOYMENT_ONLY)


def _page(
    rt: Runtime, session: ConsoleSession, *, error: str = "", status: int = 200
) -> HTMLResponse:
    return page(
        "capacities.html",
        session,
        nav="capacities",
        capacities=capacities.list_capacities(rt.db),
        max_slots=shares.MAX_SLOTS,
        max_weight=shares.MAX_WEIGHT,
        error=error,
        status=status,
    )


def _refused(exc: ValidationError | AdminError, model: type[BaseModel]) -> tuple[str, int]:
    """What the page says of a refused form, and its status."""
    if isinstance(exc, ValidationError):
        return f"invalid: {describe_field_errors(field_errors(exc, model))}", 422
    if isinstance(exc, LookupError):
        return exc.message, 404
    conflicts = (capacities.CapacityNameTakenError, capacities.CapacityInUseError)
    return exc.message, 409 if isinstance(exc, conflicts) else 422


async def _form(request: Request, session: ConsoleSession) -> dict[str, str]:
    """The submitted form, once the deployment admin sent it with the session's nonce."""
    form = await read_form(request)
    sessions.check_csrf(session, request, form)
    _deployment(session)
    return form


def _done(
    rt: Runtime,
    session: ConsoleSession,
    request: Request,
    change: Callable[[], object],
    model: type[BaseModel] = capacities.CapacityUpdate,
) -> Response:
    """Make ``change`` (its input checked as ``model``), then back to the page; refused, the
    page says why."""
    try:
        change()
    except (ValidationError, AdminError) as exc:
        error, status = _refused(exc, model)
        return _page(rt, session, error=error, status=status)
    return redirect("/console/capacities", request)


@router.get("/capacities")
def capacities_page(session: Session, rt: ApiRuntime) -> HTMLResponse:
    _deployment(session)
    return _page(rt, session)


@router.post("/capacities")
async def capacity_create(request: Request, session: Session, rt: ApiRuntime) -> Response:
    form = await _form(request, session)
    fields = {"name": form.get("name", "").strip(), "slots": form.get("slots", "").strip()}
    model = capacities.CapacityCreate
    return _done(
        rt,
        session,
        request,
        lambda: capacities.create_capacity(rt.db, model.model_validate(fields)),
        model,
    )


@router.post("/capacities/{capacity_id}")
async def capacity_update(
    request: Request, session: Session, capacity_id: CapacityId, rt: ApiRuntime
) -> Response:
    """Change the capacity's slots."""
    form = await _form(request, session)
    fields = {"slots": form.get("slots", "").strip()}
    model = capacities.CapacityUpdate
    return _done(
        rt,
        session,
        request,
        lambda: capacities.update_capacity(rt.db, capacity_id, model.model_validate(fields)),
    )


@router.post("/capacities/{capacity_id}/delete")
async def capacity_delete(
    request: Request, session: Session, capacity_id: CapacityId, rt: ApiRuntime
) -> Response:
    """Delete the capacity: refused, naming them, while pools draw on it."""
    await _form(request, session)
    return _done(rt, session, request, lambda: capacities.delete_capacity(rt.db, capacity_id))


@router.post("/weights")
async def weight_set(request: Request, session: Session, rt: ApiRuntime) -> Response:
    """Set an org's weight; an empty weight sets it back to the default."""
    form = await _form(request, session)
    org = sessions.admin_org(session, form.get("org"))
    if org is None:
        return _page(rt, session, error="org: required", status=422)
    text = form.get("weight", "").strip()

    def change() -> object:
        weight = capacities.WeightSet.model_validate({"weight": text}).weight if text else None
        return capacities.set_org_weight(rt.db, org, weight)

    return _done(rt, session, request, change, capacities.WeightSet)
