"""The ``webhook`` sink: an org's event POSTed to its endpoint, signed with its secret.

The body is JSON: ``{"id", "type", "created_at", "data"}`` (``id``: the event's id, the same
on every delivery of it; ``data``: the item's final record). The headers say who sent it
and when: ``Corral-Webhook-Id`` (the event id), ``Corral-Webhook-Timestamp`` (Unix seconds
of this delivery) and ``Corral-Webhook-Signature`` (``v1=`` and the hex HMAC-SHA256, keyed
with the endpoint's secret, of ``f"{timestamp}.{body}"``). A 2xx answer delivers it; any
other, or no answer, is a failure the deliverer tries again, backing off (docs/webhooks.md).
An endpoint removed since the event was owed is sent nothing: the event is dropped.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from corral.providers.credentials import CredentialCipher
from corral.providers.egress.rules import HostRule, parse_host_rules
from corral.shared.settings import WebhookSettings
from corral.shared.store import webhooks
from corral.shared.store.db import Database
from corral.worker.outcome_sinks import webhook_transport
from corral.worker.outcome_sinks.base import OutcomeDeliveryError, OutcomeSink
from corral.worker.outcome_sinks.webhook_transport import Answer

SIGNATURE_VERSION = "v1"
USER_AGENT = "corral-webhooks/1"
Transport = Callable[[str, Mapping[str, str], bytes, Sequence[HostRule]], Answer]


def signature(secret: str, timestamp: str, body: bytes) -> str:
    """The ``Corral-Webhook-Signature`` value of ``body`` sent at ``timestamp``."""
    signed = timestamp.encode() + b"." + body
    digest = hmac.new(secret.encode(), signed, hashlib.sha256).hexdigest()
    return f"{SIGNATURE_VERSION}={digest}"


def event_body(target: Mapping[str, Any], record: Mapping[str, Any]) -> bytes:
    """The JSON body of the event ``target`` names, carrying ``record``."""
    event = {
        "id": target["event_id"],
        "type": target["type"],
        "created_at": target["created_at"],
        "data": dict(record),
    }
    return json.dumps(event, separators=(",", ":"), sort_keys=True, default=str).encode()


def signed_headers(secret: str, event_id: str, body: bytes, *, now: float) -> dict[str, str]:
    """The headers of one delivery of ``body`` at ``now`` (Unix seconds)."""
    timestamp = str(int(now))
    return {
        "Content-Type": "application/json",
        "User-Agent": USER_AGENT,
        "Corral-Webhook-Id": event_id,
        "Corral-Webhook-Timestamp": timestamp,
        "Corral-Webhook-Signature": signature(secret, timestamp, body),
    }


class WebhookSink(OutcomeSink):
    """POSTs events to the endpoints the outbox rows name, read from ``db``.

    ``transport`` makes the POST (webhook_transport.post: an address-checked connection);
    ``clock`` gives the delivery's timestamp.
    """

    name = webhooks.WEBHOOK

    def __init__(
        self,
        db: Database,
        settings: WebhookSettings,
        *,
        transport: Transport = webhook_transport.post,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._db = db
        key = settings.secret_key
        self._cipher = CredentialCipher(key) if key is not None else None
        self._openings = parse_host_rules(settings.webhook_openings)
        self._transport = transport
        self._clock = clock

    def deliver(self, target: Mapping[str, Any], record: Mapping[str, Any]) -> None:
        with self._db.session() as session:
            endpoint = webhooks.signing_target(session, self._cipher, target["endpoint_id"])
        if endpoint is None:
            return  # removed since: owed nothing more
        body = event_body(target, record)
        headers = signed_headers(endpoint.secret, target["event_id"], body, now=self._clock())
        answer = self._transport(endpoint.url, headers, body, self._openings)
        if not 200 <= answer.status < 300:
            moved = " (redirects are not followed)" if 300 <= answer.status < 400 else ""
            raise OutcomeDeliveryError(f"the webhook endpoint answered {answer.status}{moved}")
