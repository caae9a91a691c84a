"""Org webhook endpoints: where an org's events are POSTed, signed with a secret of its own.

An endpoint is a URL (``https://``; ``http://`` only where the deployment allows it,
``CORRAL_WEBHOOK_ALLOW_HTTP``), the event types it is sent, and a signing secret corral
generates (``whsec_...``), shown once when the endpoint is made and stored sealed with the
deployment's secret key (``CORRAL_SECRET_KEY``), never in clear. Removing an endpoint keeps
its row, disabled: it is sent nothing more, and events still owed to it are dropped.

Events (:data:`EVENTS`) are rows of the outcome outbox (corral.shared.store.outbox, sink
``webhook``), written in the transaction of the change that caused them; :func:`subscribed`
says which endpoints an org's event is owed to. corral.worker.outcome_sinks.webhook delivers
them, and notes each try in the delivery log (corral.shared.store.webhook_log).
"""

from __future__ import annotations

import secrets
import uuid
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, get_args
from urllib.parse import urlsplit

from sqlalchemy import ColumnElement, select
from sqlalchemy.orm import Session

from corral.shared.errors import CorralError
from corral.shared.keyring import Keyring, Purpose
from corral.shared.store.db import utcnow
from corral.shared.store.models import WebhookEndpoint

WEBHOOK = "webhook"  # the outbox sink of webhook events
ITEM_FINAL = "item.final"  # a work item reached a final state (dispatch errors included)
ITEM_DISPATCH_ERROR = "item.dispatch_error"  # of those, a dispatch error alone
SANDBOX_ENDED = "sandbox.ended"  # a sandbox ended and was billed: its reason, time and cost
BUDGET_THRESHOLD = "budget.threshold"  # a budget's spend reached one of its thresholds
EventType = Literal["item.final", "item.dispatch_error", "sandbox.ended", "budget.threshold"]
EVENTS: tuple[str, ...] = get_args(EventType)  # in the order an endpoint's events are kept
SECRET_PREFIX = "whsec_"  # noqa: S105 - the prefix of generated secrets, not one
MAX_URL = 2048
MAX_ENDPOINTS = 20  # live endpoints of one org at most: each event is owed to each


class WebhookError(CorralError, ValueError):
    """the webhook endpoint was refused"""

    code = "webhook_invalid"


@dataclass(frozen=True)
class SigningTarget:
    """Where an endpoint's events go, and the secret that signs them (opened)."""

    url: str
    secret: str


def check_url(url: str, *, allow_http: bool) -> str:
    """``url`` as an endpoint's URL.

    Raises:
        WebhookError: not an absolute https URL (or http, with ``allow_http``) with a host,
            or it carries credentials or a fragment. The message never quotes the URL.
    """
    text = url.strip()
    if not text or len(text) > MAX_URL:
        raise WebhookError(f"the URL must be 1-{MAX_URL} characters")
    parts = urlsplit(text)
    schemes = ("https", "http") if allow_http else ("https",)
    if parts.scheme not in schemes:
        shown = " or ".join(f"{s}://" for s in schemes)
        raise WebhookError(f"the URL must start with {shown} (CORRAL_WEBHOOK_ALLOW_HTTP)")
    try:
        parts.port  # noqa: B018 - read to check it
    except ValueError as exc:
        raise WebhookError("the URL's port must be a number from 1 to 65535") from exc
    if not parts.hostname:
        raise WebhookError("the URL must name a host")
    if parts.username is not None or parts.password is not None:
        raise WebhookError("the URL may not carry a user name or password")
    if parts.fragment:
        raise WebhookError("the URL may not carry a #fragment")
    return text


def check_events(events: Iterable[str]) -> list[str]:
    """``events``, without repeats, in the order of :data:`EVENTS`.

    Raises:
        WebhookError: none given, or one that is not in :data:`EVENTS`.
    """
    wanted = set(events)
    unknown = wanted - set(EVENTS)
    if not wanted or unknown:
        raise WebhookError(f"events must be one or more of: {', '.join(EVENTS)}")
    return [event for event in EVENTS if event in wanted]


def endpoint_document(row: WebhookEndpoint) -> dict[str, Any]:
    """An endpoint as the admin api and the CLI show it: never its secret."""
    return {
        "id": row.id,
        "org_id": row.org_id,
        "url": row.url,
        "events": row.events.split(","),
        "created_at": row.created_at,
        "disabled_at": row.disabled_at,
    }


