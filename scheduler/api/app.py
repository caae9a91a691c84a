"""The HTTP api: dispatch intake, work-item reads, admin, health, and the runner protocol.

Dispatch, reads and admin need the admin token (``CORRAL_ADMIN_TOKEN``); a runner session
may also read its own work item, and nothing else. Ids that the caller may not see answer
404, the same as ids that do not exist.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Annotated, Any

from fastapi import Depends, FastAPI, HTTPException, Path, Query, Request, Response
from fastapi.openapi.utils import get_openapi
from pydantic import ValidationError
from sqlalchemy import select

from corral.providers.base import SandboxState
from corral.scheduler.admin import pools as admin
from corral.scheduler.admin import views
from corral.scheduler.admin.cancellation import cancel_item
from corral.scheduler.admin.responses import (
    BundleReviewed,
    Cancelled,
    CostView,
    Dispatched,
    ItemError,
    PoolList,
    PoolRow,
    ProfileList,
    ProfileRow,
    SandboxList,
    WorkItemEvents,
    WorkItemLogs,
    WorkItemSecretUses,
    WorkItemView,
)
from corral.scheduler.admin.views import load_item_view, load_log_lines
from corral.scheduler.api import (
    bodies,
    bundle_api,
    capacity_api,
    console,
    health,
    items_api,
    secrets_api,
    security_headers,
    webhooks_api,
)
from corral.scheduler.api.admin_api import POOLS_ARE_THE_DEPLOYMENTS, placement_error
from corral.scheduler.api.admin_api import router as admin_router
from corral.scheduler.api.auth import (
    Principal,
    Scope,
    any_caller,
    caller_holding,
    deployment_admin,
    needs,
)
from corral.scheduler.api.bodies import StrictJSONRoute, read_json
from corral.scheduler.api.http_errors import (
    CONFLICT_ANSWER,
    ERROR_RESPONSES,
    InvalidFields,
    InvalidRequest,
    install_handlers,
)
from corral.scheduler.api.http_intake import Written, writer_for
from corral.scheduler.api.interactive import SessionCreate
from corral.scheduler.api.interactive_api import router as session_router
from corral.scheduler.api.process_runtime import ApiRuntime, runtime_of
from corral.scheduler.api.runner_api import router
from corral.scheduler.api.throttle import RunnerRateLimitMiddleware
from corral.scheduler.api.warm_api import router as warm_router
from corral.shared.messages import DispatchRequest, field_errors
from corral.shared.runtime import Runtime
from corral.shared.store import secrets
from corral.shared.store.db import Database
from corral.shared.store.ledger import CostGrouping, parse_since
from corral.shared.store.models import BundleReview, ItemState, WorkItem
from corral.shared.text import IDENTIFIER, INT64_MAX

log = logging.getLogger(__name__)
ACTOR = "api"


def reader(caller: Annotated[Principal, Depends(any_caller)]) -> Principal:
    """A caller who may read: a holder of the read scope, or a runner session (its item)."""
    if caller.runner_item is None and Scope.READ not in caller.scopes:
        raise HTTPException(status_code=401, detail="unauthorized")  # every key holds read
    return caller


def check_item(db: Database, item_id: str, caller: Principal) -> None:
    """404 unless ``item_id`` exists and ``caller`` may see it."""
    if caller.runner_item is not None:
        if caller.runner_item != item_id:
            raise HTTPException(status_code=404, detail="work item not found")
        return
    with db.session() as session:
        org_id = session.scalar(select(WorkItem.org_id).where(WorkItem.id == item_id))
    if org_id is None or not caller.sees(org_id):
        raise HTTPException(status_code=404, detail="work item not found")


Reader = Annotated[Principal, Depends(reader)]  # a runner session too (its own item)
Lister = Annotated[Principal, Depends(needs(Scope.READ))]  # never a runner session
Dispatcher = Annotated[Principal, Depends(needs(Scope.DISPATCH))]
Reviewer = Annotated[Principal, Depends(needs(Scope.REVIEW))]  # not held by dispatch
Administrator = Annotated[Principal, Depends(needs(Scope.ADMIN))]
# Ids in paths and org filters: identifiers, so a NUL or any other odd character is a 422
# before anything reaches the database.
ItemId = Annotated[str, Path(pattern=IDENTIFIER, description="a work item id (wi-...)")]
OrgFilter = Annotated[str | None, Query(pattern=IDENTIFIER, description="only this org's")]


def _optional_header(name: str, title: str) -> dict[str, Any]:
    nullable = {"anyOf": [{"type": "string"}, {"type": "null"}], "title": title}
    return {"name": name, "in": "header", "required": False, "schema": nullable}


# The dispatch route reads its body and headers itself (its errors are invalid_message, the
# Idempotency-Key header joins the body, and FastAPI's parsing of declared parameters was
# half of the route's own time); the schema still says what it takes.
DISPATCH_REQUEST = {
    "parameters": [
        _optional_header("idempotency-key", "Idempotency-Key"),
        _optional_header("authorization", "Authorization"),
    ],
    "requestBody": {
        "required": True,
        "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Dispatch"}}},
    },
}


def _openapi(api: FastAPI) -> dict[str, Any]:
    """FastAPI's schema, plus the dispatch message (and the models it uses) as components."""
    if api.openapi_schema is None:
        schema = get_openapi(title=api.title, version=api.version, routes=api.routes)
        message = DispatchRequest.model_json_schema(ref_template="#/components/schemas/{model}")
        components = schema.setdefault("components", {}).setdefault("schemas", {})
        components.update(message.pop("$defs", {}))
        components["Dispatch"] = message
        # A session's body holds models of the message's: one component each, the same.
        session = SessionCreate.model_json_schema(ref_template="#/components/schemas/{model}")
        for name, model in session.pop("$defs", {}).items():
            components.setdefault(name, model)
        components["SessionCreate"] = session
        api.openapi_schema = schema
    return api.openapi_schema


