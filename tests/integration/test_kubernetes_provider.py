"""The kubernetes provider through the official client against the Kubernetes API stand-in on
loopback: what a sandbox is made of (and that it all validates against the 1.31 schemas),
where the registration token goes, how statuses, logs and exec read, what the inventory and
capacity see, how the client is configured, and how API failures are classified. The contract
suite covers the common lifecycle."""

from __future__ import annotations

import base64
import json
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from kubernetes import client

from corral.providers.base import SandboxHandle, SandboxState
from corral.providers.errors import (
    CapacityExhaustedError,
    CredentialRejectedError,
    InvalidProviderConfigError,
    ProviderTimeoutError,
    ProviderUnavailableError,
    SandboxCreateError,
    SandboxNotRunningError,
    TransientProviderError,
)
from corral.providers.kubernetes.objects import job_name
from corral.providers.kubernetes.provider import KubernetesProvider
from tests import floods
from tests.conftest import SpecFactory, require
from tests.standins.kubernetes import ExecResult, KubernetesStandin

TOKEN = "cluster-token-for-provider-tests"
NS = "corral"
JOBS = f"/apis/batch/v1/namespaces/{NS}/jobs"
SECRETS = f"/api/v1/namespaces/{NS}/secrets"
POLICIES = f"/apis/networking.k8s.io/v1/namespaces/{NS}/networkpolicies"
Build = Callable[..., KubernetesProvider]


@pytest.fixture
def k8s() -> Iterator[KubernetesStandin]:
    with KubernetesStandin(token=TOKEN, namespace=NS) as standin:
        yield standin


@pytest.fixture
def kubeconfig(k8s: KubernetesStandin, tmp_path: Path) -> Path:
    return k8s.write_kubeconfig(tmp_path, context="standin")


@pytest.fixture
def build(kubeconfig: Path) -> Iterator[Build]:
    """Providers on the stand-in's kubeconfig and context; closed afterwards."""
    made: list[KubernetesProvider] = []

    def make(**config: Any) -> KubernetesProvider:
        settings = {
            "kubeconfig": str(kubeconfig),
            "context": "standin",
            "namespace": NS,
            "request_timeout_s": 5,
            **config,
        }
        made.append(KubernetesProvider(settings))
        return made[-1]

    yield make
    for provider in made:
        provider.close()


def created(k8s: KubernetesStandin, path: str) -> list[dict[str, Any]]:
    """The bodies of the creates the API accepted under ``path``."""
    return [r.json for r in k8s.requests(method="POST", path_prefix=path) if r.status == 201]


def the_job(k8s: KubernetesStandin, handle: SandboxHandle) -> dict[str, Any]:
    job = k8s.get("jobs", handle.external_id)
    assert job is not None
    return job


# -- what a sandbox is made of ------------------------------------------------------------


def test_the_job_carries_namespace_resources_deadline_ttl_account_pull_secrets_and_labels(
    k8s: KubernetesStandin, build: Build, make_spec: SpecFactory
) -> None:
    provider = build(
        service_account="sandboxes",
        image_pull_secrets=("regcred",),
        ttl_seconds_after_finished=120,
        deployment="blue",
    )
    spec = make_spec(
        resources={"cpu": 1.5, "memory_mb": 2048, "timeout_s": 1200},
        provider_options={
            "command": ["python3", "-m", "runner"],
            "image": "registry.example/runner:2",
        },
    )

    handle = provider.provision(spec)

    job = the_job(k8s, handle)
    assert job["metadata"]["namespace"] == NS and handle.external_id == job_name(spec.sandbox_id)
    expected_labels = {**spec.managed_labels(), "corral.deployment": "blue"}
    assert expected_labels.items() <= job["metadata"]["labels"].items()
    template = job["spec"]["template"]
    assert expected_labels.items() <= template["metadata"]["labels"].items()
    assert (
        job["spec"]["backoffLimit"],
        job["spec"]["activeDeadlineSeconds"],
        job["spec"]["ttlSecondsAfterFinished"],
    ) == (0, 1200, 120)
    pod_spec = template["spec"]
    assert pod_spec["restartPolicy"] == "Never"
    assert pod_spec["serviceAccountName"] == "sandboxes"
    assert pod_spec["imagePullSecrets"] == [{"name": "regcred"}]
    assert pod_spec["automountServiceAccountToken"] is False
    [container] = pod_spec["containers"]
    assert container["image"] == "registry.example/runner:2"
    assert container["command"] == ["python3", "-m", "runner"]
    quantities = {"cpu": "1500m", "memory": "2048Mi"}
    assert container["resources"] == {"requests": quantities, "limits": quantities}
    assert "nodeSelector" not in pod_spec and "tolerations" not in pod_spec
    env = {entry["name"]: entry.get("value") for entry in container["env"]}
    assert env["CORRAL_CONTROL_URL"] == spec.control_url
    assert env["CORRAL_SANDBOX_ID"] == spec.sandbox_id


def test_sandbox_pods_run_restricted_and_without_service_links_unless_configured_otherwise(
    k8s: KubernetesStandin, build: Build, make_spec: SpecFactory
) -> None:
    restricted = the_job(k8s, build().provision(make_spec()))["spec"]["template"]["spec"]
    assert restricted["securityContext"] == {
        "runAsNonRoot": True,
        "runAsUser": 10001,
        "runAsGroup": 10001,
        "seccompProfile": {"type": "RuntimeDefault"},
    }
    assert restricted["containers"][0]["securityContext"] == {
        "allowPrivilegeEscalation": False,
        "capabilities": {"drop": ["ALL"]},
    }
    assert restricted["enableServiceLinks"] is False
    assert "command" not in restricted["containers"][0]  # the image's entrypoint

    provider = build(
        restricted_pod_security=False,
        automount_service_account_token=True,
        command=["python3", "-m", "runner"],
    )
    relaxed = the_job(k8s, provider.provision(make_spec()))["spec"]["template"]["spec"]
    # Relaxed, but never root.
    assert relaxed["securityContext"] == {
        "runAsNonRoot": True,
        "runAsUser": 10001,
        "runAsGroup": 10001,
    }
    assert "securityContext" not in relaxed["containers"][0]
    assert relaxed["automountServiceAccountToken"] is True
    assert relaxed["containers"][0]["command"] == ["python3", "-m", "runner"]


