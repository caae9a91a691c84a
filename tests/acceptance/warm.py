"""Helpers of the warm pool acceptance tests (docs/warm-pools.md)."""

from __future__ import annotations

import re
import urllib.request

from sqlalchemy import select

from corral.shared.store.db import Database
from corral.shared.store.models import WarmSandbox
from tests.acceptance.stack import Stack


def make_pool(stack: Stack, org: str, provider: str = "local", **settings: object) -> str:
    status, body = stack.request(
        "POST", "/v1/admin/profiles", {"name": "default", "model": "m", "auth_mode": "byok"}
    )
    assert status in (201, 409), body
    pool = {
        "org_id": org,
        "name": "warm",
        "provider_id": provider,
        "max_concurrent": 8,
        # Local and docker sandboxes' idle time costs nothing by default: bill it, to see it.
        "capabilities": {"idle_cost_model": "metered"},
    }
    status, body = stack.request("POST", "/v1/admin/pools", pool | settings)
    assert status == 201, body
    return str(body["id"])


def warm_rows(db: Database, pool_id: str) -> list[WarmSandbox]:
    with db.session() as session:
        rows = session.scalars(select(WarmSandbox).where(WarmSandbox.pool_id == pool_id)).all()
        session.expunge_all()
    return list(rows)


def waiting(db: Database, pool_id: str) -> set[str]:
    return {row.id for row in warm_rows(db, pool_id) if row.state == "waiting"}


def exactly(db: Database, pool_id: str, count: int) -> set[str] | None:
    """The waiting warm sandboxes of the pool when there are ``count`` of them, else None."""
    found = waiting(db, pool_id)
    return found if len(found) == count else None


def provisions(stack: Stack, provider: str) -> float:
    """provider.provision() calls for items the provider worker made (its histogram)."""
    port = stack.worker_metrics_ports[f"worker-{provider}"]
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as answer:
        text = answer.read().decode()
    pattern = rf'corral_provision_seconds_count\{{outcome="ok",provider="{provider}"\}} ([0-9.e+]+)'
    found = re.search(pattern, text)
    return float(found.group(1)) if found else 0.0
