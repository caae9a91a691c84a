"""The Kubernetes API stand-in, driven only through the official ``kubernetes`` client: if the
client reads every answer here as it would a cluster's, the provider tested against the stand-in
is tested against what a cluster sends."""

from __future__ import annotations

import gc
import json
import re
import socket
import threading
import time
from collections.abc import Iterator
from datetime import datetime
from email.utils import parsedate_to_datetime
from pathlib import Path
from typing import Any

import pytest
import urllib3
from kubernetes import client, config
from kubernetes.client import ApiClient, ApiException
from kubernetes.config.incluster_config import InClusterConfigLoader
from kubernetes.stream import stream
from kubernetes.stream.ws_client import WSClient

from tests.conftest import require
from tests.standins.kubernetes import ExecResult, KubernetesStandin

TOKEN = "cluster-token-for-tests"
NS = "default"
# The preload form of ``stream()`` never closes its WebSocket: ``websocket_call`` in the client
# returns ``read_all()`` and drops the WSClient, whose socket is then collected unclosed (the
# client's ``close()`` is a no-op once the server has closed the stream, as every exec ends).
# That is third-party code; the warning says nothing about the stand-in. The WSClient sits in a
# reference cycle, so the test collects it itself while this filter applies.
PRELOAD_SOCKET_LEAK = "ignore:unclosed <socket.socket:ResourceWarning"


@pytest.fixture
def k8s() -> Iterator[KubernetesStandin]:
    with KubernetesStandin(token=TOKEN) as standin:
        yield standin


@pytest.fixture
def api(k8s: KubernetesStandin, tmp_path: Path) -> Iterator[ApiClient]:
    """A client built the way the provider builds one from a kubeconfig path and context."""
    path = k8s.write_kubeconfig(tmp_path, context="standin-ctx")
    with config.new_client_from_config(config_file=str(path), context="standin-ctx") as built:
        yield built


def job_body(name: str, **spec: Any) -> client.V1Job:
    container = client.V1Container(name="main", image="registry.example/agent:1.0", command=["run"])
    template = client.V1PodTemplateSpec(
        metadata=client.V1ObjectMeta(labels={"corral.dev/work": name}),
        spec=client.V1PodSpec(restart_policy="Never", containers=[container]),
    )
    return client.V1Job(
        metadata=client.V1ObjectMeta(
            name=name, labels={"corral.dev/work": name, "corral.dev/managed": "yes"}
        ),
        spec=client.V1JobSpec(template=template, **({"backoff_limit": 0} | spec)),
    )


def create_job(api: ApiClient, name: str, **spec: Any) -> client.V1Job:
    return client.BatchV1Api(api).create_namespaced_job(NS, job_body(name, **spec))


def status_of(error: ApiException) -> dict[str, Any]:
    body = json.loads(error.body)
    assert body["kind"] == "Status" and body["apiVersion"] == "v1" and body["status"] == "Failure"
    assert body["code"] == error.status
    return body


def close_stream(ws: WSClient) -> None:
    """``WSClient.close()`` does nothing once the server closed the stream, so the socket is
    shut here too; a provider needs the same two steps."""
    ws.close()
    ws.sock.shutdown()


def test_a_created_job_gets_server_metadata_and_one_pod_labelled_like_a_real_one(
    k8s: KubernetesStandin, api: ApiClient
) -> None:
    created = create_job(api, "w1")
    assert (
        created.metadata.uid
        and created.metadata.resource_version
        and created.metadata.creation_timestamp
    )
    assert created.spec.selector.match_labels == {
        "batch.kubernetes.io/controller-uid": created.metadata.uid
    }

    pods = client.CoreV1Api(api).list_namespaced_pod(NS, label_selector="job-name=w1").items
    assert len(pods) == 1
    pod = pods[0]
    assert re.fullmatch(r"w1-[a-z0-9]{5}", pod.metadata.name)
    assert pod.metadata.labels["batch.kubernetes.io/job-name"] == "w1"
    assert pod.metadata.labels["corral.dev/work"] == "w1"
    owner = pod.metadata.owner_references[0]
    assert (owner.kind, owner.name, owner.uid, owner.controller) == (
        "Job",
        "w1",
        created.metadata.uid,
        True,
    )
    assert pod.spec.containers[0].image == "registry.example/agent:1.0"
    read = client.CoreV1Api(api).read_namespaced_pod(pod.metadata.name, NS)
    assert read.status.phase == "Running"
    assert read.status.container_statuses[0].state.running is not None