def test_the_job_is_created_suspended_and_resumed_after_its_secret_and_policy_exist(
    k8s: KubernetesStandin, build: Build, make_spec: SpecFactory
) -> None:
    provider = build()
    handle = provider.provision(make_spec(egress={"allow_network": False}))

    writes = [
        (r.method, r.path.rsplit("/", 1)[-1] if r.method == "PATCH" else r.path)
        for r in k8s.requests()
        if r.method in ("POST", "PATCH")
    ]
    assert writes == [
        ("POST", JOBS),
        ("POST", SECRETS),
        ("POST", POLICIES),
        ("PATCH", handle.external_id),
    ]
    assert created(k8s, JOBS)[0]["spec"]["suspend"] is True
    assert k8s.requests(method="PATCH")[0].json == {"spec": {"suspend": False}}
    assert the_job(k8s, handle)["spec"]["suspend"] is False
    assert len(k8s.pods(job=handle.external_id)) == 1


def test_gpu_work_gets_a_gpu_limit_and_the_gpu_node_selector_and_tolerations(
    k8s: KubernetesStandin, build: Build, make_spec: SpecFactory
) -> None:
    toleration = {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}
    provider = build(
        gpu_node_selector={"cloud.example/accelerator": "a100"}, gpu_tolerations=[toleration]
    )

    gpu = the_job(k8s, provider.provision(make_spec(resources={"gpu": 2, "memory_mb": 512})))
    cpu_only = the_job(k8s, provider.provision(make_spec()))

    pod_spec = gpu["spec"]["template"]["spec"]
    resources = pod_spec["containers"][0]["resources"]
    assert resources["limits"] == {"memory": "512Mi", "nvidia.com/gpu": "2"}
    assert resources["requests"] == {"memory": "512Mi"}
    assert pod_spec["nodeSelector"] == {"cloud.example/accelerator": "a100"}
    assert pod_spec["tolerations"] == [toleration]
    plain = cpu_only["spec"]["template"]["spec"]
    assert "nodeSelector" not in plain and "tolerations" not in plain


def test_a_pool_overrides_node_selector_and_tolerations_and_bad_ones_fail_before_any_request(
    k8s: KubernetesStandin, build: Build, make_spec: SpecFactory
) -> None:
    provider = build(gpu_node_selector={"gpu": "yes"})
    pool = {
        "node_selector": {"pool": "batch"},
        "tolerations": [
            {"key": "dedicated", "value": "ci", "effect": "NoExecute", "tolerationSeconds": 60}
        ],
    }

    job = the_job(k8s, provider.provision(make_spec(resources={"gpu": 1}, provider_options=pool)))

    pod_spec = job["spec"]["template"]["spec"]
    assert pod_spec["nodeSelector"] == {"pool": "batch"}
    expected = {"operator": "Equal", **pool["tolerations"][0]}
    assert pod_spec["tolerations"] == [expected]
    k8s.clear_requests()
    bad_pools = [
        {"node_selector": {"bad key!": "x"}},
        {"tolerations": [{"operator": "Equal"}]},  # no key: only Exists may match all
        {"tolerations": [{"key": "a", "operator": "Sometimes"}]},
        {"nodes": {}},
    ]
    for bad in bad_pools:
        with pytest.raises(InvalidProviderConfigError, match="options for provider kubernetes"):
            provider.provision(make_spec(provider_options=bad))
    assert k8s.requests() == []


def test_every_object_sent_and_stored_validates_against_the_1_31_schemas(
    k8s: KubernetesStandin, build: Build, make_spec: SpecFactory
) -> None:
    try:
        import kubernetes_validate
    except ImportError:
        kubernetes_validate = None
    require(
        kubernetes_validate is not None, "kubernetes-validate (pip install kubernetes-validate)"
    )
    provider = build(
        gpu_node_selector={"gpu": "a100"},
        api_egress_cidrs=["10.8.0.0/16"],
        gpu_tolerations=[{"key": "gpu", "operator": "Exists"}],
        service_account="sandboxes",
        image_pull_secrets=("regcred",),
    )
    provider.provision(
        make_spec(
            egress={"allow_network": False},
            env={"CI": "true"},
            resources={"gpu": 1, "cpu": 0.25, "memory_mb": 300, "timeout_s": 600},
        )
    )
    provider.provision(make_spec(provider_options={"command": ["sh", "-c", "exit 0"]}))

    sent = [r.json for r in k8s.requests(method="POST") if r.status == 201]
    stored = [
        obj
        for plural in ("jobs", "secrets", "networkpolicies", "pods")
        for obj in k8s.objects(plural)
    ]
    assert {obj["kind"] for obj in sent} == {"Job", "Secret", "NetworkPolicy"}
    assert len(stored) == 7  # 2 Jobs (after their resume patch), 2 Secrets, 1 policy, 2 pods
    for obj in sent + stored:
        kubernetes_validate.validate(obj, "1.31", strict=True)


# -- the registration token ---------------------------------------------------------------


