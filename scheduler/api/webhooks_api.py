"""The admin api's routes for an org's webhook endpoints (corral.shared.store.webhooks).

Every route needs the admin scope: the deployment admin token, or an org key with ``admin``
acting on its own org (another org's answer 404). Making an endpoint answers its signing
secret, that once; listing never shows it. 409 without ``CORRAL_SECRET_KEY`` (the secret is
stored sealed with it), 422 for an invalid URL or event list.
"""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Literal

from fastapi import APIRouter, HTTPException, Path
from pydantic import BaseModel, ConfigDict, Field

from corral.providers.credentials import CredentialCipher
from corral.scheduler.admin.responses import Answer, Deleted
from corral.scheduler.api.admin_api import Administrator, OrgId
from corral.scheduler.api.auth import check_org
from corral.scheduler.api.bodies import StrictJSONRoute
from corral.scheduler.api.http_errors import InvalidRequest
from corral.scheduler.api.process_runtime import ApiRuntime
from corral.shared.store import webhooks
from corral.shared.text import IDENTIFIER

router = APIRouter(route_class=StrictJSONRoute)
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
    events: list[Literal["item.final"]] = Field(
        default=["item.final"], min_length=1, max_length=len(webhooks.EVENTS)
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
    cipher = CredentialCipher(rt.settings.secret_key)
    allow_http = rt.settings.webhook_allow_http
    with rt.db.session() as session:
        try:
            document, secret = webhooks.create_endpoint(
                session, cipher, org, body.url, body.events, allow_http=allow_http
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
    org: OrgId,
    webhook_id: Annotated[str, Path(pattern=IDENTIFIER)],
    caller: Administrator,
    rt: ApiRuntime,
) -> Deleted:
    """Remove one of the org's endpoints: it is sent nothing more (events still owed to it
    are dropped)."""
    check_org(org, caller)
    with rt.db.session() as session:
        if not webhooks.remove_endpoint(session, org, webhook_id):
            raise HTTPException(status_code=404, detail="no such live webhook")
    return Deleted(id=webhook_id, deleted=True)
