"""Rows tests start from."""

from __future__ import annotations

import uuid
from datetime import datetime

from corral.providers.base import SandboxHandle
from corral.shared.settings import CoreSettings
from corral.shared.store import warm
from corral.shared.store.db import Database, utcnow
from corral.shared.store.models import ModelProfile, Pool, WarmSandbox

# The settings of a test that routes without a runtime of its own: the defaults, as a
# process started in the test environment reads them.
SETTINGS = CoreSettings()


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


def enrolled_warm_sandboxes(
    db: Database,
    count: int,
    *,
    pool_id: str,
    org_id: str,
    provider_id: str,
    created_at: datetime | None = None,
) -> list[tuple[str, str]]:
    """``count`` warm sandboxes of the pool, made (their handles recorded) and enrolled,
    waiting to be bound: (warm id, channel token) each."""
    result = []
    for _ in range(count):
        warm_id = warm.new_warm_id()
        with db.session() as session:
            session.add(
                WarmSandbox(
                    id=warm_id,
                    pool_id=pool_id,
                    org_id=org_id,
                    provider_id=provider_id,
                    state="booting",
                    created_at=created_at or utcnow(),
                )
            )
        taken = warm.take_for_provision(db, warm_id)
        assert taken is not None
        handle = SandboxHandle(provider_id=provider_id, external_id=warm_id)
        assert warm.record_made(db, warm_id, handle)
        with db.session() as session:
            channel = warm.enrol(session, taken[2])
        assert channel is not None
        result.append((warm_id, channel))
    return result


def received_item(db: Database, org: str = "acme", command: str = "echo hi") -> str:
    """A shell item of ``org`` (project ``web``, profile ``default``) as the intake writes
    it: ``received``, and nothing routes it here."""
    from corral.scheduler.intake import accept
    from corral.shared.messages import DispatchRequest

    message = {
        "org": org,
        "project": "web",
        "profile": "default",
        "work": {"kind": "shell", "command": command},
    }
    return accept(db, DispatchRequest.model_validate(message), actor="test").item_id


def admitted_item(db: Database, org: str, **fields: object) -> str:
    """A ``true`` shell item of ``org`` (project ``p``, profile ``default``; the message's
    other ``fields``) through the intake's batch path: routed to a pool with room, or
    waiting for one."""
    from corral.scheduler.batch import accept_batch
    from corral.shared.messages import DispatchRequest

    message = {
        "org": org,
        "project": "p",
        "profile": "default",
        "work": {"kind": "shell", "command": "true"},
        **fields,
    }
    [taken] = accept_batch(
        db, [DispatchRequest.model_validate(message)], actor="test", settings=SETTINGS
    )
    return taken.item_id