def test_label_selectors_select_jobs_by_equality_existence_and_negation(api: ApiClient) -> None:
    batch = client.BatchV1Api(api)
    create_job(api, "a1")
    create_job(api, "b1")

    def names(selector: str) -> list[str]:
        return [
            job.metadata.name
            for job in batch.list_namespaced_job(NS, label_selector=selector).items
        ]

    assert names("corral.dev/work=a1,corral.dev/managed=yes") == ["a1"]
    assert names("corral.dev/managed") == ["a1", "b1"]
    assert names("corral.dev/work!=a1") == ["b1"]
    assert names("!corral.dev/managed") == []
    with pytest.raises(ApiException) as raised:
        names("a b c")
    assert raised.value.status == 400


def test_a_secret_takes_the_job_as_owner_by_strategic_patch_and_the_token_is_only_in_it(
    k8s: KubernetesStandin, api: ApiClient
) -> None:
    core = client.CoreV1Api(api)
    job = create_job(api, "w2")
    secret = client.V1Secret(
        metadata=client.V1ObjectMeta(name="w2-cred"), string_data={"token": "s3cr3t-runner"}
    )
    created = core.create_namespaced_secret(NS, secret)
    assert created.data == {"token": "czNjcjN0LXJ1bm5lcg=="} and created.type == "Opaque"

    owner = {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "name": "w2",
        "uid": job.metadata.uid,
        "blockOwnerDeletion": True,
    }
    core.patch_namespaced_secret("w2-cred", NS, {"metadata": {"ownerReferences": [owner]}})
    other = {"apiVersion": "v1", "kind": "ConfigMap", "name": "x", "uid": "0000-other"}
    core.patch_namespaced_secret("w2-cred", NS, {"metadata": {"ownerReferences": [other]}})

    refs = core.read_namespaced_secret("w2-cred", NS).metadata.owner_references
    assert [ref.uid for ref in refs] == [job.metadata.uid, "0000-other"]  # merged by uid
    patches = k8s.requests(method="PATCH")
    assert patches[0].headers["content-type"] == "application/strategic-merge-patch+json"
    carrying = k8s.requests_containing("s3cr3t-runner")
    assert [(r.method, r.path) for r in carrying] == [("POST", f"/api/v1/namespaces/{NS}/secrets")]
    assert not k8s.requests_containing(TOKEN)  # the Authorization header is not logged

    deleted = core.delete_namespaced_secret("w2-cred", NS)  # client 37 returns deletes as dicts
    assert (deleted["kind"], deleted["status"]) == ("Status", "Success")
    with pytest.raises(ApiException) as raised:
        core.read_namespaced_secret("w2-cred", NS)
    assert status_of(raised.value)["message"] == 'secrets "w2-cred" not found'


def test_duplicate_and_invalid_creates_answer_409_and_422_status_bodies(api: ApiClient) -> None:
    create_job(api, "dup")
    with pytest.raises(ApiException) as raised:
        create_job(api, "dup")
    body = status_of(raised.value)
    assert (raised.value.status, body["reason"]) == (409, "AlreadyExists")
    assert body["message"] == 'jobs.batch "dup" already exists'

    bad = job_body("bad")
    bad.spec.template.spec.containers[0].image = None
    bad.spec.template.spec.restart_policy = "Always"
    with pytest.raises(ApiException) as raised:
        client.BatchV1Api(api).create_namespaced_job(NS, bad)
    body = status_of(raised.value)
    assert (raised.value.status, body["reason"], body["details"]["kind"]) == (422, "Invalid", "Job")
    fields = [cause["field"] for cause in body["details"]["causes"]]
    assert fields == ["spec.template.spec.containers[0].image", "spec.template.spec.restartPolicy"]