def test_the_token_is_only_in_the_secret_which_the_job_owns(
    k8s: KubernetesStandin, build: Build, make_spec: SpecFactory
) -> None:
    provider = build()
    spec = make_spec(egress={"allow_network": False})
    token = spec.registration_token.get_secret_value()

    handle = provider.provision(spec)
    provider.status(handle)
    provider.provision(spec)  # a second delivery sends it nowhere again

    carrying = k8s.requests_containing(token)
    assert [(r.method, r.path, r.status) for r in carrying] == [("POST", SECRETS, 201)]
    job = the_job(k8s, handle)
    [secret] = k8s.secrets()
    assert secret["data"] == {"registration-token": base64.b64encode(token.encode()).decode()}
    assert secret["metadata"]["ownerReferences"] == [
        {
            "apiVersion": "batch/v1",
            "kind": "Job",
            "name": handle.external_id,
            "uid": job["metadata"]["uid"],
            "controller": True,
            "blockOwnerDeletion": True,
        }
    ]
    container = job["spec"]["template"]["spec"]["containers"][0]
    [reference] = [e for e in container["env"] if e["name"] == "CORRAL_REGISTRATION_TOKEN"]
    assert reference == {
        "name": "CORRAL_REGISTRATION_TOKEN",
        "valueFrom": {
            "secretKeyRef": {"name": secret["metadata"]["name"], "key": "registration-token"}
        },
    }
    encoded = base64.b64encode(token.encode()).decode()
    for plural in ("jobs", "pods", "events", "networkpolicies"):
        text = json.dumps(k8s.objects(plural))
        assert token not in text and encoded not in text
    assert token not in json.dumps(secret["metadata"])
    assert token not in handle.model_dump_json()


def test_a_refused_create_names_the_apis_reason_and_never_the_token(
    k8s: KubernetesStandin, build: Build, make_spec: SpecFactory
) -> None:
    spec = make_spec(labels={"corral.project-id": "not a label value!"})
    with pytest.raises(SandboxCreateError) as raised:
        build().provision(spec)
    message = str(raised.value)
    assert "422" in message and "metadata.labels" in message and "is invalid" in message
    assert spec.registration_token.get_secret_value() not in message
    assert k8s.jobs() == [] and k8s.secrets() == []


# -- terminate ----------------------------------------------------------------------------


def test_terminate_deletes_job_pod_secret_and_policy_and_a_second_terminate_is_harmless(
    k8s: KubernetesStandin, build: Build, make_spec: SpecFactory
) -> None:
    provider = build()
    handle = provider.provision(make_spec(egress={"allow_network": False}))
    assert len(k8s.jobs()) == len(k8s.pods()) == len(k8s.secrets()) == 1
    assert len(k8s.network_policies()) == 1

    provider.terminate(handle)
    assert (k8s.jobs(), k8s.pods(), k8s.secrets(), k8s.network_policies()) == ([], [], [], [])
    [delete] = k8s.requests(method="DELETE")
    assert delete.params["propagationPolicy"] == ["Foreground"]

    provider.terminate(handle)
    assert [r.status for r in k8s.requests(method="DELETE")] == [202, 404]
    status = provider.status(handle)
    assert (status.state, status.reason) == (SandboxState.TERMINATED, "sandbox no longer exists")


def test_a_job_being_deleted_reads_terminated_leaves_the_inventory_and_is_not_adopted(
    build: Build, make_spec: SpecFactory, tmp_path: Path
) -> None:
    with KubernetesStandin(token=TOKEN, namespace=NS, gc_delay=30) as slow:
        path = slow.write_kubeconfig(tmp_path, context="slow")
        provider = KubernetesProvider({"kubeconfig": str(path), "context": "slow", "namespace": NS})
        handle = provider.provision(make_spec())
        provider.terminate(handle)
        assert slow.get("jobs", handle.external_id) is not None  # the GC is still at work
        assert provider.status(handle).state is SandboxState.TERMINATED
        assert provider.list_managed() == []
        with pytest.raises(ProviderUnavailableError, match="still being deleted"):
            provider.provision(make_spec(sandbox_id=handle.metadata["sandbox_id"]))
        provider.close()


# -- network policy -----------------------------------------------------------------------


def test_without_network_a_policy_owned_by_the_job_allows_only_dns_and_the_api(
    k8s: KubernetesStandin, build: Build, make_spec: SpecFactory
) -> None:
    provider = build(
        api_namespace="corral-system", api_ports=(8000,), api_egress_cidrs=["10.96.0.0/12"]
    )
    handle = provider.provision(make_spec(egress={"allow_network": False}))

    [policy] = k8s.network_policies()
    job = the_job(k8s, handle)
    assert policy["metadata"]["ownerReferences"][0]["uid"] == job["metadata"]["uid"]
    [pod] = k8s.pods(job=handle.external_id)
    selected = policy["spec"]["podSelector"]["matchLabels"]
    assert selected.items() <= pod["metadata"]["labels"].items()
    assert policy["spec"]["policyTypes"] == ["Egress"]

    def in_namespace(name: str) -> dict[str, Any]:
        return {"matchLabels": {"kubernetes.io/metadata.name": name}}

    dns_peer = {
        "namespaceSelector": in_namespace("kube-system"),
        "podSelector": {"matchLabels": {"k8s-app": "kube-dns"}},
    }
    api_peer = {
        "podSelector": {"matchLabels": {"app.kubernetes.io/name": "corral-api"}},
        "namespaceSelector": in_namespace("corral-system"),
    }
    assert policy["spec"]["egress"] == [
        {
            "ports": [{"protocol": "UDP", "port": 53}, {"protocol": "TCP", "port": 53}],
            "to": [dns_peer],
        },
        {
            "to": [api_peer, {"ipBlock": {"cidr": "10.96.0.0/12"}}],
            "ports": [{"protocol": "TCP", "port": 8000}],
        },
    ]


