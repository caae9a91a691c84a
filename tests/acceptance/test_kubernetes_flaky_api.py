"""Dispatches to a kubernetes pool through real processes (api, scheduler, a ``corral worker
--provider kubernetes``, maintenance and beat) while the Kubernetes API fails 30 % of its
calls for the whole run, answering 429, 500, 503 or 504 (issues 13 and 35), with a real
runner started in every pod that runs. Some failures come after the API did what was asked
(a create or delete whose answer was lost).

The provider sends each call again; a provision whose calls keep failing is retried by its
task (a new registration token each time, the last one revoked), and one that fails past
the task's retries sends its item back to waiting, never to ``failed``: the items had all
the time in the world. Every item succeeds, its work runs exactly once, and no runner is
handed a revoked token."""

from __future__ import annotations

import time
import uuid
from collections import Counter
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
ITEMS = 40
FAILURE_RATE = 0.3
STATUSES = (429, 500, 503, 504)
# The share of failed creates and deletes answered after they were done (an answer lost on
# the way back): their repeat meets 409 or 404. A lost answer to the Job's start is left out:
# a Job started with a token its retry revokes is deleted, and its runner refused, by design.
SERVED = {"GET": 0.0, "POST": 0.5, "PATCH": 0.0, "DELETE": 0.5}
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
    # The deployment's retries (each call's and the provision task's), only sooner: what
    # bad luck exhausts sends the item back to waiting, not to failed.
    retries = {
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

    for seed, (method, served) in enumerate(SERVED.items()):
        cluster.fail_randomly(
            STATUSES, rate=FAILURE_RATE, method=method, seed=13 + seed, served=served
        )
    ran = tmp_path / "ran.log"  # each execution of an item's work appends its line
    with RunnerKubelet(cluster, tmp_path / "pods") as kubelet:
        items = [dispatch(flaky_stack, org, n, ran) for n in range(ITEMS)]
        views = wait_final(flaky_stack, items, timeout_s=180)
        cluster.clear_failures()
        runs = kubelet.finished_or_not()
        refused = kubelet.refused()

    failures = [r for r in cluster.requests() if r.status in STATUSES]
    assert {r.status for r in failures} == set(STATUSES), "the API failed too few of the calls"
    assert not refused, (
        f"{len(refused)} of {len(runs)} runners were refused at register, e.g. pod "
        f"{refused[0].pod}: {refused[0].log.read_text(errors='replace')[-500:]}"
    )
    assert revoked_before_use(flaky_stack, [run.token for run in runs]) == 0
    states = [view["state"] for view in views]
    assert states == ["succeeded"] * ITEMS, [
        (v["id"], v["state"], v["error"], v["sandbox"]) for v in views if v["state"] != "succeeded"
    ]
    executions = Counter(ran.read_text().split("\n")[:-1])
    assert executions == Counter({f"item {n}": 1 for n in range(ITEMS)}), [
        (line, count) for line, count in executions.items() if count != 1
    ]


def dispatch(stack: Stack, org: str, number: int, ran: Path) -> str:
    command = f"echo item {number} >> {ran}"  # the runner's work runs on this host here
    status, answer = stack.request("POST", "/v1/dispatch", shell(org, command))
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
