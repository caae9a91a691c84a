"""The reaper with the kubernetes provider against the Kubernetes API stand-in: a Job whose pod
exits before its runner claimed has its pod log read, kept on the attempt (redacted of the
item's own env values) and its last lines put in the error of the item its end fails; a pod
log the API server holds back does not hold the sweep up past CORRAL_END_LOG_TIMEOUT_S."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from corral.providers.kubernetes.provider import KubernetesProvider
from tests.integration.reaping import Reaped, reaped_world
from tests.standins.kubernetes import KubernetesStandin

NS = "corral"
SECRET = "hunter2-horse-battery-staple"
REASON = "corral-test: /opt/tool is missing"
TIMEOUT_S = 1.0


@pytest.fixture
def world(
    fresh_pg_url: str, redis_url: str, tmp_path: Path
) -> Iterator[tuple[Reaped, KubernetesStandin]]:
    with KubernetesStandin(token="reaper-kubernetes-token", namespace=NS) as k8s:
        provider = KubernetesProvider(
            {
                "kubeconfig": str(k8s.write_kubeconfig(tmp_path, context="standin")),
                "context": "standin",
                "namespace": NS,
                "request_timeout_s": 60,  # longer than any wait here: the reaper's bound counts
            }
        )
        try:
            with reaped_world(
                fresh_pg_url, redis_url, tmp_path, provider, end_log_timeout_s=TIMEOUT_S
            ) as reaped:
                yield reaped, k8s
        finally:
            provider.close()


def _exits_early(reaped: Reaped, k8s: KubernetesStandin, item_id: str) -> str:
    """The pod of the item's current sandbox prints and exits 3: the sandbox's id."""
    sandbox = reaped.sandbox(item_id)
    assert sandbox.external_id is not None
    printed = "".join(f"noise {n}\n" for n in range(100))
    log = f"{printed}\x1b[31mconnecting with {SECRET}\x1b[0m\n{REASON}\n"
    k8s.fail_pod(sandbox.external_id, exit_code=3, log=log)
    return sandbox.id


def test_a_pod_that_exits_before_the_claim_says_why_in_its_item_s_error(
    world: tuple[Reaped, KubernetesStandin],
) -> None:
    reaped, k8s = world
    item_id = reaped.dispatch(env={"PASSPHRASE": SECRET})
    first = _exits_early(reaped, k8s, item_id)

    report = reaped.sweep()

    assert report.ended == {"sandbox_lost": 1} and report.requeued == [item_id]
    kept = reaped.sandbox(item_id, attempt=1).end_log
    assert kept is not None and first == reaped.sandbox(item_id, attempt=1).id
    assert kept.split("\n")[-3:] == ["noise 99", "connecting with [redacted]", REASON]
    assert len(kept.split("\n")) == 40
    reaped.route_and_provision(item_id)  # attempt 2, the last (max_attempts is 2 here)
    _exits_early(reaped, k8s, item_id)

    assert reaped.sweep().failed == [item_id]
    item = reaped.item(item_id)
    assert (item.state, item.error_code) == ("failed", "sandbox_lost")
    assert item.error_message is not None and SECRET not in item.error_message
    assert item.error_message.endswith(
        "; gave up after 2 attempts; last lines: noise 97 | noise 98 | noise 99 | "
        f"connecting with [redacted] | {REASON}"
    )


def test_a_pod_log_the_api_server_holds_back_does_not_hold_up_the_sweep(
    world: tuple[Reaped, KubernetesStandin],
) -> None:
    reaped, k8s = world
    item_id = reaped.dispatch()
    _exits_early(reaped, k8s, item_id)
    [pod] = k8s.objects("pods")
    log_path = f"/api/v1/namespaces/{NS}/pods/{pod['metadata']['name']}/log"
    k8s.delay_next(30, method="GET", path_prefix=log_path)

    started = time.monotonic()
    report = reaped.sweep()
    took = time.monotonic() - started

    assert took < TIMEOUT_S + 10, f"the sweep took {took:.1f} s"
    assert report.ended == {"sandbox_lost": 1} and report.requeued == [item_id]
    assert reaped.sandbox(item_id).end_log is None
    assert [r.path for r in k8s.requests("GET") if r.path == log_path] == [log_path]