def test_with_network_no_policy_is_made(
    k8s: KubernetesStandin, build: Build, make_spec: SpecFactory
) -> None:
    build().provision(make_spec(egress={"allow_network": True}))
    assert k8s.network_policies() == []
    assert k8s.requests(path_prefix="/apis/networking.k8s.io/") == []


def test_without_network_a_unix_socket_control_url_is_refused_before_any_request(
    k8s: KubernetesStandin, build: Build, make_spec: SpecFactory
) -> None:
    spec = make_spec(egress={"allow_network": False}, control_url="unix:///run/corral.sock")
    with pytest.raises(InvalidProviderConfigError, match="http"):
        build().provision(spec)
    assert k8s.requests() == []


# -- status -------------------------------------------------------------------------------


def test_status_follows_the_pod_from_pending_to_running_to_completed(
    k8s: KubernetesStandin, build: Build, make_spec: SpecFactory
) -> None:
    k8s.pod_start_delay = None
    provider = build()
    handle = provider.provision(make_spec())
    assert provider.status(handle).state is SandboxState.PROVISIONING

    k8s.run_job(handle.external_id)
    assert provider.status(handle).state is SandboxState.RUNNING

    k8s.succeed_job(handle.external_id)
    done = provider.status(handle)
    assert (done.state, done.exit_code, done.reason) == (SandboxState.TERMINATED, 0, "completed")


def test_a_failed_pod_is_failed_with_its_exit_code(
    k8s: KubernetesStandin, build: Build, make_spec: SpecFactory
) -> None:
    provider = build()
    handle = provider.provision(make_spec())
    k8s.fail_pod(handle.external_id, exit_code=3)
    status = provider.status(handle)
    assert (status.state, status.exit_code, status.reason) == (
        SandboxState.FAILED,
        3,
        "exited with code 3",
    )


def test_the_end_log_is_the_last_lines_of_the_pod_log_asked_of_the_api_server(
    k8s: KubernetesStandin, build: Build, make_spec: SpecFactory
) -> None:
    provider = build()
    handle = provider.provision(make_spec())
    printed = "".join(f"line {n}\n" for n in range(1000))
    k8s.fail_pod(handle.external_id, exit_code=3, log=printed + "corral-test: no /opt/tool\n")
    k8s.clear_requests()

    tail = provider.end_log(handle, max_lines=40, max_bytes=16 * 1024)

    assert tail is not None
    assert tail.splitlines() == [
        *(f"line {n}" for n in range(961, 1000)),
        "corral-test: no /opt/tool",
    ]
    [read] = [r for r in k8s.requests("GET") if r.path.endswith("/log")]
    assert read.params["tailLines"] == ["40"]
    assert int(read.params["limitBytes"][0]) <= 4 * 1024 * 1024
    small = provider.end_log(handle, max_lines=40, max_bytes=30)  # the end of "line 999"
    assert small == "999\ncorral-test: no /opt/tool\n"

    provider.terminate(handle)
    assert provider.end_log(handle, max_lines=40, max_bytes=16 * 1024) is None


def test_an_exceeded_deadline_is_failed_with_deadline_exceeded(
    k8s: KubernetesStandin, build: Build, make_spec: SpecFactory
) -> None:
    provider = build()
    handle = provider.provision(make_spec(resources={"timeout_s": 60}))
    assert provider.status(handle).state is SandboxState.RUNNING
    k8s.advance(61)
    status = provider.status(handle)
    assert status.state is SandboxState.FAILED
    assert status.reason is not None and status.reason.startswith("deadline exceeded")


def test_an_image_pull_stuck_within_the_grace_is_provisioning_and_beyond_it_failed(
    k8s: KubernetesStandin, build: Build, make_spec: SpecFactory
) -> None:
    k8s.pod_start_delay = None
    provider = build(image_pull_grace_s=120)
    handle = provider.provision(make_spec(provider_options={"image": "registry.example/nope:1"}))
    k8s.stick_image_pull(handle.external_id, reason="ErrImagePull")
    within = provider.status(handle)
    assert (within.state, within.reason) == (SandboxState.PROVISIONING, "ErrImagePull")

    k8s.advance(60)
    k8s.stick_image_pull(handle.external_id, reason="ImagePullBackOff")
    assert provider.status(handle).state is SandboxState.PROVISIONING

    k8s.advance(61)  # the API server's clock: 121 s since the first failed pull
    beyond = provider.status(handle)
    assert beyond.state is SandboxState.FAILED
    [event] = [
        e
        for e in k8s.events(involving=k8s.job_pod(handle.external_id))
        if e["message"].startswith("Failed to pull image")
    ]
    assert beyond.reason is not None and event["message"] in beyond.reason
    assert "ImagePullBackOff" in beyond.reason


def test_a_missing_job_is_terminated(build: Build) -> None:
    handle = SandboxHandle(
        provider_id="kubernetes", external_id="corral-never-made", metadata={"org_id": "acme"}
    )
    status = build().status(handle)
    assert (status.state, status.reason) == (SandboxState.TERMINATED, "sandbox no longer exists")


# -- logs and exec ------------------------------------------------------------------------


def test_logs_come_from_the_pod_whole_or_followed_and_none_before_it_starts(
    k8s: KubernetesStandin, build: Build, make_spec: SpecFactory
) -> None:
    k8s.pod_start_delay = None
    provider = build()
    handle = provider.provision(make_spec())
    assert list(provider.stream_logs(handle)) == []  # waiting to start

    k8s.run_job(handle.external_id)
    k8s.set_log("line one\nline two\npartial", job=handle.external_id)
    assert list(provider.stream_logs(handle)) == ["line one", "line two", "partial"]
    assert list(provider.stream_logs(handle, follow=True)) == ["line one", "line two", "partial"]
    [followed] = [r for r in k8s.requests(method="GET") if r.path.endswith("/log")][-1:]
    assert followed.params["follow"] == ["true"] and followed.params["container"] == ["sandbox"]


