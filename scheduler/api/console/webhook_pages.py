"""The console's webhook pages: an org's endpoints (added, its secret shown once; removed),
each endpoint's delivery log, and an event sent again. The admin api's store functions
behind forms (corral.shared.store.webhooks, corral.shared.store.webhook_log), with its rules:
the admin scope over the org, and another org's endpoint or event answers 404."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Depends, HTTPException, Path, Query, Request
from fastapi.responses import HTMLResponse, Response

from corral.scheduler.api.auth import Scope
from corral.scheduler.api.console import session as sessions
from corral.scheduler.api.console.render import page, read_form, redirect
from corral.scheduler.api.console.session import ConsoleSession
from corral.scheduler.api.process_runtime import ApiRuntime
from corral.scheduler.api.webhooks_api import KEY_NEEDED, redeliver
from corral.shared.keyring import required_keyring
from corral.shared.runtime import Runtime
from corral.shared.store import webhook_log, webhooks
from corral.shared.store.models import WebhookEndpoint
from corral.shared.text import IDENTIFIER

router = APIRouter(prefix="/console", include_in_schema=False)
Session = Annotated[ConsoleSession, Depends(sessions.current)]
WebhookId = Annotated[str, Path(pattern=IDENTIFIER)]
EventId = Annotated[str, Path(pattern=IDENTIFIER)]
PAGE_SIZE = 50


def _list_page(
    rt: Runtime,
    session: ConsoleSession,
    org: str | None,
    *,
    made: dict[str, Any] | None = None,
    error: str = "",
    status: int = 200,
) -> HTMLResponse:
    """The org's endpoints; after an endpoint was made, its secret, this once."""
    rows: list[dict[str, Any]] = []
    if org is not None:
        with rt.db.session() as db_session:
            rows = webhooks.list_endpoints(db_session, org)
    return page(
        "webhooks.html",
        session,
        nav="webhooks",
        org=org,
        endpoints=rows,
        events=webhooks.EVENTS,
        made=made,
        error=error,
        status=status,
        has_key=rt.settings.secret_key is not None,
    )


@router.get("/webhooks")
def webhooks_page(
    session: Session, rt: ApiRuntime, org: Annotated[str | None, Query(max_length=63)] = None
) -> HTMLResponse:
    return _list_page(rt, session, sessions.admin_org(session, org))


@router.post("/webhooks")
async def webhook_add(request: Request, session: Session, rt: ApiRuntime) -> Response:
    """Add an endpoint; the answer is the only page that shows its signing secret."""
    form = await read_form(request)
    sessions.check_csrf(session, request, form)
    org = sessions.admin_org(session, form.get("org"))
    if org is None:
        raise HTTPException(status_code=422, detail="org: required")
    if rt.settings.secret_key is None:
        raise HTTPException(status_code=409, detail=KEY_NEEDED)
    chosen = [event for event in webhooks.EVENTS if form.get(f"event.{event}")]
    try:
        with rt.db.session() as db_session:
            document, secret = webhooks.create_endpoint(
                db_session,
                required_keyring(rt.settings),
                org,
                form.get("url", ""),
                chosen,
                allow_http=rt.settings.webhook_allow_http,
            )
    except webhooks.WebhookError as exc:
        return _list_page(rt, session, org, error=exc.message, status=422)
    return _list_page(rt, session, org, made={**document, "secret": secret}, status=201)


def _endpoint(rt: Runtime, session: ConsoleSession, webhook_id: str) -> WebhookEndpoint:
    """The endpoint, once the caller may administer its org (another org's: 404)."""
    with rt.db.session() as db_session:
        row = db_session.get(WebhookEndpoint, webhook_id)
    if row is None or not session.principal.sees(row.org_id):
        raise HTTPException(status_code=404, detail="webhook not found")
    sessions.require(session, Scope.ADMIN, row.org_id)
    return row


@router.post("/webhooks/{webhook_id}/remove")
async def webhook_remove(
    request: Request, session: Session, webhook_id: WebhookId, rt: ApiRuntime
) -> Response:
    sessions.check_csrf(session, request, await read_form(request))
    row = _endpoint(rt, session, webhook_id)
    with rt.db.session() as db_session:
        webhooks.remove_endpoint(db_session, row.org_id, webhook_id)
    return redirect(f"/console/webhooks?org={row.org_id}", request)


@router.get("/webhooks/{webhook_id}")
def webhook_page(
    session: Session,
    webhook_id: WebhookId,
    rt: ApiRuntime,
    before: Annotated[int | None, Query(ge=1)] = None,
    redelivered: Annotated[str | None, Query(pattern=IDENTIFIER)] = None,
) -> HTMLResponse:
    """The endpoint's delivery log, newest first, a page at a time."""
    row = _endpoint(rt, session, webhook_id)
    with rt.db.session() as db_session:
        tries = webhook_log.deliveries(
            db_session, row.org_id, webhook_id, limit=PAGE_SIZE, before=before
        )
    return page(
        "webhook.html",
        session,
        nav="webhooks",
        endpoint=webhooks.endpoint_document(row),
        tries=tries,
        older=tries[-1]["id"] if len(tries) == PAGE_SIZE else None,
        redelivered=redelivered,
    )


@router.post("/webhooks/events/{event_id}/redeliver")
async def event_redeliver(
    request: Request, session: Session, event_id: EventId, rt: ApiRuntime
) -> Response:
    """Owe an event again, with its own id; back to its endpoint's log."""
    form = await read_form(request)
    sessions.check_csrf(session, request, form)
    org = sessions.admin_org(session, form.get("org"))
    if org is None:
        raise HTTPException(status_code=422, detail="org: required")
    done = redeliver(rt.db, org, event_id)
    target = f"/console/webhooks/{done['endpoint_id']}?redelivered={event_id}"
    return redirect(target, request)
