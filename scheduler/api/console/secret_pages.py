"""The console's named secrets page: an org's secrets and, for the deployment admin, the
deployment's, each listed by name (never a value), set (created or replaced) and deleted by
forms with the session's CSRF token. The admin api's rules: the admin scope over the org
(another org's answers 404), the deployment's secrets for the deployment admin alone (403)."""

from __future__ import annotations

from typing import Annotated
from urllib.parse import quote

from fastapi import APIRouter, Depends, HTTPException, Query, Request
from fastapi.responses import HTMLResponse, Response

from corral.scheduler.api.auth import DEPLOYMENT_ONLY
from corral.scheduler.api.console import session as sessions
from corral.scheduler.api.console.render import page, read_form, redirect
from corral.scheduler.api.console.session import ConsoleSession
from corral.scheduler.api.process_runtime import ApiRuntime
from corral.shared.errors import ConfigurationError
from corral.shared.runtime import Runtime
from corral.shared.store import secrets

router = APIRouter(prefix="/console", include_in_schema=False)
Session = Annotated[ConsoleSession, Depends(sessions.current)]


def _list_page(
    rt: Runtime, session: ConsoleSession, org: str | None, *, error: str = "", status: int = 200
) -> HTMLResponse:
    deployment = session.principal.is_deployment_admin
    return page(
        "secrets.html",
        session,
        nav="secrets",
        org=org,
        org_secrets=secrets.list_secrets(rt.db, org) if org is not None else [],
        deployment_secrets=secrets.list_secrets(rt.db, None) if deployment else [],
        deployment=deployment,
        max_value=secrets.MAX_VALUE,
        has_key=rt.db.sealer.can_seal,
        error=error,
        status=status,
    )


def _target(session: ConsoleSession, form: dict[str, str]) -> str | None:
    """Whose secret a form is about: the org it names (None for the deployment's, which
    only the deployment admin may change)."""
    if form.get("scope") == secrets.SecretScope.DEPLOYMENT:
        if not session.principal.is_deployment_admin:
            raise HTTPException(status_code=403, detail=DEPLOYMENT_ONLY)
        return None
    org = sessions.admin_org(session, form.get("org"))
    if org is None:
        raise HTTPException(status_code=422, detail="org: required")
    return org


def _back(org: str | None, request: Request) -> Response:
    # ``org`` may be the form's shown_org as sent: a query value, never more of the URL.
    return redirect(
        f"/console/secrets?org={quote(org, safe='')}" if org else "/console/secrets", request
    )


@router.get("/secrets")
def secrets_page(
    session: Session, rt: ApiRuntime, org: Annotated[str | None, Query(max_length=63)] = None
) -> HTMLResponse:
    return _list_page(rt, session, sessions.admin_org(session, org))


@router.post("/secrets")
async def secret_set(request: Request, session: Session, rt: ApiRuntime) -> Response:
    """Create or replace a secret; back to the list, which never shows the value."""
    form = await read_form(request)
    sessions.check_csrf(session, request, form)
    org = _target(session, form)
    try:
        secrets.set_secret(rt.db, org, form.get("name", "").strip(), form.get("value", ""))
    except secrets.SecretError as exc:
        shown = org if org is not None else sessions.admin_org(session, form.get("shown_org"))
        return _list_page(rt, session, shown, error=exc.message, status=422)
    except ConfigurationError as exc:
        raise HTTPException(status_code=409, detail=exc.message) from exc
    return _back(org if org is not None else form.get("shown_org"), request)


@router.post("/secrets/delete")
async def secret_delete(request: Request, session: Session, rt: ApiRuntime) -> Response:
    form = await read_form(request)
    sessions.check_csrf(session, request, form)
    org = _target(session, form)
    if not secrets.delete_secret(rt.db, org, form.get("name", "")):
        raise HTTPException(status_code=404, detail="no such secret")
    return _back(org if org is not None else form.get("shown_org"), request)
