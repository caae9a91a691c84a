"""Key rotation: every sealed value in the database sealed again under the current key.

``corral secret-key rotate`` walks each table that holds sealed values (work items'
payloads, named secrets, provider credentials and configurations, webhook secrets) in batches
of rows, each batch in one transaction that locks its rows (``FOR UPDATE`` on PostgreSQL, the
database's own lock on SQLite), opens every value that depends on an old key or format
(with ``CORRAL_SECRET_KEY_PREVIOUS``) and seals it again in its place. A write that races
it waits for the lock and is not lost; a row already under the current key is left alone,
so the rotation can be run again, or while the stack runs. ``corral secret-key check``
counts what still depends on an old key without writing; when it finds nothing the
previous keys can be dropped.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import ColumnElement, String, cast, select
from sqlalchemy.orm import InstrumentedAttribute, Session

from corral.shared.errors import SecretKeyMismatchError
from corral.shared.keyring import SEALED_V1, SEALED_V2, Keyring, Purpose
from corral.shared.store.db import Database
from corral.shared.store.models import (
    NamedSecret,
    ProviderCredential,
    StoredProviderConfig,
    WebhookEndpoint,
    WorkItem,
)
from corral.shared.store.sealing import resealed

BATCH = 200

# Seals a row's values that need it again, in place; whether it changed anything. Raises
# SecretKeyMismatchError when one cannot be opened.
Reseal = Callable[[Any, Keyring], bool]


@dataclass(frozen=True)
class _Table:
    name: str
    model: Any
    key: InstrumentedAttribute[Any]
    sealed_in: InstrumentedAttribute[Any]
    reseal: Reseal


@dataclass
class Report:
    """What a rotation (or a check) found, per table: values sealed again, and the rows
    that still depend on an old key (with why; never a value)."""

    resealed: dict[str, int] = field(default_factory=dict)
    stale: dict[str, list[str]] = field(default_factory=dict)
    unopened: dict[str, list[tuple[str, str]]] = field(default_factory=dict)

    @property
    def done(self) -> bool:
        """Whether nothing depends on a previous key any more: it can be dropped."""
        return not any(self.stale.values()) and not any(self.unopened.values())


def _payload(item: WorkItem, keyring: Keyring) -> bool:
    again = resealed(item.payload or {}, keyring, item.org_id, item.id)
    if again is None:
        return False
    item.payload = again
    return True


def _text(keyring: Keyring, sealed: str, purpose: Purpose, *place: str) -> str | None:
    if not keyring.needs_reseal(sealed):
        return None
    return keyring.seal(keyring.open(sealed, purpose, *place), purpose, *place)


def _column(row: Any, column: str, keyring: Keyring, purpose: Purpose, *place: str) -> bool:
    """A ``bytes`` column of ``row`` sealed again in place; whether it needed it."""
    again = _text(keyring, getattr(row, column).decode(), purpose, *place)
    if again is not None:
        setattr(row, column, again.encode())
    return again is not None


def _credential(row: ProviderCredential, keyring: Keyring) -> bool:
    return _column(row, "ciphertext", keyring, Purpose.CREDENTIAL, row.org_id, row.provider_id)


def _config(row: StoredProviderConfig, keyring: Keyring) -> bool:
    sealed = row.config.get("sealed") if set(row.config) == {"sealed"} else None
    if not isinstance(sealed, str):
        return False  # stored without a key: nothing sealed
    again = _text(keyring, sealed, Purpose.PROVIDER_CONFIG, row.provider_id)
    if again is None:
        return False
    row.config = {"sealed": again}
    return True


def _webhook(row: WebhookEndpoint, keyring: Keyring) -> bool:
    return _column(row, "secret_sealed", keyring, Purpose.WEBHOOK, row.org_id, row.id)


def _named(row: NamedSecret, keyring: Keyring) -> bool:
    return _column(row, "sealed", keyring, Purpose.NAMED, row.org_id, row.name)


TABLES = (
    _Table("work_items", WorkItem, WorkItem.id, WorkItem.payload, _payload),
    _Table("named_secrets", NamedSecret, NamedSecret.id, NamedSecret.sealed, _named),
    _Table(
        "provider_credentials",
        ProviderCredential,
        ProviderCredential.id,
        ProviderCredential.ciphertext,
        _credential,
    ),
    _Table(
        "provider_configs",
        StoredProviderConfig,
        StoredProviderConfig.provider_id,
        StoredProviderConfig.config,
        _config,
    ),
    _Table(
        "webhook_endpoints",
        WebhookEndpoint,
        WebhookEndpoint.id,
        WebhookEndpoint.secret_sealed,
        _webhook,
    ),
)


def rotate(db: Database, keyring: Keyring, *, batch: int = BATCH) -> Report:
    """Seal every value that depends on an old key or format again under the current key."""
    return _walk(db, keyring, batch=batch, write=True)


def check(db: Database, keyring: Keyring, *, batch: int = BATCH) -> Report:
    """What still depends on an old key or format (nothing is written)."""
    return _walk(db, keyring, batch=batch, write=False)


def _walk(db: Database, keyring: Keyring, *, batch: int, write: bool) -> Report:
    report = Report()
    for table in TABLES:
        report.resealed[table.name], report.stale[table.name] = 0, []
        report.unopened[table.name] = []
        for session, rows in _batches(db, table, batch, lock=write):
            for row in rows:
                row_id = str(getattr(row, table.key.key))
                try:
                    changed = table.reseal(row, keyring)
                except SecretKeyMismatchError as exc:
                    report.unopened[table.name].append((row_id, exc.code))
                    continue
                if changed and write:
                    report.resealed[table.name] += 1
                elif changed:
                    report.stale[table.name].append(row_id)
            if not write:
                session.expunge_all()  # a check writes nothing back
    return report


def _batches(
    db: Database, table: _Table, size: int, *, lock: bool
) -> Iterator[tuple[Session, list[Any]]]:
    """The table's rows that hold a sealed value, ``size`` at a time in key order, each
    batch in a transaction of its own (its rows locked when ``lock``)."""
    holds: ColumnElement[bool] = table.key.isnot(None)  # every row holds one (or v1 Fernet)
    if table.model is WorkItem:
        sealed = cast(table.sealed_in, String)
        holds = sealed.contains(SEALED_V2) | sealed.contains(SEALED_V1)
    after: Any = None
    while True:
        with db.session() as session:
            query = select(table.model).where(holds).order_by(table.key).limit(size)
            if after is not None:
                query = query.where(table.key > after)
            if lock:
                query = query.with_for_update()
            rows = list(session.scalars(query))
            if rows:
                yield session, rows
                after = getattr(rows[-1], table.key.key)
        if len(rows) < size:
            return
