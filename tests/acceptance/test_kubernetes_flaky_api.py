"""Dispatches to a kubernetes pool through real processes (api, scheduler, a ``corral worker
--provider kubernetes``, maintenance and beat) while the Kubernetes API fails about 30 % of
its calls (issue 13), with a real runner started in every pod that runs.

Provisions fail part-way and are retried; each retry mints a new registration token and
revokes the last. No runner may be handed a revoked token: every runner registers, and every
item succeeds."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import select

from corral.shared.store.db import Database, make_engine
from corral.shared.store.models import RegistrationToken
from corral.shared.store.tokens import hash_token
from tests.acceptance.conftest import shell
from tests.acceptance.kube_runners import RunnerKubelet
from tests.acceptance.stack import Stack
from tests.standins.kubernetes import KubernetesStandin

NAMESPACE = "corral"
ITEMS = 20
FAILURE_RATE = 0.3
FINAL = {"succeeded", "failed", "cancelled", "dispatch_error"}


@pytest.fixture
def cluster() -> Iterator[KubernetesStandin]:
    with KubernetesStandin(namespace=NAMESPACE) as standin:
        yield standin


@pytest.fixture
def flaky_stack(
    cluster: KubernetesStandin, postgres_database_url: str, redis_url: str, tmp_path: Path
) -> Iterator[Stack]:
    kubeconfig = cluster.write_kubeconfig(tmp_path, context="flaky")
    config = {
        "kubeconfig": str(kubeconfig),
        "context": "flaky",
        "namespace": NAMESPACE,
        "deployment": f"flaky-{uuid.uuid4().hex[:8]}",
    }
    # A retry makes up to six calls (read the Job, read, delete and create the Secret, read the
    # policy, start the Job), all of which must pass: at 30 % each, one in eight does. Retries
    # enough, and soon enough, that bad luck does not exhaust them.
    retries = {
        "CORRAL_PROVISION_MAX_RETRIES": "100",
        "CORRAL_PROVISION_BACKOFF_S": "0.02",
        "CORRAL_PROVISION_BACKOFF_MAX_S": "0.2",
    }
    running = Stack(
        database_url=postgres_database_url,
        broker_url=redis_url,
        provider_config={"kubernetes": config},
        extra_env=retries,
    )
    try:
        running.start_only(["api", "scheduler", "worker-kubernetes", "maintenance", "beat"])
        yield running
    finally:
        running.stop()


def test_with_a_flaky_api_no_runner_gets_a_revoked_token_and_every_item_succeeds(
    flaky_stack: Stack, cluster: KubernetesStandin, tmp_path: Path
) -> None:
    org = f"flaky-{uuid.uuid4().hex[:6]}"
    profile = {"name": "default", "model": "m", "auth_mode": "byok"}
    pool = {"org_id": org, "name": "cluster", "provider_id": "kubernetes", "max_concurrent": ITEMS}
    for path, body in (("/v1/admin/profiles", profile), ("/v1/admin/pools", pool)):
        status, answer = flaky_stack.request("POST", path, body)
        assert status in (201, 409), answer

    cluster.fail_randomly(500, rate=FAILURE_RATE, seed=13)
    with RunnerKubelet(cluster, tmp_path / "pods") as kubelet:
        items = [dispatch(flaky_stack, org, n) for n in range(ITEMS)]
        views = wait_final(flaky_stack, items, timeout_s=45)
        cluster.clear_failures()
        runs = kubelet.finished_or_not()
        refused = kubelet.refused()

    failures = [r for r in cluster.requests() if r.status == 500]
    assert failures, "the API failed none of the calls: the test tested nothing"
    assert not refused, (
        f"{len(refused)} of {len(runs)} runners were refused at register, e.g. pod "
        f"{refused[0].pod}: {refused[0].log.read_text(errors='replace')[-500:]}"
    )
    assert revoked_before_use(flaky_stack, [run.token for run in runs]) == 0
    states = [view["state"] for view in views]
    assert states == ["succeeded"] * ITEMS, [
        (v["id"], v["state"], v["error"], v["sandbox"]) for v in views if v["state"] != "succeeded"
    ]


def dispatch(stack: Stack, org: str, number: int) -> str:
    status, answer = stack.request("POST", "/v1/dispatch", shell(org, f"echo item {number}"))
    assert status == 202, answer
    item_id: str = answer["id"]
    return item_id


def wait_final(stack: Stack, item_ids: list[str], *, timeout_s: float) -> list[dict[str, Any]]:
    """The items' views once all are final, or as they are when ``timeout_s`` has passed."""
    deadline = time.monotonic() + timeout_s
    while True:
        views = [stack.request("GET", f"/v1/work-items/{i}")[1] for i in item_ids]
        if all(v["state"] in FINAL for v in views) or time.monotonic() > deadline:
            return views
        stack.check_alive()
        time.sleep(0.2)


def revoked_before_use(stack: Stack, tokens: list[str]) -> int:
    """How many of the tokens pods were handed had been revoked (a revocation sets
    ``redeemed_at`` and ``expires_at`` to one moment; a runner's redeem only the first)."""
    db = Database(make_engine(stack.database_url))
    try:
        with db.session() as session:
            rows = session.scalars(
                select(RegistrationToken).where(
                    RegistrationToken.token_hash.in_([hash_token(t) for t in tokens])
                )
            ).all()
            return sum(1 for row in rows if row.redeemed_at == row.expires_at)
    finally:
        db.dispose()
