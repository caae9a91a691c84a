"""Webhooks to an https:// endpoint, over a real loopback TLS server whose certificate a test
CA signed: the delivery checks the certificate against the process's trust store (its
default CA bundle; ``SSL_CERT_FILE`` names another, as docs/webhooks.md says), and the
certificate's names against the URL's host. An untrusted CA, or a certificate for another
name, delivers nothing: the event is tried again, the failure logged."""

from __future__ import annotations

import ssl
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from sqlalchemy import select

from corral.shared.store.db import Database
from corral.shared.store.models import ItemState, OutcomeOutbox, WebhookDelivery
from corral.worker.outcome_delivery import DeliveryReport, deliver_due
from corral.worker.outcome_sinks.webhook import WebhookSink
from tests.integration.test_webhook_delivery import ended_item, make_endpoint, webhook_settings
from tests.standins.kubernetes_tls import TlsFiles, write_tls_files
from tests.webhook_receivers import Receiver

Serving = Callable[[tuple[str, ...]], tuple[Receiver, TlsFiles]]


@pytest.fixture
def tls_receiver(tmp_path: Path) -> Iterator[Serving]:
    """``serve(hosts)``: a loopback HTTPS receiver whose certificate, for ``hosts``, a CA
    of its own signed; the CA's files."""
    started: list[Receiver] = []

    def serve(hosts: tuple[str, ...]) -> tuple[Receiver, TlsFiles]:
        files = write_tls_files(tmp_path, hosts)
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.load_cert_chain(files.cert, files.key)
        receiver = Receiver(tls=context)
        started.append(receiver)
        return receiver, files

    yield serve
    for receiver in started:
        receiver.stop()


def _deliver(db: Database, receiver: Receiver) -> DeliveryReport:
    settings = webhook_settings(f"127.0.0.1:{receiver.port}")
    return deliver_due(db, {"webhook": WebhookSink(db, settings)}, settings)


def _failure(db: Database) -> tuple[str, str]:
    """The outbox row's last error and the logged try's, of the one event."""
    with db.session() as session:
        row = session.scalars(select(OutcomeOutbox)).one()
        logged = session.scalars(select(WebhookDelivery)).one()
    assert logged.status is None
    return str(row.last_error), str(logged.error)


def test_an_https_endpoint_whose_ca_is_trusted_is_delivered_signed(
    sqlite_db: Database, tls_receiver: Serving, monkeypatch: pytest.MonkeyPatch
) -> None:
    receiver, files = tls_receiver(("127.0.0.1",))
    assert receiver.url.startswith("https://")
    secret = make_endpoint(sqlite_db, "acme", receiver.url)
    item_id = ended_item(sqlite_db, "acme", ItemState.SUCCEEDED)
    monkeypatch.setenv("SSL_CERT_FILE", str(files.ca_cert))
    assert len(_deliver(sqlite_db, receiver).delivered) == 1
    [event] = receiver.verified(secret)
    assert event["data"]["id"] == item_id


def test_a_certificate_of_an_untrusted_ca_delivers_nothing(
    sqlite_db: Database, tls_receiver: Serving, monkeypatch: pytest.MonkeyPatch
) -> None:
    receiver, _ = tls_receiver(("127.0.0.1",))
    make_endpoint(sqlite_db, "acme", receiver.url)
    ended_item(sqlite_db, "acme", ItemState.SUCCEEDED)
    monkeypatch.delenv("SSL_CERT_FILE", raising=False)  # the system's roots alone
    assert len(_deliver(sqlite_db, receiver).retried) == 1
    assert receiver.deliveries() == []
    last_error, logged = _failure(sqlite_db)
    assert (
        last_error
        == logged
        == "OutcomeDeliveryError: the webhook POST failed: " + ("SSLCertVerificationError")
    )


def test_a_certificate_for_another_name_delivers_nothing(
    sqlite_db: Database, tls_receiver: Serving, monkeypatch: pytest.MonkeyPatch
) -> None:
    receiver, files = tls_receiver(("hooks.example.com",))  # not 127.0.0.1, the URL's host
    make_endpoint(sqlite_db, "acme", receiver.url)
    ended_item(sqlite_db, "acme", ItemState.SUCCEEDED)
    monkeypatch.setenv("SSL_CERT_FILE", str(files.ca_cert))
    assert len(_deliver(sqlite_db, receiver).retried) == 1
    assert receiver.deliveries() == []
    assert _failure(sqlite_db)[0].endswith("SSLCertVerificationError")