@pytest.mark.filterwarnings(PRELOAD_SOCKET_LEAK)
def test_exec_streams_stdout_stderr_and_exit_codes(k8s: KubernetesStandin, api: ApiClient) -> None:
    core = client.CoreV1Api(api)
    create_job(api, "ex")
    pod = k8s.job_pod("ex")
    options: dict[str, Any] = {"stderr": True, "stdin": False, "stdout": True, "tty": False}

    echoed = stream(
        core.connect_get_namespaced_pod_exec, pod, NS, command=["echo", "hi", "there"], **options
    )
    assert echoed == "hi there\n"
    gc.collect()  # reap the socket the client leaked (see PRELOAD_SOCKET_LEAK)

    ws = stream(
        core.connect_get_namespaced_pod_exec,
        pod,
        NS,
        command=["sh", "-c", "exit 3"],
        _preload_content=False,
        **options,
    )
    ws.run_forever(timeout=5)
    assert ws.returncode == 3
    assert ws.subprotocol == "v5.channel.k8s.io"
    close_stream(ws)

    ws = stream(
        core.connect_get_namespaced_pod_exec,
        pod,
        NS,
        command=["git", "status"],
        _preload_content=False,
        **options,
    )
    ws.run_forever(timeout=5)
    assert ws.read_stderr() == "git: command not found\n"
    assert ws.returncode == 127
    close_stream(ws)

    k8s.set_exec_handler(lambda argv: ExecResult("x" * 100_000, "warn\n", 0), job="ex")
    ws = stream(
        core.connect_get_namespaced_pod_exec,
        pod,
        NS,
        command=["cat", "big"],
        _preload_content=False,
        **options,
    )
    ws.run_forever(timeout=5)
    assert (len(ws.read_stdout()), ws.read_stderr(), ws.returncode) == (100_000, "warn\n", 0)
    close_stream(ws)


def test_exec_into_a_missing_pod_is_refused_before_the_upgrade(
    k8s: KubernetesStandin, api: ApiClient
) -> None:
    core = client.CoreV1Api(api)
    with pytest.raises(ApiException) as raised:
        stream(
            core.connect_get_namespaced_pod_exec,
            "nope",
            NS,
            command=["echo"],
            stdout=True,
            stderr=True,
            stdin=False,
            tty=False,
        )
    assert "404" in str(raised.value.reason) and '"reason":"NotFound"' in str(raised.value.reason)
    assert k8s.requests()[-1].status == 404


def test_a_job_runs_succeeds_and_its_log_and_status_read_like_a_cluster(
    k8s: KubernetesStandin, api: ApiClient
) -> None:
    k8s.pod_start_delay = None  # pods wait for the test
    batch, core = client.BatchV1Api(api), client.CoreV1Api(api)
    create_job(api, "ok")
    pod = k8s.job_pod("ok")
    assert core.read_namespaced_pod(pod, NS).status.phase == "Pending"
    with pytest.raises(ApiException) as raised:
        core.read_namespaced_pod_log(pod, NS)
    assert (
        raised.value.status == 400 and "is waiting to start" in status_of(raised.value)["message"]
    )

    k8s.run_job("ok")
    running = batch.read_namespaced_job_status("ok", NS).status
    assert (running.active, running.ready, running.start_time is not None) == (1, 1, True)

    k8s.succeed_job("ok", log="line 1\nline 2\n")
    status = batch.read_namespaced_job_status("ok", NS).status
    assert (status.succeeded, status.active, status.completion_time is not None) == (1, None, True)
    assert [(c.type, c.status) for c in status.conditions] == [
        ("SuccessCriteriaMet", "True"),
        ("Complete", "True"),
    ]
    assert (
        core.read_namespaced_pod(pod, NS).status.container_statuses[0].state.terminated.exit_code
        == 0
    )
    assert core.read_namespaced_pod_log(pod, NS) == "line 1\nline 2\n"
    assert core.read_namespaced_pod_log(pod, NS, tail_lines=1) == "line 2\n"


