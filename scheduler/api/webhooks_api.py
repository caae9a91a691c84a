"""The admin api's routes for an org's webhook endpoints (corral.shared.store.webhooks), their
delivery log and redelivery (corral.shared.store.webhook_log).

Every route needs the admin scope: the deployment admin token, or an org key with ``admin``
acting on its own org (another org's answer 404). Making an endpoint answers its signing
secret, that once; listing never shows it. 409 without ``CORRAL_SECRET_KEY`` (the secret is
stored sealed with it), 422 for an invalid URL or event list. A redelivery answers 404 for an
event neither the log nor the outbox knows, 409 when its endpoint was removed.
"""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Any, Literal

from fastapi import APIRouter, HTTPException, Path, Query
from pydantic import BaseModel, ConfigDict, Field

from corral.scheduler.admin.responses import Answer, Deleted
from corral.scheduler.api.admin_api import Administrator, OrgId
from corral.scheduler.api.auth import check_org
from corral.scheduler.api.bodies import StrictJSONRoute
from corral.scheduler.api.http_errors import InvalidRequest
from corral.scheduler.api.process_runtime import ApiRuntime
from corral.shared.keyring import required_keyring
from corral.shared.store import webhook_log, webhooks
from corral.shared.store.db import Database, utcnow
from corral.shared.text import IDENTIFIER

router = APIRouter(route_class=StrictJSONRoute)
WebhookId = Annotated[str, Path(pattern=IDENTIFIER, description="an endpoint's id (wh-...)")]
EventId = Annotated[str, Path(pattern=IDENTIFIER, description="an event's id (evt_...)")]
KEY_NEEDED = (
    "webhook endpoints need CORRAL_SECRET_KEY: their signing secrets are stored sealed with "
    "it; generate one with `corral secret-key` and set it on every process"
)


class WebhookBody(BaseModel):
    model_config = ConfigDict(extra="forbid")

    url: str = Field(
        min_length=1,
        max_length=webhooks.MAX_URL,
        description="https:// (http:// only where CORRAL_WEBHOOK_ALLOW_HTTP is set); the "
        "address must be one sandbox egress may reach, or CORRAL_WEBHOOK_OPEN_NETWORKS's",
    )
    events: list[webhooks.EventType] = Field(
        default=["item.final"],
        min_length=1,
        max_length=len(webhooks.EVENTS),
        description="item.final (every final state, dispatch errors included), "
        "item.dispatch_error (those alone), sandbox.ended, budget.threshold",
    )


class WebhookRow(Answer):
    id: str
    org_id: str
    url: str
    events: list[str]
    created_at: datetime
    disabled_at: datetime | None = Field(description="when it was removed; null: live")


class WebhookCreated(WebhookRow):
    secret: str = Field(
        description="the signing secret (whsec_...): shown this once, stored sealed"
    )


class WebhookList(Answer):
    webhooks: list[WebhookRow]


@router.post("/v1/admin/orgs/{org}/webhooks", status_code=201)
def create_webhook(
    org: OrgId, body: WebhookBody, caller: Administrator, rt: ApiRuntime
) -> WebhookCreated:
    """A new webhook endpoint of the org, sent the events it lists, each signed with its
    secret; the answer is the only place the secret appears (docs/webhooks.md)."""
    check_org(org, caller)
    if rt.settings.secret_key is None:
        raise HTTPException(status_code=409, detail=KEY_NEEDED)
    keyring = required_keyring(rt.settings)
    allow_http = rt.settings.webhook_allow_http
    with rt.db.session() as session:
        try:
            document, secret = webhooks.create_endpoint(
                session, keyring, org, body.url, body.events, allow_http=allow_http
            )
        except webhooks.WebhookError as exc:
            raise InvalidRequest("url", exc.message) from exc
    return WebhookCreated.model_validate({**document, "secret": secret})


