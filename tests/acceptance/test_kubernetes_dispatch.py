"""A dispatch routed to a kubernetes pool, through real processes (api, scheduler, a
``corral worker --provider kubernetes``, maintenance and beat) and the official Kubernetes
client, against the Kubernetes API stand-in on loopback."""

from __future__ import annotations

import base64
import json
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from kubernetes import client

from tests.acceptance.conftest import shell
from tests.acceptance.stack import Stack
from tests.standins.kubernetes import KubernetesStandin

NAMESPACE = "corral"


@pytest.fixture(scope="module")
def cluster() -> Iterator[KubernetesStandin]:
    with KubernetesStandin(namespace=NAMESPACE) as standin:
        yield standin


@pytest.fixture(scope="module")
def kube_stack(
    cluster: KubernetesStandin,
    postgres_database_url: str,
    redis_url: str,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Stack]:
    kubeconfig = cluster.write_kubeconfig(tmp_path_factory.mktemp("kube"), context="e2e")
    config = {
        "kubeconfig": str(kubeconfig),
        "context": "e2e",
        "namespace": NAMESPACE,
        "deployment": f"e2e-{uuid.uuid4().hex[:8]}",
        "image": "corral-sandbox:dev",
    }
    running = Stack(
        database_url=postgres_database_url,
        broker_url=redis_url,
        provider_config={"kubernetes": config},
    )
    try:
        running.start_only(["api", "scheduler", "worker-kubernetes", "maintenance", "beat"])
        yield running
    finally:
        running.stop()


def _wait(what: str, check: Any, timeout_s: float = 30) -> Any:
    deadline = time.monotonic() + timeout_s
    while True:
        found = check()
        if found:
            return found
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.2)


def test_a_dispatch_to_a_kubernetes_pool_makes_a_job_and_a_secret_holding_the_token(
    kube_stack: Stack, cluster: KubernetesStandin
) -> None:
    org = f"k8s-{uuid.uuid4().hex[:6]}"
    for path, body in (
        ("/v1/admin/profiles", {"name": "default", "model": "m", "auth_mode": "byok"}),
        (
            "/v1/admin/pools",
            {"org_id": org, "name": "cluster", "provider_id": "kubernetes", "max_concurrent": 4},
        ),
    ):
        status, answer = kube_stack.request("POST", path, body)
        assert status in (201, 409), answer
    status, answer = kube_stack.request(
        "POST", "/v1/dispatch", shell(org, "echo on kubernetes", egress={"allow_network": True})
    )
    assert status == 202, answer
    item_id = answer["id"]

    view = _wait(
        "the item's sandbox to be made",
        lambda: (
            (v := kube_stack.request("GET", f"/v1/work-items/{item_id}")[1])
            and v["state"] == "awaiting_claim"
            and v
        ),
    )
    assert view["queue"] == "provision.kubernetes"
    [job] = [
        j for j in cluster.jobs() if j["metadata"]["labels"].get("corral.work-item-id") == item_id
    ]
    secrets = [
        s
        for s in cluster.secrets()
        if any(o["uid"] == job["metadata"]["uid"] for o in s["metadata"].get("ownerReferences", []))
    ]
    assert len(secrets) == 1, "the token's Secret is owned by the Job"
    token = _token_in(secrets[0])
    assert token.startswith("crt_")
    # The token went to the Secret and nowhere else: not the Job, not a log, not the api.
    carriers = {(r.method, r.path.split("?")[0]) for r in cluster.requests_containing(token)}
    assert carriers and all("/secrets" in path for _, path in carriers), carriers
    assert token not in str(job)
    for name in kube_stack.processes:
        assert "crt_" not in kube_stack.log_path(name).read_text(errors="replace"), name

    status, _ = kube_stack.request("POST", f"/v1/work-items/{item_id}/cancel")
    assert status == 200
    _wait(
        "the Job to be deleted",
        lambda: not any(j["metadata"]["name"] == job["metadata"]["name"] for j in cluster.jobs()),
    )


def _token_in(secret: dict[str, Any]) -> str:
    data = secret.get("data") or {}
    string_data = secret.get("stringData") or {}
    values = [*string_data.values(), *(base64.b64decode(v).decode() for v in data.values())]
    [token] = [v for v in values if v.startswith("crt_")]
    return token


def test_the_reapers_orphan_rule_deletes_a_labelled_job_the_database_does_not_know(
    kube_stack: Stack, cluster: KubernetesStandin
) -> None:
    deployment = _deployment(kube_stack)
    labels = {
        "corral.managed": "true",
        "corral.deployment": deployment,
        "corral.sandbox-id": "sb-made-by-hand",
        "corral.org-id": "acme",
    }
    job = client.V1Job(
        metadata=client.V1ObjectMeta(name="made-by-hand", labels=labels),
        spec=client.V1JobSpec(
            template=client.V1PodTemplateSpec(
                metadata=client.V1ObjectMeta(labels=labels),
                spec=client.V1PodSpec(
                    restart_policy="Never",
                    containers=[client.V1Container(name="sandbox", image="corral-sandbox:dev")],
                ),
            )
        ),
    )
    with cluster.api_client() as api:
        client.BatchV1Api(api).create_namespaced_job(NAMESPACE, job)
    assert any(j["metadata"]["name"] == "made-by-hand" for j in cluster.jobs())

    _wait(
        "the sweep to delete the orphan Job",
        lambda: not any(j["metadata"]["name"] == "made-by-hand" for j in cluster.jobs()),
    )
    # logged once the provider's terminate returned, so possibly just after the Job went
    log = kube_stack.log_path("maintenance")
    _wait("the orphan's end to be logged", lambda: "terminated an orphan" in log.read_text())


def _deployment(stack: Stack) -> str:
    config = json.loads(stack.env["CORRAL_PROVIDER_CONFIG"])
    deployment: str = config["kubernetes"]["deployment"]
    return deployment