def test_job_failures_carry_the_controllers_reasons(k8s: KubernetesStandin, api: ApiClient) -> None:
    batch = client.BatchV1Api(api)
    create_job(api, "boom")
    k8s.fail_pod("boom", exit_code=2)  # backoffLimit 0: the first failure is final
    failed = batch.read_namespaced_job("boom", NS).status
    assert failed.failed == 1
    assert [(c.type, c.reason) for c in failed.conditions] == [
        ("FailureTarget", "BackoffLimitExceeded"),
        ("Failed", "BackoffLimitExceeded"),
    ]

    create_job(api, "slow", active_deadline_seconds=60)
    pod = k8s.job_pod("slow")
    k8s.advance(61)
    late = batch.read_namespaced_job("slow", NS).status
    assert late.conditions[-1].reason == "DeadlineExceeded" and late.failed == 1
    assert k8s.get("pods", pod) is None  # the controller deletes the running pod


def test_an_image_that_cannot_be_pulled_shows_in_pod_status_and_events(
    k8s: KubernetesStandin, api: ApiClient
) -> None:
    core = client.CoreV1Api(api)
    create_job(api, "img")
    pod = k8s.job_pod("img")
    k8s.stick_image_pull("img", reason="ErrImagePull")

    waiting = core.read_namespaced_pod(pod, NS).status.container_statuses[0].state.waiting
    assert waiting.reason == "ErrImagePull" and "registry.example/agent:1.0" in waiting.message
    events = core.list_namespaced_event(NS, field_selector=f"involvedObject.name={pod}").items
    failed = [e for e in events if e.type == "Warning" and e.reason == "Failed"]
    assert failed[0].message.startswith('Failed to pull image "registry.example/agent:1.0": ')
    assert all(e.involved_object.name == pod for e in events)
    assert core.list_namespaced_event(NS, field_selector="involvedObject.name=other").items == []

    k8s.stick_image_pull("img", reason="ImagePullBackOff")
    assert (
        core.read_namespaced_pod(pod, NS).status.container_statuses[0].state.waiting.reason
        == "ImagePullBackOff"
    )


def test_foreground_delete_collects_pods_and_owned_secrets_then_404s(
    k8s: KubernetesStandin, api: ApiClient
) -> None:
    batch, core = client.BatchV1Api(api), client.CoreV1Api(api)
    job = create_job(api, "gone")
    owner = client.V1OwnerReference(
        api_version="batch/v1", kind="Job", name="gone", uid=job.metadata.uid
    )
    core.create_namespaced_secret(
        NS, client.V1Secret(metadata=client.V1ObjectMeta(name="owned", owner_references=[owner]))
    )
    core.create_namespaced_secret(NS, client.V1Secret(metadata=client.V1ObjectMeta(name="kept")))
    assert len(k8s.pods(job="gone")) == 1

    batch.delete_namespaced_job(
        "gone", NS, body=client.V1DeleteOptions(propagation_policy="Foreground")
    )
    assert k8s.jobs() == [] and k8s.pods() == []
    assert [secret["metadata"]["name"] for secret in k8s.secrets()] == ["kept"]

    with pytest.raises(ApiException) as raised:
        batch.delete_namespaced_job(
            "gone", NS, body=client.V1DeleteOptions(propagation_policy="Foreground")
        )
    assert status_of(raised.value) == {
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": 'jobs.batch "gone" not found',
        "reason": "NotFound",
        "details": {"name": "gone", "group": "batch", "kind": "jobs"},
        "code": 404,
    }


def test_deleting_a_job_without_a_policy_orphans_its_pod(
    k8s: KubernetesStandin, api: ApiClient
) -> None:
    create_job(api, "orphaning")
    client.BatchV1Api(api).delete_namespaced_job("orphaning", NS)
    pods = k8s.pods()
    assert len(pods) == 1 and not pods[0]["metadata"].get("ownerReferences")


def test_a_finished_job_with_a_zero_ttl_is_collected_with_its_pod(
    k8s: KubernetesStandin, api: ApiClient
) -> None:
    create_job(api, "short", ttl_seconds_after_finished=0)
    k8s.succeed_job("short")
    with pytest.raises(ApiException) as raised:
        client.BatchV1Api(api).read_namespaced_job("short", NS)
    assert raised.value.status == 404
    assert k8s.pods() == []