def test_exec_returns_stdout_stderr_and_exit_codes(
    k8s: KubernetesStandin, build: Build, make_spec: SpecFactory
) -> None:
    provider = build()
    handle = provider.provision(make_spec())

    echoed = provider.exec_command(handle, ["echo", "hello", "pod"])
    assert (echoed.stdout, echoed.stderr, echoed.exit_code) == ("hello pod\n", "", 0)
    assert provider.exec_command(handle, "exit 3").exit_code == 3
    missing = provider.exec_command(handle, ["git", "status"])
    assert (missing.exit_code, missing.stderr) == (127, "git: command not found\n")


def _run_here(argv: list[str]) -> ExecResult:
    """Run the argv the pod would run on this machine: real env, sh, cd and timeout. A
    signal's death is reported as the container runtime reports it: 128 + the signal."""
    done = subprocess.run(argv, capture_output=True, text=True, timeout=20, check=False)
    code = done.returncode if done.returncode >= 0 else 128 - done.returncode
    return ExecResult(done.stdout, done.stderr, code)


FLOOD = 20 * 1024 * 1024  # what a command prints, far past the limit
LIMIT = floods.LIMIT


def test_exec_keeps_no_more_than_the_limit_of_a_flood_of_output(
    k8s: KubernetesStandin, build: Build, make_spec: SpecFactory
) -> None:
    provider = build()
    handle = provider.provision(make_spec())
    flood = ExecResult(b"x" * FLOOD, b"e" * FLOOD, 3)  # made before memory is traced
    k8s.set_exec_handler(lambda argv: flood, job=handle.external_id)
    result, peak = floods.peak_while(
        lambda: provider.exec_command(handle, ["yes"], timeout_s=60, max_output_bytes=LIMIT)
    )
    assert (result.stdout, result.stderr) == ("x" * LIMIT, "e" * LIMIT)
    assert result.truncated and result.exit_code == 3
    # 40 MB came over the stream (and the stand-in, in this process, framed them): what was
    # held at once stayed far below that.
    assert peak < 8 * 1024 * 1024, peak


def test_exec_env_and_cwd_reach_the_command_verbatim(
    k8s: KubernetesStandin, build: Build, make_spec: SpecFactory, tmp_path: Path
) -> None:
    provider = build()
    handle = provider.provision(make_spec())
    seen: list[list[str]] = []
    k8s.set_exec_handler(lambda argv: seen.append(argv) or _run_here(argv), job=handle.external_id)
    directory = tmp_path / "work dir with 'quotes' and $dollar"
    directory.mkdir()
    value = 'it\'s "quoted" $HOME `cmd` ; & | *'

    result = provider.exec_command(
        handle,
        ["sh", "-c", 'printf "%s|%s" "$PWD" "$GREETING"'],
        env={"GREETING": value},
        cwd=str(directory),
    )

    assert (result.exit_code, result.stdout) == (0, f"{directory}|{value}")
    assert seen[0][:2] == ["env", f"GREETING={value}"]
    assert str(directory) in seen[0]


def test_exec_past_its_timeout_is_killed_and_raises_provider_timeout(
    k8s: KubernetesStandin, build: Build, make_spec: SpecFactory
) -> None:
    provider = build()
    handle = provider.provision(make_spec())
    k8s.set_exec_handler(_run_here, job=handle.external_id)
    started = time.monotonic()
    with pytest.raises(ProviderTimeoutError, match="killed"):
        provider.exec_command(handle, ["sleep", "10"], timeout_s=1)
    assert 1 <= time.monotonic() - started < 5


def test_exec_whose_stream_hangs_past_timeout_and_grace_raises_provider_timeout(
    k8s: KubernetesStandin, build: Build, make_spec: SpecFactory
) -> None:
    provider = build(exec_timeout_grace_s=0.2)
    handle = provider.provision(make_spec())
    release = threading.Event()
    k8s.set_exec_handler(lambda argv: (release.wait(10), ExecResult())[1], job=handle.external_id)
    started = time.monotonic()
    try:
        with pytest.raises(ProviderTimeoutError, match="outlived"):
            provider.exec_command(handle, ["sleep", "10"], timeout_s=0.2)
        assert time.monotonic() - started < 2
    finally:
        release.set()


def test_exec_needs_a_running_pod(
    k8s: KubernetesStandin, build: Build, make_spec: SpecFactory
) -> None:
    k8s.pod_start_delay = None
    provider = build()
    handle = provider.provision(make_spec())
    with pytest.raises(SandboxNotRunningError):  # pending
        provider.exec_command(handle, ["echo"])
    k8s.succeed_job(handle.external_id)
    with pytest.raises(SandboxNotRunningError):  # ended
        provider.exec_command(handle, ["echo"])
    provider.terminate(handle)
    with pytest.raises(SandboxNotRunningError):  # gone
        provider.exec_command(handle, ["echo"])


