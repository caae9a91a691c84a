"""Rows tests start from."""

from __future__ import annotations

import uuid

from corral.shared.db import Database
from corral.shared.models import ModelProfile, Pool


def org_with_pool(db: Database, prefix: str, *, max_concurrent: int = 10) -> str:
    """A new org (``prefix`` and a random part) with one local pool, ``local`` (id
    ``pool-<org>``), and the ``default`` profile (made if missing)."""
    org = f"{prefix}{uuid.uuid4().hex[:8]}"
    with db.session() as session:
        if session.get(ModelProfile, "default") is None:
            session.add(ModelProfile(name="default", model="m", auth_mode="byok"))
        session.add(
            Pool(
                id=f"pool-{org}",
                org_id=org,
                name="local",
                provider_id="local",
                max_concurrent=max_concurrent,
            )
        )
    return org


def in_memory_pool(db: Database, *, max_concurrent: int = 10) -> None:
    """The ``default`` profile and org ``acme``'s pool ``mem`` (id ``pool-mem``) of the
    in-memory provider, written straight into the tables: ``create_pool`` accepts only
    providers the registry knows."""
    with db.session() as session:
        if session.get(ModelProfile, "default") is None:
            session.add(ModelProfile(name="default", model="m", auth_mode="byok"))
        session.add(
            Pool(
                id="pool-mem",
                org_id="acme",
                name="mem",
                provider_id="in-memory",
                max_concurrent=max_concurrent,
                sandbox_config={},
            )
        )