def test_a_deleted_pod_counts_as_a_failure_and_is_replaced_within_the_backoff_limit(
    k8s: KubernetesStandin, api: ApiClient
) -> None:
    core = client.CoreV1Api(api)
    create_job(api, "retry", backoff_limit=1)
    first = k8s.job_pod("retry")
    core.delete_namespaced_pod(first, NS)
    (second,) = core.list_namespaced_pod(
        NS, label_selector="batch.kubernetes.io/job-name=retry"
    ).items
    assert second.metadata.name != first
    assert client.BatchV1Api(api).read_namespaced_job("retry", NS).status.failed == 1


def test_merge_and_json_patches_edit_labels(k8s: KubernetesStandin, api: ApiClient) -> None:
    core = client.CoreV1Api(api)
    core.create_namespaced_secret(
        NS, client.V1Secret(metadata=client.V1ObjectMeta(name="p", labels={"a": "1", "b": "2"}))
    )
    before = core.read_namespaced_secret("p", NS).metadata.resource_version
    merged = core.patch_namespaced_secret(
        "p",
        NS,
        {"metadata": {"labels": {"a": None, "c": "3"}}},
        _content_type="application/merge-patch+json",
    )
    assert (
        merged.metadata.labels == {"b": "2", "c": "3"}
        and merged.metadata.resource_version != before
    )
    patched = core.patch_namespaced_secret(
        "p", NS, [{"op": "replace", "path": "/metadata/labels/b", "value": "9"}]
    )
    assert patched.metadata.labels == {"b": "9", "c": "3"}
    assert k8s.requests(method="PATCH")[-1].headers["content-type"] == "application/json-patch+json"
    stale = {"metadata": {"resourceVersion": before, "labels": {"d": "4"}}}
    with pytest.raises(ApiException) as raised:
        core.patch_namespaced_secret("p", NS, stale)
    assert (raised.value.status, status_of(raised.value)["reason"]) == (409, "Conflict")


def test_a_gc_delay_keeps_a_deleting_job_visible_until_time_passes() -> None:
    with (
        KubernetesStandin(token=TOKEN, gc_delay=30, version="1.30") as k8s,
        k8s.api_client() as slow,
    ):
        batch = client.BatchV1Api(slow)
        create_job(slow, "lingering")
        batch.delete_namespaced_job("lingering", NS, propagation_policy="Foreground")
        deleting = batch.read_namespaced_job("lingering", NS).metadata
        assert deleting.deletion_timestamp is not None and deleting.finalizers == [
            "foregroundDeletion"
        ]
        assert client.VersionApi(slow).get_code().minor == "30"
        k8s.advance(30)
        assert batch.list_namespaced_job(NS).items == [] and k8s.pods() == []


def test_injected_429_and_500_surface_as_api_exceptions_then_service_resumes(
    k8s: KubernetesStandin, api: ApiClient
) -> None:
    k8s.fail_next(429, retry_after=2, method="POST", path_prefix="/apis/batch/")
    with pytest.raises(ApiException) as raised:
        create_job(api, "later")
    assert raised.value.status == 429 and raised.value.headers["Retry-After"] == "2"
    body = status_of(raised.value)
    assert (body["reason"], body["details"]) == ("TooManyRequests", {"retryAfterSeconds": 2})

    k8s.fail_next(500, method="POST")
    with pytest.raises(ApiException) as raised:
        create_job(api, "later")
    assert (raised.value.status, status_of(raised.value)["reason"]) == (500, "InternalError")
    assert create_job(api, "later").metadata.name == "later"


def test_a_get_answered_429_with_retry_after_is_retried_by_urllib3(
    k8s: KubernetesStandin, api: ApiClient
) -> None:
    """urllib3's default Retry honours Retry-After on idempotent methods, so a provider never
    sees a 429 on a GET; the stand-in's log shows the retry."""
    k8s.fail_next(429, retry_after=0, path_prefix="/apis/batch/v1/namespaces/default/jobs")
    assert client.BatchV1Api(api).list_namespaced_job(NS).items == []
    assert [entry.status for entry in k8s.requests(method="GET")] == [429, 200]


