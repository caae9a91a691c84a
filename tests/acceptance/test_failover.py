"""Failover through real processes (api, scheduler, a kubernetes and a local provider worker,
maintenance and beat) on PostgreSQL and Redis (issue 35): an org's first pool is a
Kubernetes cluster whose API always fails, its second a local pool. Each item's provision
fails on the cluster and the item is handed to the local pool, where it runs and succeeds;
its attempts record both pools. A permanent refusal fails the item over at once; an API
that only ever answers 503 fails each provision past its retries, the item waits, and the
cluster's breaker opens and sends the rest elsewhere. An item with ``failover: false`` fails
as before."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy import select

from corral.shared.store.db import Database, make_engine
from corral.shared.store.models import LifecycleEvent, Sandbox
from tests.acceptance.conftest import shell
from tests.acceptance.stack import Stack
from tests.standins.kubernetes import KubernetesStandin

NAMESPACE = "corral"
JOBS = f"/apis/batch/v1/namespaces/{NAMESPACE}/jobs"
ITEMS = 6


@pytest.fixture(scope="module")
def cluster() -> Iterator[KubernetesStandin]:
    with KubernetesStandin(namespace=NAMESPACE) as standin:
        yield standin


@pytest.fixture(scope="module")
def two_pools_stack(
    cluster: KubernetesStandin,
    postgres_database_url: str,
    redis_url: str,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Stack]:
    kubeconfig = cluster.write_kubeconfig(tmp_path_factory.mktemp("kube"), context="failing")
    config = {
        "kubeconfig": str(kubeconfig),
        "context": "failing",
        "namespace": NAMESPACE,
        "deployment": f"failover-{uuid.uuid4().hex[:8]}",
    }
    quick = {  # a provision gives up after two quick retries; a waiting item is soon routed
        "CORRAL_PROVISION_MAX_RETRIES": "2",
        "CORRAL_PROVISION_BACKOFF_S": "0.05",
        "CORRAL_PROVISION_BACKOFF_MAX_S": "0.2",
        "CORRAL_BREAKER_FAILURES": "3",
        "CORRAL_BREAKER_COOLDOWN_S": "600",
    }
    running = Stack(
        database_url=postgres_database_url,
        broker_url=redis_url,
        provider_config={"kubernetes": config},
        extra_env=quick,
    )
    try:
        names = ["api", "scheduler", "worker-kubernetes", "worker-local", "maintenance", "beat"]
        running.start_only(names)
        yield running
    finally:
        running.stop()


def _org(stack: Stack) -> tuple[str, dict[str, str]]:
    """A new org with the cluster's pool first (priority 10) and a local pool after it; the
    pools' ids by name."""
    org, pools = f"fo-{uuid.uuid4().hex[:6]}", {}
    profile = {"name": "default", "model": "m", "auth_mode": "byok"}
    status, body = stack.request("POST", "/v1/admin/profiles", profile)
    assert status in (201, 409), body
    for name, provider, priority in (("cluster", "kubernetes", 10), ("local", "local", 0)):
        pool = {
            "org_id": org,
            "name": name,
            "provider_id": provider,
            "priority": priority,
            "max_concurrent": 20,
        }
        status, body = stack.request("POST", "/v1/admin/pools", pool)
        assert status == 201, body
        pools[name] = body["id"]
    return org, pools


def _dispatch(stack: Stack, org: str, count: int, **fields: object) -> list[str]:
    ids = []
    for number in range(count):
        body = shell(org, f"echo {number}", **fields)
        status, answer = stack.request("POST", "/v1/dispatch", body)
        assert status == 202, answer
        ids.append(answer["id"])
    return ids


