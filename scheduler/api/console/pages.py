"""The console's login, overview and work-item pages."""

from __future__ import annotations

import logging
import re
import threading
import time
from datetime import datetime, timedelta
from typing import Annotated, Any

from fastapi import APIRouter, Depends, HTTPException, Path, Query, Request
from fastapi.responses import HTMLResponse, Response

from corral.scheduler.admin import overview, views
from corral.scheduler.admin.cancellation import cancel_item
from corral.scheduler.api import bundle_api
from corral.scheduler.api.auth import Scope
from corral.scheduler.api.console import charts, queries
from corral.scheduler.api.console import session as sessions
from corral.scheduler.api.console.render import page, read_form, redirect, static_file
from corral.scheduler.api.console.session import ConsoleSession
from corral.scheduler.api.process_runtime import ApiRuntime
from corral.shared.broker import celery_app
from corral.shared.broker.depths import queue_depths
from corral.shared.runtime import Runtime
from corral.shared.store.bundle_records import SHA256_PATTERN, BundleStateError, review_bundle
from corral.shared.store.db import Database
from corral.shared.store.ledger import parse_since
from corral.shared.store.models import BundleReview, ItemState
from corral.shared.text import IDENTIFIER

router = APIRouter(prefix="/console", include_in_schema=False)
Session = Annotated[ConsoleSession, Depends(sessions.current)]
ItemId = Annotated[str, Path(pattern=IDENTIFIER)]
Filter = Annotated[str | None, Query(max_length=128)]
PAGE_SIZE = 50
ACTOR = "console"
BROKER_TIMEOUT_S = 2.0  # the overview's wait for the queue lengths; past it, shown without
log = logging.getLogger(__name__)


@router.get("")
def home() -> Response:
    return Response(status_code=303, headers={"Location": "/console/overview"})


@router.get("/static/{name}")
def static(name: Annotated[str, Path(max_length=64)]) -> Response:
    return static_file(name)


def _login_page(request: Request, rt: Runtime, *, failed: bool) -> HTMLResponse:
    """The login form, with its token and the browser's nonce cookie (sessions.login_csrf)."""
    nonce = sessions.login_nonce(request)
    csrf = sessions.login_csrf(rt, nonce)
    answer = page("login.html", None, failed=failed, login_csrf=csrf, status=401 if failed else 200)
    sessions.set_login_cookie(answer, rt, nonce)
    return answer


@router.get("/login")
def login_form(request: Request, rt: ApiRuntime) -> HTMLResponse:
    return _login_page(request, rt, failed=False)


@router.post("/login")
async def login(request: Request, rt: ApiRuntime) -> Response:
    form = await read_form(request)
    sessions.check_login_csrf(rt, request, form)
    session_id = sessions.login(rt, form.get("token", "").strip())
    if session_id is None:  # the token is never shown again, not even to its sender
        return _login_page(request, rt, failed=True)
    answer = redirect("/console/overview", request)
    sessions.set_cookie(answer, rt, session_id)
    sessions.clear_login_cookie(answer, rt)
    return answer


@router.post("/logout")
async def logout(request: Request, session: Session, rt: ApiRuntime) -> Response:
    """End the session server-side (a copy of its cookie opens nothing after), then forget
    the cookie."""
    sessions.check_csrf(session, request, await read_form(request))
    sessions.logout(rt, request)
    answer = redirect("/console/login", request)
    sessions.clear_cookie(answer, rt)
    return answer


# -- overview ------------------------------------------------------------------------------


@router.get("/overview")
def overview_page(session: Session, rt: ApiRuntime) -> HTMLResponse:
    db = rt.db
    org = session.principal.org_filter(None)
    hour = queries.last_hour()
    labels = hour.starts()
    dispatched = queries.dispatch_series(db, hour, org)
    failed = queries.failure_series(db, hour, org)
    return page(
        "overview.html",
        session,
        nav="overview",
        states=overview.items_by_state(db, org),
        failures=overview.failures_by_code(db, timedelta(hours=1), org)["codes"],
        in_flight=queries.provisions_in_flight(db, org),
        unserved=overview.unserved_queues(db, org),
        pools=overview.pool_rows(db, org),
        dispatched_total=sum(dispatched),
        failed_total=sum(failed),
        dispatch_chart=charts.bar_chart(
            "items dispatched per 5 minutes",
            labels,
            {"dispatched": dispatched},
            unit=" items",
            chart_id="rate",
        ),
        failure_chart=charts.bar_chart(
            "items failed per 5 minutes",
            labels,
            {"failed": failed},
            unit=" items",
            chart_id="failures",
        ),
        **_health(db, org),
    )