def test_a_hanging_create_times_the_client_out_while_the_server_still_creates(
    k8s: KubernetesStandin, api: ApiClient
) -> None:
    k8s.delay_next(0.6, method="POST")
    started = time.monotonic()
    with pytest.raises(urllib3.exceptions.ReadTimeoutError):
        client.BatchV1Api(api).create_namespaced_job(
            NS, job_body("hung"), _request_timeout=(1, 0.2)
        )
    assert time.monotonic() - started < 0.55
    deadline = time.monotonic() + 3
    while not k8s.jobs() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert [job["metadata"]["name"] for job in k8s.jobs()] == ["hung"]


def test_a_wrong_token_gets_401_and_a_namespaced_token_403_elsewhere(
    k8s: KubernetesStandin,
) -> None:
    with k8s.api_client(token="wrong") as wrong, pytest.raises(ApiException) as raised:
        client.CoreV1Api(wrong).list_namespaced_pod(NS)
    assert (raised.value.status, status_of(raised.value)["reason"]) == (401, "Unauthorized")

    k8s.add_namespace("team")
    k8s.add_token("team-token", namespaces=["team"], user="system:serviceaccount:team:corral")
    with k8s.api_client(token="team-token") as limited:
        assert client.BatchV1Api(limited).list_namespaced_job("team").items == []
        with pytest.raises(ApiException) as raised:
            client.BatchV1Api(limited).list_namespaced_job(NS)
    body = status_of(raised.value)
    assert (raised.value.status, body["reason"]) == (403, "Forbidden")
    assert (
        'cannot list resource "jobs" in API group "batch" in the namespace "default"'
        in body["message"]
    )


def test_resource_quota_reads_back_what_the_test_set(
    k8s: KubernetesStandin, api: ApiClient
) -> None:
    k8s.set_resource_quota(
        "compute",
        hard={"pods": "10", "requests.cpu": "4"},
        used={"pods": "3", "requests.cpu": "1500m"},
    )
    quota = client.CoreV1Api(api).read_namespaced_resource_quota("compute", NS)
    assert quota.spec.hard == {"pods": "10", "requests.cpu": "4"}
    assert quota.status.used == {"pods": "3", "requests.cpu": "1500m"}
    with pytest.raises(ApiException) as raised:
        client.CoreV1Api(api).read_namespaced_resource_quota("missing", NS)
    assert status_of(raised.value)["details"] == {"name": "missing", "kind": "resourcequotas"}


def test_in_cluster_config_works_over_tls(tmp_path: Path) -> None:
    with KubernetesStandin(token=TOKEN, tls=True) as k8s:
        env = k8s.write_incluster_files(tmp_path)
        configuration = client.Configuration()
        InClusterConfigLoader(
            str(tmp_path / "token"), str(tmp_path / "ca.crt"), environ=env
        ).load_and_set(configuration)
        with ApiClient(configuration) as api:
            create_job(api, "tls")
            pod = k8s.job_pod("tls")
            core = client.CoreV1Api(api)
            assert core.read_namespaced_pod(pod, NS).status.phase == "Running"
            ws = stream(
                core.connect_get_namespaced_pod_exec,
                pod,
                NS,
                command=["echo", "ok"],
                stdout=True,
                stderr=True,
                stdin=False,
                tty=False,
                _preload_content=False,
            )
            ws.run_forever(timeout=5)
            assert (ws.read_stdout(), ws.returncode) == ("ok\n", 0)
            close_stream(ws)


def test_start_is_quick_and_stop_leaves_no_thread_or_port() -> None:
    # Other stand-ins (e.g. the session fixture) may be running: only this one's count.
    before = set(threading.enumerate())
    started = time.monotonic()
    standin = KubernetesStandin().start()
    assert time.monotonic() - started < 0.5
    port = standin.port
    standin.stop()
    assert not [
        thread
        for thread in set(threading.enumerate()) - before
        if thread.name == "kubernetes-standin"
    ]
    with socket.socket() as probe:
        assert probe.connect_ex(("127.0.0.1", port)) != 0