def create_app() -> FastAPI:
    """The api. Its metrics are served on a listener of their own (corral.scheduler.api.server)."""
    api = FastAPI(
        title="corral", version="1", docs_url="/docs", redoc_url=None, responses=ERROR_RESPONSES
    )
    api.router.route_class = StrictJSONRoute
    # First: a request is matched against the routes in order, and dispatch is the route
    # callers send the most (behind the included routers it cost 9 % of a dispatch's time).
    api.post(
        "/v1/dispatch",
        status_code=202,
        response_model=Dispatched,
        openapi_extra=DISPATCH_REQUEST,
        responses={
            200: {
                "model": Dispatched,
                "description": "The item an earlier dispatch with this key made.",
            }
        },
    )(dispatch)
    api.include_router(router)
    api.include_router(warm_router)
    api.include_router(admin_router)
    api.include_router(capacity_api.router)
    api.include_router(webhooks_api.router)
    api.include_router(secrets_api.router)
    api.include_router(session_router)
    api.include_router(items_api.router)
    install_handlers(api)
    bodies.install(api)
    api.add_middleware(RunnerRateLimitMiddleware)  # refuses before any other of ours
    security_headers.install(api)  # around everything, the 500s and 429s included

    api.openapi = lambda: _openapi(api)  # type: ignore[method-assign]
    health.install(api)
    console.install(api)
    api.get("/v1/work-items/{item_id}")(get_work_item)
    api.get("/v1/work-items/{item_id}/logs")(get_logs)
    api.get("/v1/work-items/{item_id}/events")(get_events)
    api.get("/v1/work-items/{item_id}/secret-uses")(get_secret_uses)
    api.post("/v1/work-items/{item_id}/cancel")(cancel)
    api.get(
        "/v1/work-items/{item_id}/bundle",
        response_class=Response,
        responses=bundle_api.DOWNLOAD_ANSWER,
    )(get_bundle)
    review_answers = bundle_api.REVIEW_ANSWERS
    api.post("/v1/work-items/{item_id}/bundle/accept", responses=review_answers)(accept_bundle)
    api.post("/v1/work-items/{item_id}/bundle/reject", responses=review_answers)(reject_bundle)
    api.post("/v1/admin/profiles", status_code=201)(create_profile)
    api.get("/v1/admin/profiles")(list_profiles)
    api.post("/v1/admin/pools", status_code=201, responses=CONFLICT_ANSWER)(create_pool)
    api.get("/v1/admin/pools")(list_pools)
    api.get("/v1/costs")(get_costs)
    api.get("/v1/sandboxes")(get_sandboxes)
    return api