def _health(db: Database, org: str | None) -> dict[str, Any]:
    """The processes-and-queues panel: for the deployment admin every queue with its
    consumers, the messages waiting on the broker and the items routed to it, and every
    process; for an org, its pools' queues with how many consume them and its own routed
    items (the broker's counts and the processes are the deployment's)."""
    if org is not None:
        return {"queues": overview.queue_rows(db, org), "processes": None, "broker": None}
    with db.session() as session:
        names = overview.queue_names(session)
    waiting, broker = _broker_depths(names)
    return {
        "queues": overview.queue_rows(db, None, waiting),
        "processes": overview.processes(db),
        "broker": broker,
    }


# The queue lengths the overview read last, kept this long: every load of the page (and
# its refresh) would otherwise wait on the broker, up to BROKER_TIMEOUT_S when it is away.
DEPTHS_KEPT_S = 5.0
_depths_lock = threading.Lock()
_depths_kept: dict[tuple[str, ...], tuple[float, dict[str, int] | None, str]] = {}


def _broker_depths(names: list[str]) -> tuple[dict[str, int] | None, str]:
    """The messages waiting on each of ``names`` (None: the broker did not answer) and what
    to say of the broker ("" when it answered), read at most once per :data:`DEPTHS_KEPT_S`
    by this process."""
    key, now = tuple(sorted(names)), time.monotonic()
    with _depths_lock:
        kept = _depths_kept.get(key)
        if kept is not None and now - kept[0] < DEPTHS_KEPT_S:
            return kept[1], kept[2]
    broker = ""
    waiting: dict[str, int] | None
    try:
        waiting = queue_depths(celery_app.app, names, timeout_s=BROKER_TIMEOUT_S)
    except Exception as exc:  # the broker's counts are left out; the rest still shows
        log.warning("queue lengths not read from the broker: %s", type(exc).__name__)
        waiting, broker = None, f"the broker did not answer ({type(exc).__name__})"
    with _depths_lock:
        if len(_depths_kept) > 64:  # the names change with the pools: keep the newest only
            _depths_kept.clear()
        _depths_kept[key] = (now, waiting, broker)
    return waiting, broker


# -- items ---------------------------------------------------------------------------------


def _since(text: str | None) -> datetime | None:
    if not text:
        return None
    try:
        return parse_since(text)
    except ValueError as exc:
        raise HTTPException(status_code=422, detail=str(exc)) from exc


def _cursor(text: str | None) -> tuple[datetime, str] | None:
    if not text:
        return None
    at, _, item_id = text.partition("~")
    try:
        return datetime.fromisoformat(at), item_id or "~"
    except ValueError as exc:
        raise HTTPException(status_code=422, detail="after: not a page cursor") from exc


def _states(state: str | None) -> list[ItemState] | None:
    if not state:
        return None
    if state not in {s.value for s in ItemState}:
        raise HTTPException(status_code=422, detail=f"state: one of {', '.join(ItemState)}")
    return [ItemState(state)]


@router.get("/items")
def items_page(
    session: Session,
    rt: ApiRuntime,
    *,
    org: Filter = None,
    state: Filter = None,
    pool: Filter = None,
    since: Filter = None,
    after: Annotated[str | None, Query(max_length=200)] = None,
) -> HTMLResponse:
    db = rt.db
    org_id = session.principal.org_filter(org or None)
    rows = views.list_items(
        db,
        org_id=org_id,
        states=_states(state),
        since=_since(since),
        pool_id=pool or None,
        before=_cursor(after),
        limit=PAGE_SIZE + 1,
    )
    more = len(rows) > PAGE_SIZE
    rows = rows[:PAGE_SIZE]
    filters = {"org": org or "", "state": state or "", "pool": pool or "", "since": since or ""}
    next_cursor = f"{rows[-1]['created_at']}~{rows[-1]['id']}" if more else ""
    return page(
        "items.html",
        session,
        nav="items",
        rows=rows,
        filters=filters,
        next_params={**filters, "after": next_cursor} if more else None,
        states=[s.value for s in ItemState],
        pools=queries.pool_choices(db, session.principal.org_filter(None)),
    )