@router.get("/v1/admin/orgs/{org}/webhooks")
def list_webhooks(org: OrgId, caller: Administrator, rt: ApiRuntime) -> WebhookList:
    """The org's webhook endpoints, removed ones included; never their secrets."""
    check_org(org, caller)
    with rt.db.session() as session:
        rows = webhooks.list_endpoints(session, org)
    return WebhookList.model_validate({"webhooks": rows})


@router.delete("/v1/admin/orgs/{org}/webhooks/{webhook_id}")
def remove_webhook(
    org: OrgId, webhook_id: WebhookId, caller: Administrator, rt: ApiRuntime
) -> Deleted:
    """Remove one of the org's endpoints: it is sent nothing more (events still owed to it
    are dropped)."""
    check_org(org, caller)
    with rt.db.session() as session:
        if not webhooks.remove_endpoint(session, org, webhook_id):
            raise HTTPException(status_code=404, detail="no such live webhook")
    return Deleted(id=webhook_id, deleted=True)


class DeliveryRow(Answer):
    id: int = Field(description="the try's id: newer tries have larger ones")
    endpoint_id: str
    event_id: str = Field(description="the same on every try of one event, redeliveries too")
    event_type: str
    work_item_id: str | None = Field(description="null: an event of no item (budget.threshold)")
    attempt: int = Field(description="the try's number, counted anew after a redelivery")
    status: int | None = Field(description="the endpoint's HTTP status; null: no answer")
    error: str | None = Field(description="why there was no answer (refused, unreachable, ...)")
    at: datetime
    owed: Literal["pending", "given_up"] | None = Field(
        description="the event, as its outbox row holds it now: pending (tried again), "
        "given_up, or null (delivered, or dropped)"
    )


class DeliveryLog(Answer):
    deliveries: list[DeliveryRow] = Field(description="newest first")
    next_before: int | None = Field(description="?before= for the next, older page; null: none")


class Redelivered(Answer):
    event_id: str
    endpoint_id: str
    event_type: str
    due_at: datetime


@router.get("/v1/admin/orgs/{org}/webhooks/{webhook_id}/deliveries")
def webhook_deliveries(
    org: OrgId,
    webhook_id: WebhookId,
    caller: Administrator,
    rt: ApiRuntime,
    *,
    limit: Annotated[int, Query(ge=1, le=webhook_log.MAX_PAGE)] = 50,
    before: Annotated[int | None, Query(ge=1, description="tries older than this one")] = None,
) -> DeliveryLog:
    """The tries at delivering the endpoint's events, newest first (each kept
    CORRAL_WEBHOOK_LOG_KEEP_S)."""
    check_org(org, caller)
    with rt.db.session() as session:
        if webhooks.endpoint_of(session, org, webhook_id) is None:
            raise HTTPException(status_code=404, detail="no such webhook")
        rows = webhook_log.deliveries(session, org, webhook_id, limit=limit, before=before)
    older = rows[-1]["id"] if len(rows) == limit else None
    return DeliveryLog.model_validate({"deliveries": rows, "next_before": older})


@router.post("/v1/admin/orgs/{org}/webhooks/events/{event_id}/redeliver", status_code=202)
def redeliver_event(
    org: OrgId, event_id: EventId, caller: Administrator, rt: ApiRuntime
) -> Redelivered:
    """Send one of the org's events again, with its own id (a receiver that has it may
    answer 2xx and do nothing), whether it was delivered or given up."""
    check_org(org, caller)
    return Redelivered.model_validate(redeliver(rt.db, org, event_id))


def redeliver(db: Database, org: str, event_id: str) -> dict[str, Any]:
    """webhook_log.redeliver, now, its refusals as answers: 404 for an event neither the
    log nor the outbox knows (another org's alike), 409 when its endpoint was removed."""
    with db.session() as session:
        try:
            return webhook_log.redeliver(session, org, event_id, now=utcnow())
        except webhook_log.UnknownEventError as exc:
            raise HTTPException(status_code=404, detail=exc.message) from exc
        except webhook_log.EndpointRemovedError as exc:
            raise HTTPException(status_code=409, detail=exc.message) from exc