async def dispatch(request: Request) -> Response:
    """Store a dispatch message: 202 with its new item, or 200 with the item an earlier
    dispatch with the same idempotency key made."""
    rt = runtime_of(request.app)
    caller = await caller_holding(Scope.DISPATCH, rt, request.headers.get("authorization"))
    idempotency_key = request.headers.get("idempotency-key")
    depth = rt.settings.api_json_max_depth
    body = read_json(await request.body(), max_depth=depth, error="invalid_message")
    if isinstance(body, dict) and idempotency_key is not None:
        if body.get("idempotency_key") not in (None, idempotency_key):
            raise InvalidRequest(
                "idempotency_key", "differs from the header", error="invalid_message"
            )
        body = {**body, "idempotency_key": idempotency_key}
    try:
        message = DispatchRequest.model_validate(body)
    except ValidationError as exc:
        raise InvalidFields(field_errors(exc), error="invalid_message") from exc
    if not caller.sees(message.org):
        raise HTTPException(status_code=403, detail="this key dispatches for its own org only")
    # The process's dispatch writer stores it with whatever else is waiting (one batch,
    # one transaction) and publishes its provision task; the event loop only waits.
    writer = writer_for(rt.db, rt.settings, actor=ACTOR)
    written = await asyncio.wrap_future(writer.submit(message))
    answer = await _dispatched(rt, written)
    return Response(
        answer.model_dump_json(),
        status_code=202 if written.created else 200,
        media_type="application/json",
    )


async def _dispatched(rt: Runtime, written: Written) -> Dispatched:
    """The answer to a dispatch: the item, and its state (with a dispatch error's reason,
    read from the item, as is an earlier dispatch's state)."""
    state: str | None = written.state.value if written.state is not None else None
    error = None
    if state is None or state == ItemState.DISPATCH_ERROR.value:
        found = await asyncio.to_thread(views.item_state, rt.db, written.item_id)
        if found is not None:
            state, code, message = found
            error = ItemError(code=code, message=message) if code else None
    return Dispatched.model_validate(
        {"id": written.item_id, "created": written.created, "state": state, "error": error}
    )


async def get_work_item(
    item_id: ItemId,
    caller: Reader,
    rt: ApiRuntime,
    wait: Annotated[
        float,
        Query(
            ge=0,
            le=items_api.MAX_WAIT_S,
            description="seconds to hold the answer until the item is final (at most 60)",
        ),
    ] = 0,
) -> WorkItemView:
    check_item(rt.db, item_id, caller)
    await items_api.wait_until_final(rt, item_id, wait, org_id=caller.org_id)
    try:
        view = await asyncio.to_thread(
            load_item_view, rt.db, item_id, max_attempts=rt.settings.max_attempts
        )
        return WorkItemView.model_validate(view)
    except LookupError as exc:
        raise HTTPException(status_code=404, detail="work item not found") from exc


def get_logs(
    item_id: ItemId,
    caller: Reader,
    rt: ApiRuntime,
    after: Annotated[int, Query(ge=0, le=INT64_MAX)] = 0,
) -> WorkItemLogs:
    check_item(rt.db, item_id, caller)
    with rt.db.session() as session:
        item = session.get(WorkItem, item_id)
    if item is None:
        raise HTTPException(status_code=404, detail="work item not found")
    lines = load_log_lines(rt.db, item_id, after=after)
    return WorkItemLogs.model_validate({"lines": lines, "dropped_lines": item.log_dropped_lines})


def get_events(item_id: ItemId, caller: Reader, rt: ApiRuntime) -> WorkItemEvents:
    check_item(rt.db, item_id, caller)
    events = views.load_events(rt.db, item_id)
    return WorkItemEvents.model_validate({"events": events})


def get_secret_uses(item_id: ItemId, caller: Reader, rt: ApiRuntime) -> WorkItemSecretUses:
    """The named secrets read for the item (name, scope, env or binding, when), oldest
    first; never a value."""
    check_item(rt.db, item_id, caller)
    with rt.db.session() as session:
        uses = secrets.uses_of(session, item_id)
    return WorkItemSecretUses.model_validate({"uses": uses})