def test_stored_objects_match_the_published_schemas(k8s: KubernetesStandin, api: ApiClient) -> None:
    """Every shape the stand-in serves validates strictly against the 1.31 OpenAPI schemas."""
    try:
        import kubernetes_validate
    except ImportError:
        kubernetes_validate = None
    require(
        kubernetes_validate is not None, "kubernetes-validate (pip install kubernetes-validate)"
    )
    create_job(api, "shape")
    client.CoreV1Api(api).create_namespaced_secret(
        NS, client.V1Secret(metadata=client.V1ObjectMeta(name="s"), data={"k": "dg=="})
    )
    k8s.stick_image_pull("shape")
    k8s.set_resource_quota("q", hard={"pods": "1"})
    create_job(api, "done")
    k8s.succeed_job("done")
    objects = [
        obj
        for plural in ("jobs", "pods", "secrets", "events", "resourcequotas")
        for obj in k8s.objects(plural)
    ]
    assert len(objects) > 8
    for obj in objects:
        kubernetes_validate.validate(obj, "1.31", strict=True)


def policy_body(name: str, owner: client.V1Job | None = None, **spec: Any) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": name}
    if owner is not None:
        reference = {"apiVersion": "batch/v1", "kind": "Job", "controller": True}
        reference |= {"name": owner.metadata.name, "uid": owner.metadata.uid}
        meta["ownerReferences"] = [reference]
    body = {
        "podSelector": {"matchLabels": {"job-name": "w"}},
        "egress": [{"ports": [{"port": 53, "protocol": "UDP"}]}],
    }
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": meta,
        "spec": body | spec,
    }


def test_network_policies_are_served_defaulted_validated_and_collected_with_their_owner(
    k8s: KubernetesStandin, api: ApiClient
) -> None:
    networking = client.NetworkingV1Api(api)
    job = create_job(api, "w")
    made = networking.create_namespaced_network_policy(NS, policy_body("w-egress", job))
    assert made.spec.policy_types == ["Ingress", "Egress"]  # defaulted from the rules given
    assert made.spec.egress[0].ports[0].port == 53
    listed = networking.list_namespaced_network_policy(NS).items
    assert [policy.metadata.name for policy in listed] == ["w-egress"]

    both = {"egress": [{"to": [{"ipBlock": {"cidr": "10.0.0.0/8"}, "podSelector": {}}]}]}
    with pytest.raises(ApiException) as raised:
        networking.create_namespaced_network_policy(NS, policy_body("bad", **both))
    body = status_of(raised.value)
    assert (raised.value.status, body["reason"]) == (422, "Invalid")
    assert body["details"]["causes"][0]["field"] == "spec.egress[0].to[0]"
    with pytest.raises(ApiException) as raised:
        networking.create_namespaced_network_policy(
            NS, policy_body("cidr", egress=[{"to": [{"ipBlock": {"cidr": "10.0.0.0/99"}}]}])
        )
    assert "spec.egress[0].to[0].ipBlock.cidr" in status_of(raised.value)["message"]

    client.BatchV1Api(api).delete_namespaced_job("w", NS, propagation_policy="Foreground")
    assert k8s.network_policies() == []


def test_a_suspended_job_gets_its_pod_and_start_time_only_when_resumed(
    k8s: KubernetesStandin, api: ApiClient
) -> None:
    batch = client.BatchV1Api(api)
    create_job(api, "held", suspend=True, active_deadline_seconds=60)
    held = batch.read_namespaced_job("held", NS).status
    assert held.start_time is None and k8s.pods() == []
    assert [(c.type, c.status, c.reason) for c in held.conditions] == [
        ("Suspended", "True", "JobSuspended")
    ]
    k8s.advance(120)  # a suspended Job's deadline does not run
    assert batch.read_namespaced_job("held", NS).status.failed is None

    batch.patch_namespaced_job("held", NS, {"spec": {"suspend": False}})

    resumed = batch.read_namespaced_job("held", NS).status
    assert resumed.start_time is not None and len(k8s.pods(job="held")) == 1
    assert [(c.type, c.status, c.reason) for c in resumed.conditions] == [
        ("Suspended", "False", "JobResumed")
    ]
    k8s.advance(61)
    assert batch.read_namespaced_job("held", NS).status.conditions[-1].reason == "DeadlineExceeded"