def _attempts(stack: Stack, item_ids: list[str]) -> dict[str, list[tuple[str, str | None]]]:
    """Each item's attempts: (pool name, how its sandbox ended), in order."""
    db = Database(make_engine(stack.database_url))
    try:
        with db.session() as session:
            rows = session.execute(
                select(Sandbox.work_item_id, Sandbox.pool_id, Sandbox.termination_reason)
                .where(Sandbox.work_item_id.in_(item_ids))
                .order_by(Sandbox.work_item_id, Sandbox.attempt)
            ).all()
    finally:
        db.dispose()
    found: dict[str, list[tuple[str, str | None]]] = {item_id: [] for item_id in item_ids}
    for item_id, pool_id, reason in rows:
        found[item_id].append((pool_id, reason))
    return found


def _ended_attempts(stack: Stack, item_ids: list[str]) -> dict[str, list[tuple[str, str | None]]]:
    """:func:`_attempts` once every sandbox has ended (a finished item's ends just after)."""

    def ended() -> dict[str, list[tuple[str, str | None]]] | None:
        found = _attempts(stack, item_ids)
        done = all(reason for each in found.values() for _, reason in each)
        return found if done else None

    settled: dict[str, list[tuple[str, str | None]]] = stack.until(ended, "the sandboxes' ends")
    return settled


def _breaker_events(stack: Stack, pool_id: str) -> list[str]:
    db = Database(make_engine(stack.database_url))
    try:
        with db.session() as session:
            return list(
                session.scalars(
                    select(LifecycleEvent.to_state)
                    .where(LifecycleEvent.entity == "pool", LifecycleEvent.entity_id == pool_id)
                    .order_by(LifecycleEvent.id)
                )
            )
    finally:
        db.dispose()


def test_a_cluster_that_refuses_every_job_hands_its_items_to_the_local_pool(
    two_pools_stack: Stack, cluster: KubernetesStandin, tmp_path: Path
) -> None:
    org, pools = _org(two_pools_stack)
    cluster.fail_randomly(422, rate=1.0, method="POST", path_prefix=JOBS)  # a permanent refusal
    try:
        # First, while the cluster's breaker is closed: it is routed there.
        [pinned] = _dispatch(two_pools_stack, org, 1, failover=False)
        items = _dispatch(two_pools_stack, org, ITEMS)
        stayed, *moved = two_pools_stack.wait_final([pinned, *items], timeout_s=120)
    finally:
        cluster.clear_failures()

    assert [v["state"] for v in moved] == ["succeeded"] * ITEMS, [v["error"] for v in moved]
    failed_over = [(pools["cluster"], "provision_failed"), (pools["local"], "finished")]
    # Routed after the cluster's breaker opened (its third failure), an item goes local at once.
    went_local = [(pools["local"], "finished")]
    attempts = _ended_attempts(two_pools_stack, items)
    assert all(each in (failed_over, went_local) for each in attempts.values()), attempts
    assert sum(each == failed_over for each in attempts.values()) >= 3, attempts
    assert (stayed["state"], stayed["error"]["code"]) == ("failed", "create_failed"), stayed
    assert _attempts(two_pools_stack, [pinned])[pinned] == [(pools["cluster"], "provision_failed")]


def test_a_cluster_whose_api_only_fails_transiently_opens_its_breaker_and_items_go_local(
    two_pools_stack: Stack, cluster: KubernetesStandin
) -> None:
    org, pools = _org(two_pools_stack)
    cluster.fail_randomly(503, rate=1.0)  # every call, every time: an outage
    try:
        items = _dispatch(two_pools_stack, org, ITEMS)
        views = two_pools_stack.wait_final(items, timeout_s=120)
    finally:
        cluster.clear_failures()

    assert [v["state"] for v in views] == ["succeeded"] * ITEMS, [v["error"] for v in views]
    attempts = _ended_attempts(two_pools_stack, items)
    for each in attempts.values():
        # Each waited after its provision on the cluster gave up, or went local at once
        # once the cluster's breaker was open; it ran on the local pool.
        assert each[-1] == (pools["local"], "finished"), each
        assert set(each[:-1]) <= {(pools["cluster"], "provision_unavailable")}, each
    assert any(len(each) > 1 for each in attempts.values()), "none waited out the cluster"
    assert _breaker_events(two_pools_stack, pools["cluster"])[:1] == ["breaker_open"]