def get_bundle(item_id: ItemId, caller: Reader, rt: ApiRuntime) -> Response:
    """The item's result bundle (a gzipped tar), streamed; its review in a header."""
    check_item(rt.db, item_id, caller)
    return bundle_api.get_bundle(rt, item_id)


def accept_bundle(
    item_id: ItemId, body: bundle_api.BundleDecision, caller: Reviewer, rt: ApiRuntime
) -> BundleReviewed:
    """Accept the result bundle held for review, the one ``sha256`` names, once the item has
    ended; the item's own state does not change."""
    check_item(rt.db, item_id, caller)
    return bundle_api.decide(rt, item_id, BundleReview.ACCEPTED, body)


def reject_bundle(
    item_id: ItemId, body: bundle_api.BundleDecision, caller: Reviewer, rt: ApiRuntime
) -> BundleReviewed:
    """Reject the result bundle held for review, the one ``sha256`` names, once the item has
    ended; the item's own state does not change."""
    check_item(rt.db, item_id, caller)
    return bundle_api.decide(rt, item_id, BundleReview.REJECTED, body)


def cancel(item_id: ItemId, caller: Dispatcher, rt: ApiRuntime) -> Cancelled:
    """Cancel an item that has not finished; its runner stops at its next heartbeat."""
    check_item(rt.db, item_id, caller)
    try:
        state, _ = cancel_item(rt.db, item_id, actor=ACTOR)
    except LookupError as exc:
        raise HTTPException(status_code=404, detail="work item not found") from exc
    return Cancelled(id=item_id, state=state)


def create_profile(
    body: admin.ProfileCreate,
    _: Annotated[Principal, Depends(deployment_admin)],
    rt: ApiRuntime,
) -> ProfileRow:
    return ProfileRow.model_validate(admin.create_profile(rt.db, body))


def list_profiles(_: Lister, rt: ApiRuntime) -> ProfileList:
    return ProfileList.model_validate({"profiles": admin.list_profiles(rt.db)})


def create_pool(body: admin.PoolCreate, caller: Administrator, rt: ApiRuntime) -> PoolRow:
    if not caller.is_deployment_admin:
        raise HTTPException(status_code=403, detail=POOLS_ARE_THE_DEPLOYMENTS)
    try:
        return PoolRow.model_validate(admin.create_pool(rt.db, body))
    except admin.CapacityPlacementError as exc:
        raise placement_error(exc) from exc
    except admin.AdminError as exc:
        raise HTTPException(status_code=409, detail=exc.message) from exc


def list_pools(caller: Lister, rt: ApiRuntime, org: OrgFilter = None) -> PoolList:
    pools = admin.list_pools(rt.db, caller.org_filter(org))
    return PoolList.model_validate({"pools": pools})


def get_costs(
    caller: Lister,
    rt: ApiRuntime,
    org: OrgFilter = None,
    since: Annotated[str | None, Query(description="24h, 7d, or an ISO 8601 time")] = None,
    by: CostGrouping = CostGrouping.PROVIDER,
) -> CostView:
    """Cost totals from the ledger, grouped by pool, provider, project or org."""
    try:
        start = parse_since(since) if since else None
    except ValueError as exc:  # its message shows the accepted forms, never the value
        raise InvalidRequest("query.since", str(exc)) from exc
    return CostView.model_validate(
        views.cost_view(rt.db, by=by, org_id=caller.org_filter(org), since=start)
    )


def get_sandboxes(
    caller: Lister,
    rt: ApiRuntime,
    status: Annotated[list[SandboxState] | None, Query()] = None,
    org: OrgFilter = None,
    limit: Annotated[int, Query(ge=1, le=1000)] = 50,
) -> SandboxList:
    """Sandboxes, newest first, optionally only in the given statuses."""
    statuses = [s.value for s in status] if status else None
    db, org_id = rt.db, caller.org_filter(org)
    rows = views.list_sandboxes(db, statuses=statuses, org_id=org_id, limit=limit)
    return SandboxList.model_validate({"sandboxes": rows})