def create_endpoint(
    session: Session,
    keyring: Keyring,
    org_id: str,
    url: str,
    events: Iterable[str],
    *,
    allow_http: bool,
) -> tuple[dict[str, Any], str]:
    """A new endpoint of ``org_id``: ``(its document, its signing secret)``. The secret is
    stored sealed with ``keyring``, bound to the org and the endpoint: this answer is the only
    place it appears in clear.

    Raises:
        WebhookError: an invalid URL or events, or the org has MAX_ENDPOINTS live ones.
    """
    checked_url, checked_events = check_url(url, allow_http=allow_http), check_events(events)
    if len(live_endpoints(session, [org_id])) >= MAX_ENDPOINTS:
        raise WebhookError(f"an org has at most {MAX_ENDPOINTS} webhook endpoints")
    secret = SECRET_PREFIX + secrets.token_urlsafe(32)
    endpoint_id = f"wh-{uuid.uuid4().hex[:16]}"
    row = WebhookEndpoint(
        id=endpoint_id,
        org_id=org_id,
        url=checked_url,
        events=",".join(checked_events),
        secret_sealed=seal_secret(keyring, org_id, endpoint_id, secret),
        created_at=utcnow(),
    )
    session.add(row)
    session.flush()
    return endpoint_document(row), secret


def list_endpoints(session: Session, org_id: str) -> list[dict[str, Any]]:
    """The org's endpoints, removed ones included, oldest first."""
    query = (
        select(WebhookEndpoint)
        .where(WebhookEndpoint.org_id == org_id)
        .order_by(WebhookEndpoint.created_at, WebhookEndpoint.id)
    )
    return [endpoint_document(row) for row in session.scalars(query)]


def remove_endpoint(session: Session, org_id: str, endpoint_id: str) -> bool:
    """Disable the org's endpoint: sent nothing more. Whether it had such a live one."""
    row = session.get(WebhookEndpoint, endpoint_id, with_for_update=True)
    if row is None or row.org_id != org_id or row.disabled_at is not None:
        return False
    row.disabled_at = utcnow()
    return True


def endpoint_of(session: Session, org_id: str, endpoint_id: str) -> WebhookEndpoint | None:
    """``org_id``'s endpoint ``endpoint_id``, removed or not; None for another org's."""
    row = session.get(WebhookEndpoint, endpoint_id)
    return row if row is not None and row.org_id == org_id else None


def live_endpoints(session: Session, org_ids: Sequence[str]) -> list[WebhookEndpoint]:
    """The live (not removed) endpoints of ``org_ids``."""
    if not org_ids:
        return []
    query = select(WebhookEndpoint).where(*_live(org_ids))
    return list(session.scalars(query.order_by(WebhookEndpoint.id)))


def _live(org_ids: Sequence[str]) -> tuple[ColumnElement[bool], ...]:
    return (
        WebhookEndpoint.org_id.in_(sorted(set(org_ids))),
        WebhookEndpoint.disabled_at.is_(None),
    )


def subscribed(session: Session, org_ids: Sequence[str], event: str) -> dict[str, list[str]]:
    """The ids of the live endpoints each org's ``event`` is owed to, by org."""
    found: dict[str, list[str]] = {}
    if not org_ids:
        return found
    query = select(WebhookEndpoint.id, WebhookEndpoint.org_id, WebhookEndpoint.events).where(
        *_live(org_ids)
    )
    # Core: asked at every end and final transition, and usually finding none.
    for row in session.connection().execute(query.order_by(WebhookEndpoint.id)):
        if event in row.events.split(","):
            found.setdefault(row.org_id, []).append(row.id)
    return found


def event_target(
    endpoint_id: str, event: str, created_at: str, data: Mapping[str, Any] | None = None
) -> dict[str, Any]:
    """An outbox row's target for one event to one endpoint; its ``event_id`` is made
    here, once, so every delivery of the row carries the same one. ``data``: what the
    event says, when it is fixed at the change (else the item's record, read at delivery)."""
    target = {
        "endpoint_id": endpoint_id,
        "event_id": f"evt_{uuid.uuid4().hex}",
        "type": event,
        "created_at": created_at,
    }
    return target if data is None else {**target, "data": dict(data)}


def signing_target(
    session: Session, keyring: Keyring | None, endpoint_id: str
) -> SigningTarget | None:
    """The URL and opened secret of a live endpoint; None once it is removed.

    Raises:
        WebhookError: no secret key to open its secret with.
        ConfigurationError: the secret was sealed with another secret key, or for another
            endpoint (:class:`~corral.shared.keyring.SealedElsewhereError`).
    """
    row = session.get(WebhookEndpoint, endpoint_id)
    if row is None or row.disabled_at is not None:
        return None
    if keyring is None:
        raise WebhookError("no CORRAL_SECRET_KEY to open the endpoint's signing secret with")
    return SigningTarget(row.url, open_secret(keyring, row.org_id, row.id, row.secret_sealed))


def seal_secret(keyring: Keyring, org_id: str, endpoint_id: str, secret: str) -> bytes:
    """An endpoint's signing secret as stored: sealed, bound to its org and endpoint."""
    return keyring.seal(secret, Purpose.WEBHOOK, org_id, endpoint_id).encode()


def open_secret(keyring: Keyring, org_id: str, endpoint_id: str, sealed: bytes) -> str:
    return keyring.open(sealed.decode(), Purpose.WEBHOOK, org_id, endpoint_id)