def _visible_item(rt: Runtime, session: ConsoleSession, item_id: str) -> dict[str, Any]:
    try:
        view = views.load_item_view(rt.db, item_id, max_attempts=rt.settings.max_attempts)
    except LookupError:
        view = None
    if view is None or not session.principal.sees(view["org"]):
        raise HTTPException(status_code=404, detail="work item not found")
    return view


@router.get("/items/{item_id}")
def item_page(session: Session, item_id: ItemId, rt: ApiRuntime) -> HTMLResponse:
    db = rt.db
    view = _visible_item(rt, session, item_id)
    lines = views.load_log_lines(db, item_id)
    return page(
        "item.html",
        session,
        nav="items",
        item=view,
        final=ItemState(view["state"]).is_final,
        events=views.load_events(db, item_id),
        sandboxes=views.load_item_sandboxes(db, item_id),
        lines=lines,
        last_line=lines[-1]["id"] if lines else 0,
    )


@router.get("/items/{item_id}/logs")
def item_logs(
    session: Session, item_id: ItemId, rt: ApiRuntime, after: Annotated[int, Query(ge=0)] = 0
) -> HTMLResponse:
    """The lines after ``after`` (appended to the page's log) and the next poll, while the
    item runs; a final item's answer stops the polling and reloads its page's state."""
    view = _visible_item(rt, session, item_id)
    lines = views.load_log_lines(rt.db, item_id, after=after)
    return page(
        "item_logs.html",
        session,
        item=view,
        final=ItemState(view["state"]).is_final,
        lines=lines,
        last_line=lines[-1]["id"] if lines else after,
    )


@router.post("/items/{item_id}/cancel")
async def cancel(request: Request, session: Session, item_id: ItemId, rt: ApiRuntime) -> Response:
    sessions.check_csrf(session, request, await read_form(request))
    view = _visible_item(rt, session, item_id)
    sessions.require(session, Scope.DISPATCH, view["org"])
    try:
        cancel_item(rt.db, item_id, actor=ACTOR)
    except LookupError as exc:
        raise HTTPException(status_code=404, detail="work item not found") from exc
    return redirect(f"/console/items/{item_id}", request)


@router.get("/items/{item_id}/bundle")
def bundle(session: Session, item_id: ItemId, rt: ApiRuntime) -> Response:
    _visible_item(rt, session, item_id)
    return bundle_api.get_bundle(rt, item_id)


@router.post("/items/{item_id}/bundle/accept")
async def accept_bundle(
    request: Request, session: Session, item_id: ItemId, rt: ApiRuntime
) -> Response:
    return await _review(request, session, item_id, rt, BundleReview.ACCEPTED)


@router.post("/items/{item_id}/bundle/reject")
async def reject_bundle(
    request: Request, session: Session, item_id: ItemId, rt: ApiRuntime
) -> Response:
    return await _review(request, session, item_id, rt, BundleReview.REJECTED)


async def _review(
    request: Request, session: ConsoleSession, item_id: str, rt: Runtime, decision: BundleReview
) -> Response:
    """Decide on the bundle the page showed: its SHA-256 comes with the form, so a page
    rendered before another upload is refused (409) rather than deciding on one unseen."""
    form = await read_form(request)
    sessions.check_csrf(session, request, form)
    view = _visible_item(rt, session, item_id)
    sessions.require(session, Scope.REVIEW, view["org"])
    sha256 = form.get("sha256", "")
    if not re.fullmatch(SHA256_PATTERN, sha256):
        raise HTTPException(status_code=422, detail="the form names no bundle: reload the page")
    try:
        review_bundle(rt.db, item_id, decision, sha256=sha256, actor=ACTOR)
    except LookupError as exc:
        raise HTTPException(status_code=404, detail="no result bundle") from exc
    except BundleStateError as exc:
        raise HTTPException(status_code=409, detail=exc.message) from exc
    return redirect(f"/console/items/{item_id}", request)
