"""The ``webhook`` sink: an org's event POSTed to its endpoint, signed with its secret.

The body is JSON: ``{"id", "type", "created_at", "data"}`` (``id``: the event's id, the same
on every delivery of it; ``data``: the item's final record, or what the event's row carries:
a sandbox's end, a budget's crossing). The headers say who sent it
and when: ``Corral-Webhook-Id`` (the event id), ``Corral-Webhook-Timestamp`` (Unix seconds
of this delivery) and ``Corral-Webhook-Signature`` (``v1=`` and the hex HMAC-SHA256, keyed
with the endpoint's secret, of ``f"{timestamp}.{body}"``). A 2xx answer delivers it; any
other, or no answer, is a failure the deliverer tries again, backing off (docs/webhooks.md).
An endpoint removed since the event was owed is sent nothing: the event is dropped. Each
try made is noted in the delivery log (corral.shared.store.webhook_log).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from corral.providers.egress.rules import HostRule, parse_host_rules
from corral.shared.keyring import keyring_of
from corral.shared.settings import WebhookSettings
from corral.shared.store import webhook_log, webhooks
from corral.shared.store.db import Database, utcnow
from corral.shared.store.outbox import OutboxRow
from corral.worker.outcome_sinks import webhook_transport
from corral.worker.outcome_sinks.base import OutcomeDeliveryError, OutcomeSink
from corral.worker.outcome_sinks.webhook_transport import Answer

log = logging.getLogger(__name__)

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
        self._keyring = keyring_of(settings)
        self._openings = parse_host_rules(settings.webhook_openings)
        self._transport = transport
        self._clock = clock

    def deliver(self, target: Mapping[str, Any], record: Mapping[str, Any]) -> None:
        _check(self._post(target, record))

    def deliver_row(self, row: OutboxRow, record: Mapping[str, Any]) -> None:
        """:meth:`deliver`, each try noted in the delivery log (corral.shared.store.webhook_log)
        once made: the endpoint's status, or the error that stood for one."""
        try:
            answer = self._post(row.target, record)
        except Exception as exc:
            self._note(row, None, f"{type(exc).__name__}: {exc}")
            raise
        if answer is not None:
            self._note(row, answer.status, None)
        _check(answer)

    def _post(self, target: Mapping[str, Any], record: Mapping[str, Any]) -> Answer | None:
        """The endpoint's answer to the event; None when the endpoint was removed since
        (owed nothing more: the event is dropped, no POST made)."""
        with self._db.session() as session:
            endpoint = webhooks.signing_target(session, self._keyring, target["endpoint_id"])
        if endpoint is None:
            return None
        body = event_body(target, record)
        headers = signed_headers(endpoint.secret, target["event_id"], body, now=self._clock())
        return self._transport(endpoint.url, headers, body, self._openings)

    def _note(self, row: OutboxRow, status: int | None, error: str | None) -> None:
        # The try was made: a log that cannot be written loses its line, not the delivery.
        try:
            webhook_log.record_try(self._db, row, webhook_log.Try(status, error, utcnow()))
        except Exception:
            log.warning("webhook try not logged", exc_info=True)


def _check(answer: Answer | None) -> None:
    """Raise unless ``answer`` delivered the event (a 2xx) or there was none to give.

    Raises:
        OutcomeDeliveryError: the endpoint answered another status.
    """
    if answer is not None and not 200 <= answer.status < 300:
        moved = " (redirects are not followed)" if 300 <= answer.status < 400 else ""
        raise OutcomeDeliveryError(f"the webhook endpoint answered {answer.status}{moved}")