def test_exec_refused_before_the_upgrade_is_not_running_or_rejected_by_status(
    k8s: KubernetesStandin, build: Build, make_spec: SpecFactory
) -> None:
    provider = build()
    handle = provider.provision(make_spec())
    exec_path = f"/api/v1/namespaces/{NS}/pods/{k8s.job_pod(handle.external_id)}/exec"
    k8s.fail_next(404, path_prefix=exec_path)
    with pytest.raises(SandboxNotRunningError):
        provider.exec_command(handle, ["echo"])
    k8s.fail_next(403, path_prefix=exec_path)
    with pytest.raises(CredentialRejectedError, match="RBAC"):
        provider.exec_command(handle, ["echo"])
    k8s.fail_next(503, path_prefix=exec_path)
    with pytest.raises(ProviderUnavailableError):
        provider.exec_command(handle, ["echo"])
    assert provider.exec_command(handle, ["echo", "ok"]).stdout == "ok\n"


# -- inventory and capacity ---------------------------------------------------------------


def test_the_inventory_lists_this_deployments_jobs_only_with_their_states(
    k8s: KubernetesStandin, build: Build, make_spec: SpecFactory, kubeconfig: Path
) -> None:
    ours = build(deployment="blue")
    live = ours.provision(make_spec())
    ended = ours.provision(make_spec())
    k8s.fail_pod(ended.external_id, exit_code=3)
    build(deployment="green").provision(make_spec())
    with k8s.api_client() as api:  # a Job corral did not make
        container = client.V1Container(name="main", image="busybox:1", command=["true"])
        template = client.V1PodTemplateSpec(
            spec=client.V1PodSpec(restart_policy="Never", containers=[container])
        )
        unlabelled = client.V1Job(
            metadata=client.V1ObjectMeta(name="unrelated"), spec=client.V1JobSpec(template=template)
        )
        client.BatchV1Api(api).create_namespaced_job(NS, unlabelled)

    listed = {m.handle.external_id: m for m in ours.list_managed()}

    assert set(listed) == {live.external_id, ended.external_id}
    assert listed[live.external_id].state is SandboxState.RUNNING
    assert listed[ended.external_id].state is SandboxState.FAILED
    entry = listed[live.external_id]
    assert entry.sandbox_id == live.metadata["sandbox_id"] and entry.handle.org_id == "acme"
    assert entry.labels["corral.deployment"] == "blue" and entry.started_at is not None
    [listing] = [r for r in k8s.requests(method="GET", path_prefix=JOBS) if r.query][-1:]
    assert listing.params["labelSelector"] == ["corral.managed=true,corral.deployment=blue"]


def test_capacity_comes_from_the_quota_and_max_concurrent_whichever_is_tighter(
    k8s: KubernetesStandin, build: Build, make_spec: SpecFactory
) -> None:
    k8s.set_resource_quota(
        "sandboxes",
        hard={"count/jobs.batch": "5", "pods": "50"},
        used={"count/jobs.batch": "2", "pods": "2"},
    )
    by_quota = build(quota_name="sandboxes")
    assert (by_quota.capacity().limit, by_quota.capacity().in_use) == (5, 2)

    unlimited = build()
    handle = unlimited.provision(make_spec())
    assert (unlimited.capacity().limit, unlimited.capacity().in_use) == (None, 1)
    both = build(quota_name="sandboxes", max_concurrent=2)
    assert (both.capacity().limit, both.capacity().in_use) == (2, 1)
    k8s.succeed_job(handle.external_id)
    assert unlimited.capacity().in_use == 0


def test_a_full_quota_refuses_provisioning_with_capacity_exhausted_and_makes_nothing(
    k8s: KubernetesStandin, build: Build, make_spec: SpecFactory
) -> None:
    k8s.set_resource_quota(
        "sandboxes", hard={"count/jobs.batch": "2"}, used={"count/jobs.batch": "2"}
    )
    with pytest.raises(CapacityExhaustedError):
        build(quota_name="sandboxes").provision(make_spec())
    with pytest.raises(CapacityExhaustedError, match="exceeded quota"):  # the API's own 403
        build().provision(make_spec())
    assert k8s.jobs() == [] and k8s.secrets() == []


# -- client configuration -----------------------------------------------------------------


def test_the_kubeconfig_context_chosen_is_used_not_the_current_one(
    k8s: KubernetesStandin, kubeconfig: Path
) -> None:
    document = yaml.safe_load(kubeconfig.read_text())
    document["users"].append({"name": "stale", "user": {"token": "expired-token"}})
    document["contexts"].append(
        {"name": "stale", "context": {"cluster": "standin-cluster", "user": "stale"}}
    )
    document["current-context"] = "stale"
    kubeconfig.write_text(yaml.safe_dump(document))

    chosen = KubernetesProvider({"kubeconfig": str(kubeconfig), "context": "standin"})
    current = KubernetesProvider({"kubeconfig": str(kubeconfig)})
    try:
        assert chosen.health_check().healthy
        health = current.health_check()
        assert not health.healthy
        assert str(kubeconfig) in health.message and "(the current context)" in health.message
    finally:
        chosen.close()
        current.close()


