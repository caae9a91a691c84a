"""The deployment's provider configuration kept in the database.

An operator stores a provider's configuration with the admin api or
``corral providers config set``; it is validated against the provider's config model first
and then replaces that provider's ``CORRAL_PROVIDER_CONFIG`` entry in every process: a
process reads the stored one when it first builds the provider, and again at most every
``CORRAL_PROVIDER_CONFIG_REFRESH_S`` (:meth:`corral.shared.runtime.Runtime.provider`), so a
change takes effect at a provision that starts after that interval, without a restart.

At rest the configuration is sealed whole with ``CORRAL_SECRET_KEY`` (the key of the
credentials and of dispatch env values) when one is set: a configuration may hold secrets.
Without a key, only a configuration without secret fields can be stored (the admin api
checks it, :func:`corral.scheduler.admin.providers.set_config`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import delete, select

from corral.shared.keyring import Purpose
from corral.shared.settings import CommonSettings
from corral.shared.store.db import Database, utcnow
from corral.shared.store.models import StoredProviderConfig


@dataclass(frozen=True)
class EffectiveConfig:
    """A provider's configuration as its workers use it, and where it came from."""

    provider_id: str
    config: dict[str, Any]
    source: str  # "stored", "environment" (CORRAL_PROVIDER_CONFIG) or "default"
    updated_at: datetime | None = None


def load_stored(db: Database, provider_id: str) -> StoredProviderConfig | None:
    with db.session() as session:
        return session.get(StoredProviderConfig, provider_id)


def effective_config(db: Database, settings: CommonSettings, provider_id: str) -> EffectiveConfig:
    """The stored configuration, else the environment's entry, else the provider's defaults."""
    stored = load_stored(db, provider_id)
    if stored is not None:
        config = _opened(db, provider_id, stored.config)
        return EffectiveConfig(provider_id, config, "stored", stored.updated_at)
    entry = settings.provider_config.get(provider_id)
    if entry is not None:
        return EffectiveConfig(provider_id, dict(entry), "environment")
    return EffectiveConfig(provider_id, {}, "default")


def store(db: Database, provider_id: str, config: dict[str, Any]) -> datetime:
    """Store (or replace) the provider's configuration; the caller has validated it."""
    now = utcnow()
    config = _at_rest(db, provider_id, config)
    with db.session() as session:
        row = session.get(StoredProviderConfig, provider_id, with_for_update=True)
        if row is None:
            session.add(
                StoredProviderConfig(provider_id=provider_id, config=config, updated_at=now)
            )
        else:
            row.config = config
            row.updated_at = now
    return now


def remove(db: Database, provider_id: str) -> bool:
    """Forget the stored configuration (back to the environment's); whether there was one."""
    with db.session() as session:
        deleted = session.execute(
            delete(StoredProviderConfig).where(StoredProviderConfig.provider_id == provider_id)
        )
        return bool(getattr(deleted, "rowcount", 0))


def stored_ids(db: Database) -> list[str]:
    with db.session() as session:
        return list(session.scalars(select(StoredProviderConfig.provider_id)))


_SEALED = "sealed"  # the one key of a sealed configuration


def _at_rest(db: Database, provider_id: str, config: dict[str, Any]) -> dict[str, Any]:
    if not db.sealer.can_seal:
        return dict(config)
    text = json.dumps(config, sort_keys=True)
    return {_SEALED: db.sealer.seal_text(text, Purpose.PROVIDER_CONFIG, provider_id)}


def _opened(db: Database, provider_id: str, stored: dict[str, Any]) -> dict[str, Any]:
    if set(stored) == {_SEALED} and isinstance(stored[_SEALED], str):
        text = db.sealer.open_text(stored[_SEALED], Purpose.PROVIDER_CONFIG, provider_id)
        opened: dict[str, Any] = json.loads(text)
        return opened
    return dict(stored)
