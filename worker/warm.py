"""Making warm sandboxes, and beat's warm tick (docs/warm-pools.md).

``corral.warm.provision`` (a warm sandbox's id, nothing else) runs on the pool's provision
queue: the provider worker makes a sandbox whose runner holds only the enrolment
credential, handed to the provider exactly as a registration token is (the provider's
secret path: a pipe for the local provider), never in a task's arguments.
``corral.warm.tick`` (maintenance, on beat) ends stale and surplus warm sandboxes and sends
a ``corral.warm.provision`` for each one missing below a pool's ``warm_min``.
"""

from __future__ import annotations

import enum
import logging

from pydantic import SecretStr

from corral.providers.base import Egress, Resources, SandboxSpec
from corral.shared.errors import CorralError
from corral.shared.runtime import Runtime
from corral.shared.store import warm
from corral.shared.store.models import Pool, WarmSandbox
from corral.shared.store.pools import session_limit_s
from corral.worker.provision import mounts_api_socket, terminate_quietly

log = logging.getLogger(__name__)

# A warm sandbox's own deadline when neither its pool nor its provider caps sessions: the
# item it is bound to has its deadline in its sandbox row, which the reaper enforces.
UNCAPPED_SESSION_S = 86_400


class WarmOutcome(enum.StrEnum):
    MADE = "made"
    SKIPPED = "skipped"  # ended, or made already by another delivery
    FAILED = "failed"


def provision_warm(rt: Runtime, warm_id: str) -> WarmOutcome:
    """Make warm sandbox ``warm_id``; a second delivery of the task does nothing."""
    taken = warm.take_for_provision(rt.db, warm_id)
    if taken is None:
        return WarmOutcome.SKIPPED
    row, pool, enrolment = taken
    spec = warm_spec(rt, row, pool, enrolment)
    try:
        handle = rt.provider(row.provider_id).provision(spec)
    except Exception as exc:
        code = exc.code if isinstance(exc, CorralError) else "provider_error"
        log.warning(
            "a warm sandbox could not be made",
            extra={"sandbox_id": warm_id, "pool_id": pool.id, "code": code},
        )
        terminate_quietly(rt, warm.handle_of(row))
        warm.fail_boot(rt.db, warm_id, f"provision_failed:{code}")
        return WarmOutcome.FAILED
    if not warm.record_made(rt.db, warm_id, handle):
        terminate_quietly(rt, handle)  # ended while it was made (surplus, stuck)
        return WarmOutcome.SKIPPED
    return WarmOutcome.MADE


def warm_spec(rt: Runtime, row: WarmSandbox, pool: Pool, enrolment: str) -> SandboxSpec:
    """A sandbox of the pool's ``sandbox_config`` with the default egress (no network), its
    runner given ``enrolment`` where a cold one gets its registration token."""
    settings = rt.settings
    control_url = settings.control_url
    if mounts_api_socket(rt, pool.provider_id):
        control_url = f"unix://{settings.resolved_api_socket()}"
    session = session_limit_s(pool, None) or UNCAPPED_SESSION_S
    return SandboxSpec(
        work_item_id=row.id,
        sandbox_id=row.id,
        org_id=row.org_id,
        project_id="warm",
        registration_token=SecretStr(enrolment),
        control_url=control_url,
        resources=Resources(timeout_s=pool.warm_idle_ttl_s + session),
        pool_id=pool.id,
        provider_options=dict(pool.sandbox_config),
        egress=Egress(),
        labels={"corral.warm": "true"},
    )


def warm_tick(rt: Runtime) -> warm.Tick:
    """End stale and surplus warm sandboxes (terminated at their provider), and add the rows
    missing below each pool's ``warm_min``; the caller sends their provision tasks."""
    result = warm.tick(
        rt.db,
        boot_timeout_s=rt.settings.provision_timeout_s,
        seen_within_s=rt.settings.warm_wait_s + warm.SEEN_GRACE_S,
    )
    for ending in result.ended:
        terminate_quietly(rt, ending.handle)
        log.info(
            "warm sandbox ended", extra={"sandbox_id": ending.warm_id, "reason": ending.reason}
        )
    return result