def test_in_cluster_config_reads_the_service_account_and_speaks_tls(
    make_spec: SpecFactory, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with KubernetesStandin(token=TOKEN, namespace=NS, tls=True) as secure:
        for name, value in secure.write_incluster_files(tmp_path).items():
            monkeypatch.setenv(name, value)
        provider = KubernetesProvider(
            {"in_cluster": True, "service_account_dir": str(tmp_path), "namespace": NS}
        )
        try:
            handle = provider.provision(make_spec())
            assert provider.status(handle).state is SandboxState.RUNNING
            assert provider.exec_command(handle, ["echo", "over", "tls"]).stdout == "over tls\n"
            assert provider.api.configuration.host.startswith("https://")
        finally:
            provider.close()


def test_configuration_that_cannot_work_is_refused(tmp_path: Path) -> None:
    for bad in (
        {"in_cluster": True, "context": "x"},
        {"api_egress_cidrs": ["10.0.0.1/8"]},
        {"api_pod_selector": {}},
        {"namespace": "Not_A_Namespace"},
        {"gpu_node_selector": {"a": "b c"}},
    ):
        with pytest.raises(InvalidProviderConfigError):
            KubernetesProvider(bad)
    missing = KubernetesProvider({"kubeconfig": str(tmp_path / "nope"), "context": "c"})
    health = missing.health_check()
    assert not health.healthy and str(tmp_path / "nope") in health.message


# -- failures -----------------------------------------------------------------------------


@pytest.mark.parametrize("status", [429, 500, 503, 504])
def test_each_call_answered_429_or_5xx_is_sent_again_and_the_provision_succeeds(
    status: int, k8s: KubernetesStandin, build: Build, make_spec: SpecFactory
) -> None:
    provider = build(api_retries=3, api_retry_max_s=0.05)
    spec = make_spec(egress={"allow_network": False})  # a policy too: every kind of call
    for method, path in [("GET", JOBS), ("POST", JOBS), ("POST", SECRETS), ("POST", POLICIES)]:
        k8s.fail_next(status, count=3, method=method, path_prefix=path, retry_after=0)
    k8s.fail_next(status, count=3, method="PATCH", path_prefix=JOBS, retry_after=0)

    handle = provider.provision(spec)

    assert provider.status(handle).state is SandboxState.RUNNING
    assert len(k8s.jobs()) == len(k8s.secrets()) == len(k8s.network_policies()) == 1
    failed = [r for r in k8s.requests() if r.status == status]
    assert len(failed) == 15, "each call failed three times and was sent a fourth"
    k8s.fail_next(status, count=100, method="DELETE", path_prefix=JOBS, retry_after=0)
    with pytest.raises(ProviderUnavailableError):  # past the retries: the caller's to retry
        provider.terminate(handle)
    k8s.clear_failures()
    provider.terminate(handle)
    assert k8s.jobs() == []


def test_a_create_whose_answer_was_lost_is_sent_again_and_adopts_what_it_made(
    k8s: KubernetesStandin, build: Build, make_spec: SpecFactory
) -> None:
    provider = build(api_retries=2, api_retry_max_s=0.05)
    spec = make_spec()
    k8s.fail_next(504, method="POST", path_prefix=JOBS, after=True)  # made, answer lost

    handle = provider.provision(spec)

    assert [r.status for r in k8s.requests(method="POST", path_prefix=JOBS)] == [504, 409]
    assert len(k8s.jobs()) == len(k8s.secrets()) == 1
    assert provider.status(handle).state is SandboxState.RUNNING


@pytest.mark.parametrize("status", [429, 500, 503])
def test_a_busy_or_failing_api_is_transient_and_the_retry_succeeds(
    status: int, k8s: KubernetesStandin, build: Build, make_spec: SpecFactory
) -> None:
    provider = build(api_retries=0)  # the provision's own retry (the provider's: below)
    spec = make_spec()
    k8s.fail_next(status, method="POST", path_prefix=JOBS, retry_after=0 if status == 429 else None)
    with pytest.raises(ProviderUnavailableError) as raised:
        provider.provision(spec)
    assert isinstance(raised.value, TransientProviderError) and raised.value.retryable
    assert k8s.jobs() == []

    handle = provider.provision(spec)
    assert provider.status(handle).state is SandboxState.RUNNING
    assert len(k8s.jobs()) == len(k8s.secrets()) == 1


def test_rejected_credentials_name_the_kubeconfig_and_context_to_fix(
    k8s: KubernetesStandin, make_spec: SpecFactory, tmp_path: Path
) -> None:
    path = k8s.write_kubeconfig(tmp_path, context="ci-cluster", token="revoked")
    provider = KubernetesProvider(
        {"kubeconfig": str(path), "context": "ci-cluster", "namespace": NS}
    )
    try:
        with pytest.raises(CredentialRejectedError) as raised:
            provider.provision(make_spec())
    finally:
        provider.close()
    assert raised.value.code == "credential_rejected"
    assert str(path) in raised.value.message and "ci-cluster" in raised.value.message
    assert "401" in raised.value.message


def test_forbidden_by_rbac_names_the_identity_and_the_rights_it_needs(
    k8s: KubernetesStandin, make_spec: SpecFactory, tmp_path: Path
) -> None:
    k8s.add_namespace("elsewhere")
    k8s.add_token("team-token", namespaces=["elsewhere"], user="system:serviceaccount:x:y")
    path = k8s.write_kubeconfig(tmp_path, context="team", token="team-token")
    provider = KubernetesProvider({"kubeconfig": str(path), "context": "team", "namespace": NS})
    try:
        with pytest.raises(CredentialRejectedError) as raised:
            provider.provision(make_spec())
    finally:
        provider.close()
    message = raised.value.message
    assert "403" in message and "team" in message and str(path) in message
    assert 'User "system:serviceaccount:x:y" cannot get resource "jobs"' in message
    assert "RBAC" in message and f"namespace {NS}" in message


def test_a_hung_api_times_out_as_provider_timeout(
    k8s: KubernetesStandin, build: Build, make_spec: SpecFactory
) -> None:
    k8s.delay_next(2, method="POST", path_prefix=JOBS)
    started = time.monotonic()
    with pytest.raises(ProviderTimeoutError):
        build(request_timeout_s=0.3).provision(make_spec())
    assert time.monotonic() - started < 1.5


def test_an_unreachable_api_is_unavailable_and_unhealthy(
    k8s: KubernetesStandin, build: Build, make_spec: SpecFactory
) -> None:
    provider = build(request_timeout_s=1)
    k8s.stop()
    with pytest.raises(ProviderUnavailableError, match="could not be reached"):
        provider.provision(make_spec())
    health = provider.health_check()
    assert not health.healthy and "could not be reached" in health.message


def test_a_missing_namespace_fails_the_create_naming_it(
    build: Build, make_spec: SpecFactory
) -> None:
    with pytest.raises(SandboxCreateError, match="namespace nowhere does not exist"):
        build(namespace="nowhere").provision(make_spec())


# -- idempotence and interrupted provisions -----------------------------------------------


def test_a_provision_interrupted_after_the_job_leaves_it_suspended_and_the_retry_completes_it(
    k8s: KubernetesStandin, build: Build, make_spec: SpecFactory
) -> None:
    provider = build(api_retries=0)
    spec = make_spec()
    k8s.fail_next(500, method="POST", path_prefix=SECRETS)
    with pytest.raises(ProviderUnavailableError):
        provider.provision(spec)
    [job] = k8s.jobs()
    assert job["spec"]["suspend"] is True and k8s.pods() == [] and k8s.secrets() == []

    handle = provider.provision(spec)

    [secret] = k8s.secrets()
    assert secret["metadata"]["ownerReferences"][0]["uid"] == job["metadata"]["uid"]
    assert the_job(k8s, handle)["spec"]["suspend"] is False
    assert provider.status(handle).state is SandboxState.RUNNING


def test_a_provision_refused_after_the_job_was_made_deletes_the_job(
    k8s: KubernetesStandin, build: Build, make_spec: SpecFactory
) -> None:
    k8s.fail_next(422, method="POST", path_prefix=POLICIES, message="spec.egress: invalid")
    with pytest.raises(SandboxCreateError, match=r"spec\.egress: invalid"):
        build().provision(make_spec(egress={"allow_network": False}))
    assert (k8s.jobs(), k8s.secrets(), k8s.pods()) == ([], [], [])


def test_a_second_provision_returns_the_same_handle_and_makes_nothing_new(
    k8s: KubernetesStandin, build: Build, make_spec: SpecFactory
) -> None:
    provider = build()
    spec = make_spec(egress={"allow_network": False})
    first = provider.provision(spec)
    k8s.clear_requests()

    second = build().provision(spec)  # another worker, same delivery

    assert second == first
    assert {r.method for r in k8s.requests()} == {"GET"}
    assert len(k8s.jobs()) == len(k8s.secrets()) == len(k8s.network_policies()) == 1


def test_a_job_created_concurrently_is_adopted_on_409(
    k8s: KubernetesStandin, build: Build, make_spec: SpecFactory
) -> None:
    spec = make_spec()
    first = build().provision(spec)
    # The other worker's lookup misses (as if it ran just before the first create) ...
    k8s.fail_next(404, method="GET", path_prefix=f"{JOBS}/{first.external_id}")
    second = build().provision(spec)  # ... so it creates, gets 409 AlreadyExists, adopts

    assert second == first
    assert [r.status for r in k8s.requests(method="POST", path_prefix=JOBS)] == [201, 409]
    assert len(k8s.jobs()) == len(k8s.secrets()) == 1


def test_a_job_of_another_sandbox_under_the_name_is_not_adopted(
    k8s: KubernetesStandin, build: Build, make_spec: SpecFactory
) -> None:
    spec = make_spec()
    build(deployment="other").provision(spec)
    with pytest.raises(SandboxCreateError, match="does not belong"):
        build().provision(spec)
    assert len(k8s.secrets()) == 1


def test_job_names_are_dns_labels_distinct_for_ids_that_differ_only_in_case() -> None:
    names = {job_name(i) for i in ("sb-1", "SB-1", "sb_1", "sb.1", "x" * 63, "x" * 62 + "y")}
    assert len(names) == 6
    assert job_name("sb-1") == "corral-sb-1"
    for name in names:
        assert len(name) <= 63 and name == name.lower() and name[0].isalnum()
        assert name[-1].isalnum() and all(c.isalnum() or c == "-" for c in name)


def test_allowed_hosts_become_policy_rules_to_their_addresses_beside_dns_and_the_api(
    k8s: KubernetesStandin, build: Build, make_spec: SpecFactory
) -> None:
    provider = build(api_ports=(8000,), api_egress_cidrs=["10.96.0.0/12"])
    allowed = ["localhost:8443", "10.1.0.0/16", "192.0.2.7"]
    handle = provider.provision(make_spec(egress={"allow_network": True, "allowed_hosts": allowed}))

    [policy] = k8s.network_policies()
    assert policy["metadata"]["ownerReferences"][0]["name"] == handle.external_id
    dns, api, *rules = policy["spec"]["egress"]
    assert {"protocol": "UDP", "port": 53} in dns["ports"]
    assert {"ipBlock": {"cidr": "10.96.0.0/12"}} in api["to"]
    localhost = {peer["ipBlock"]["cidr"] for peer in rules[0]["to"]}
    assert "127.0.0.1/32" in localhost and localhost <= {"127.0.0.1/32", "::1/128"}
    assert rules[0]["ports"] == [{"protocol": "TCP", "port": 8443}]
    assert rules[1:] == [
        {"to": [{"ipBlock": {"cidr": "10.1.0.0/16"}}]},
        {"to": [{"ipBlock": {"cidr": "192.0.2.7/32"}}]},
    ]


def test_an_allowed_host_that_does_not_resolve_fails_the_provision_saying_so(
    k8s: KubernetesStandin, build: Build, make_spec: SpecFactory
) -> None:
    spec = make_spec(egress={"allow_network": True, "allowed_hosts": ["no-such-host.invalid"]})
    with pytest.raises(SandboxCreateError, match="does not resolve"):
        build().provision(spec)
    assert k8s.network_policies() == []
