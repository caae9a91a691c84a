"""A warm docker pool on real processes (docs/warm-pools.md): the warm containers have no
network and reach the api through its mounted Unix socket; two items dispatched to a pool
of two bind both, the provider makes no container for them, and the pool refills."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest
from sqlalchemy import select

from corral.shared.store.db import Database
from corral.shared.store.models import Sandbox
from tests.acceptance.conftest import shell
from tests.acceptance.stack import Stack
from tests.acceptance.warm import exactly, make_pool, provisions, warm_rows
from tests.conftest import DockerSandbox


@pytest.fixture(scope="module")
def stack(
    postgres_database_url: str, redis_url: str, docker_sandbox: DockerSandbox
) -> Iterator[Stack]:
    """A stack whose only provider worker is docker's (the conftest's ``db`` reads it)."""
    config = {
        "base_url": docker_sandbox.url,
        "image": docker_sandbox.image,
        "grace_period_s": 1,
        "deployment": f"warm-{uuid.uuid4().hex[:8]}",
    }
    running = Stack(
        database_url=postgres_database_url,
        broker_url=redis_url,
        provider_config={"docker": config},
        extra_env={"CORRAL_WARM_INTERVAL_S": "1"},
    )
    try:
        running.start_only(["api", "scheduler", "worker-docker", "maintenance", "beat"])
        yield running
    finally:
        running.stop()


def test_two_items_bind_the_two_warm_containers_and_the_pool_refills(
    stack: Stack, db: Database
) -> None:
    org = f"dwarm-{uuid.uuid4().hex[:8]}"
    pool_id = make_pool(stack, org, "docker", warm_min=2)
    first = stack.until(lambda: exactly(db, pool_id, 2), "two warm containers", timeout_s=120)
    made_before = provisions(stack, "docker")

    ids = []
    for number in range(2):
        status, body = stack.request("POST", "/v1/dispatch", shell(org, f"echo warm-{number}"))
        assert status == 202, body
        ids.append(body["id"])
    views = stack.wait_final(ids, timeout_s=120)
    assert [v["state"] for v in views] == ["succeeded"] * 2, views

    bound = {row.id: row for row in warm_rows(db, pool_id) if row.state == "bound"}
    assert set(bound) == first
    with db.session() as session:
        handles = {
            row.work_item_id: row.external_id
            for row in session.scalars(select(Sandbox).where(Sandbox.work_item_id.in_(ids)))
        }
    assert handles == {row.work_item_id: row.external_id for row in bound.values()}
    assert provisions(stack, "docker") == made_before, "no container was made for the items"
    refilled = stack.until(lambda: exactly(db, pool_id, 2), "refilled to two", timeout_s=120)
    assert not refilled & first