def test_run_commands_plays_the_containers_command_into_log_and_exit_code() -> None:
    with KubernetesStandin(token=TOKEN, run_commands=True) as k8s, k8s.api_client() as api:
        batch, core = client.BatchV1Api(api), client.CoreV1Api(api)
        for name, script in (
            ("fails", "echo hi; exit 3"),
            ("serves", "echo ready; exec sleep 300"),
        ):
            job = job_body(name)
            job.spec.template.spec.containers[0].command = ["sh", "-c", script]
            batch.create_namespaced_job(NS, job)
        failed = batch.read_namespaced_job("fails", NS).status
        assert failed.conditions[-1].type == "Failed"
        pod = k8s.job_pod("fails")
        terminated = core.read_namespaced_pod(pod, NS).status.container_statuses[0].state
        assert terminated.terminated.exit_code == 3
        assert core.read_namespaced_pod_log(pod, NS) == "hi\n"
        serving = k8s.job_pod("serves")
        assert core.read_namespaced_pod(serving, NS).status.phase == "Running"
        assert core.read_namespaced_pod_log(serving, NS) == "ready\n"


def test_answers_are_dated_by_the_stand_ins_clock(k8s: KubernetesStandin, api: ApiClient) -> None:
    def server_date() -> datetime:
        _, _, headers = client.CoreV1Api(api).list_namespaced_pod_with_http_info(NS)
        return parsedate_to_datetime(headers["Date"])

    before = server_date()
    k8s.advance(3600)
    assert 3599 <= (server_date() - before).total_seconds() <= 3602


def test_a_create_beyond_a_count_quota_is_forbidden_as_the_admission_plugin_does(
    k8s: KubernetesStandin, api: ApiClient
) -> None:
    k8s.set_resource_quota("jobs", hard={"count/jobs.batch": "1"}, used={"count/jobs.batch": "1"})
    with pytest.raises(ApiException) as raised:
        create_job(api, "over")
    body = status_of(raised.value)
    assert (raised.value.status, body["reason"]) == (403, "Forbidden")
    assert body["message"] == (
        'jobs.batch "over" is forbidden: exceeded quota: jobs, requested: count/jobs.batch=1, '
        "used: count/jobs.batch=1, limited: count/jobs.batch=1"
    )
    assert k8s.jobs() == []


def test_the_default_userland_knows_env_timeout_and_missing_files(
    k8s: KubernetesStandin, api: ApiClient
) -> None:
    core = client.CoreV1Api(api)
    create_job(api, "tools")
    pod = k8s.job_pod("tools")

    def run(*argv: str) -> tuple[str, str, int]:
        options = {"stderr": True, "stdin": False, "stdout": True, "tty": False}
        ws = stream(
            core.connect_get_namespaced_pod_exec,
            pod,
            NS,
            command=list(argv),
            _preload_content=False,
            **options,
        )
        ws.run_forever(timeout=5)
        result = (ws.read_stdout(), ws.read_stderr(), ws.returncode)
        close_stream(ws)
        return result

    assert run("env", "B=2 3", "A=1", "env") == ("A=1\nB=2 3\n", "", 0)
    assert run("timeout", "-s", "KILL", "5", "echo", "in", "time") == ("in time\n", "", 0)
    assert run("cat", "inbox/x") == ("", "cat: inbox/x: No such file or directory\n", 1)


def test_suspending_a_running_job_deletes_its_pod_without_counting_a_failure(
    k8s: KubernetesStandin, api: ApiClient
) -> None:
    batch = client.BatchV1Api(api)
    create_job(api, "paused")
    assert len(k8s.pods(job="paused")) == 1
    batch.patch_namespaced_job("paused", NS, {"spec": {"suspend": True}})
    status = batch.read_namespaced_job("paused", NS).status
    assert k8s.pods() == [] and status.failed is None and status.start_time is None
    assert (status.conditions[-1].type, status.conditions[-1].status) == ("Suspended", "True")
