"""The kubernetes provider's configuration, what it sends to the API server, and how it reads
what comes back.

Pure code over the API's JSON shapes (camelCase field names, as ``kubectl get -o json`` shows
them), without the ``kubernetes`` SDK: the manifests are plain dicts so that exactly what goes
over the wire is visible in one place, and status is a function of the returned dicts alone.

Three objects make one sandbox, all labelled with corral's labels and this deployment's:

* the ``batch/v1`` Job, created suspended so that nothing runs before the rest exists;
* a Secret with the registration token, owned by the Job and referenced from the container's
  env with ``secretKeyRef``: the token is in no other object;
* without network or with allowed hosts, a NetworkPolicy owned by the Job that lets the
  pod reach the allowed hosts' addresses (names resolved at provision time), DNS and the
  corral api, and nothing else.
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import hashlib
import hmac
import ipaddress
import json
import math
import re
import socket
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from datetime import UTC, datetime
from email.utils import parsedate_to_datetime
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from corral.providers.base import Resources, SandboxSpec, SandboxState, SandboxStatus, exit_status
from corral.providers.config import ProviderConfig, ProviderOptions
from corral.providers.egress.rules import parse_host_rules
from corral.providers.errors import InvalidProviderConfigError, ProviderUnavailableError

JSON = dict[str, Any]

CONTAINER = "sandbox"
TOKEN_KEY = "registration-token"  # noqa: S105 - the Secret's key, not a secret
TOKEN_ENV = "CORRAL_REGISTRATION_TOKEN"  # noqa: S105 - a variable name
DEPLOYMENT_LABEL = "corral.deployment"
SANDBOX_LABEL = "corral.sandbox-id"
JOB_NAME_LABEL = "job-name"  # set on a Job's pods by every Kubernetes version
_MAX_NAME = 63  # a Job's name becomes a label value on its pods
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
_LABEL_NAME = r"([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]"
_LABEL_KEY = re.compile(
    rf"^([a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?"
    rf"{_LABEL_NAME}$"
)
_LABEL_VALUE = re.compile(rf"^({_LABEL_NAME})?$")
# Waiting reasons of a container that will not start on its own (past a grace period the
# sandbox has failed), and those no grace period can help.
STUCK_REASONS = frozenset(
    {
        "ErrImagePull",
        "ImagePullBackOff",
        "InvalidImageName",
        "ErrImageNeverPull",
        "CreateContainerConfigError",
    }
)
_HOPELESS_REASONS = frozenset({"InvalidImageName", "ErrImageNeverPull"})
_CD_WRAPPER = 'cd -- "$1" && shift && exec "$@"'


def job_name(sandbox_id: str) -> str:
    """A DNS-1123 label of at most 63 characters, stable for a sandbox id.

    Ids that are not already lowercase DNS-safe, or too long with the prefix, get a hash of
    the id appended, so ids differing only in case or in ``_``/``.`` never share a Job.
    """
    safe = re.sub(r"[^a-z0-9-]", "-", sandbox_id.lower()).strip("-")
    name = f"corral-{safe}"
    if safe == sandbox_id and len(name) <= _MAX_NAME:
        return name
    digest = hashlib.sha256(sandbox_id.encode()).hexdigest()[:10]
    return f"{name[: _MAX_NAME - len(digest) - 1].rstrip('-')}-{digest}"


def secret_name(job: str) -> str:
    return f"{job}-token"


def policy_name(job: str) -> str:
    return f"{job}-egress"


# -- configuration ------------------------------------------------------------------------


def check_labels(labels: Mapping[str, str]) -> dict[str, str]:
    """``labels`` if every key and value is a valid label key and value (as selectors need)."""
    for key, value in labels.items():
        if not _LABEL_KEY.match(key) or len(key.rsplit("/", 1)[-1]) > 63:
            raise ValueError(f"{key!r} is not a valid label key")
        if not _LABEL_VALUE.match(value) or len(value) > 63:
            raise ValueError(f"the value for {key!r} is not a valid label value")
    return dict(labels)


def check_cidrs(cidrs: Iterable[str]) -> tuple[str, ...]:
    """CIDRs in canonical form; a host address with a prefix (10.0.0.1/8) is refused."""
    try:
        return tuple(str(ipaddress.ip_network(cidr)) for cidr in cidrs)
    except ValueError as exc:
        raise ValueError(f"not a network in CIDR notation: {exc}") from exc


class Toleration(BaseModel):
    """A pod toleration, in the API's field names; checked before it reaches a cluster."""

    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)

    key: str | None = None
    operator: Literal["Exists", "Equal"] = "Equal"
    value: str | None = None
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = None
    toleration_seconds: int | None = Field(default=None, alias="tolerationSeconds")

    @model_validator(mode="after")
    def _consistent(self) -> Toleration:
        if self.operator == "Exists" and self.value:
            raise ValueError("a toleration with operator Exists takes no value")
        if not self.key and self.operator != "Exists":
            raise ValueError("a toleration without key must use operator Exists")
        if self.toleration_seconds is not None and self.effect != "NoExecute":
            raise ValueError("tolerationSeconds applies to effect NoExecute only")
        return self


class KubernetesProviderConfig(ProviderConfig):
    """Deployment-wide configuration of the kubernetes provider: one cluster namespace.

    Authentication is either the pod's service account (``in_cluster``) or a kubeconfig
    (default: ``KUBECONFIG``, else ``~/.kube/config``) and context (default: its current one).
    """

    in_cluster: bool = False
    kubeconfig: str | None = None
    context: str | None = None
    service_account_dir: str | None = Field(default=None, description="in-cluster token and CA")
    namespace: str = Field(default="corral", description="where sandboxes are made")
    image: str = Field(default="corral-sandbox:dev", description="when the spec names none")
    command: tuple[str, ...] | None = Field(default=None, min_length=1, description="argv")
    service_account: str | None = Field(default=None, description="the sandbox pods' account")
    automount_service_account_token: bool = False
    image_pull_secrets: tuple[str, ...] = ()
    restricted_pod_security: bool = Field(default=True, description="Pod Security restricted")
    sandbox_uid: int = Field(
        default=10001, gt=0, description="runAsUser of sandbox pods: never root, even relaxed"
    )
    sandbox_gid: int = Field(default=10001, gt=0, description="runAsGroup of sandbox pods")
    default_timeout_s: int = Field(default=3600, gt=0, description="activeDeadlineSeconds")
    ttl_seconds_after_finished: int = Field(default=300, ge=0)
    image_pull_grace_s: float = Field(
        default=120, ge=0, description="how long a container may fail to pull or start"
    )
    deployment: str = Field(default="default", description="tells this deployment's apart")
    quota_name: str | None = Field(default=None, description="ResourceQuota of the capacity")
    max_concurrent: int | None = Field(default=None, gt=0, description="live Jobs at most")
    request_timeout_s: float = Field(default=30, gt=0)
    api_retries: int = Field(
        default=4,
        ge=0,
        le=20,
        description="each API call answered 429, 5xx or not at all is sent again this many "
        "times (every call corral makes is idempotent) before the provision fails transiently",
    )
    api_retry_max_s: float = Field(
        default=2.0, ge=0, le=60, description="the longest wait before a call is sent again"
    )
    exec_timeout_grace_s: float = Field(
        default=5, ge=0, description="how long exec waits past a command's timeout for its end"
    )
    gpu_resource: str = "nvidia.com/gpu"
    gpu_node_selector: dict[str, str] = Field(default_factory=dict)
    gpu_tolerations: tuple[Toleration, ...] = ()
    api_pod_selector: dict[str, str] = Field(
        default_factory=lambda: {"app.kubernetes.io/name": "corral-api"},
        description="labels of the api pods, which sandboxes without network may reach",
    )
    api_namespace: str | None = Field(default=None, description="default: the sandboxes'")
    api_ports: tuple[int, ...] = Field(default=(), description="api pod ports; empty: any")
    api_egress_cidrs: tuple[str, ...] = Field(
        default=(), description="networks sandboxes without network may also reach"
    )
    dns_namespace: str = "kube-system"
    dns_pod_selector: dict[str, str] = Field(
        default_factory=lambda: {"k8s-app": "kube-dns"}, description="empty: port 53 anywhere"
    )

    @field_validator("namespace", "api_namespace", "dns_namespace")
    @classmethod
    def _namespace(cls, value: str | None) -> str | None:
        if value is not None and (not _DNS_LABEL.match(value) or len(value) > 63):
            raise ValueError("must be a namespace name (a DNS-1123 label)")
        return value

    @field_validator("deployment")
    @classmethod
    def _deployment(cls, value: str) -> str:
        return check_labels({DEPLOYMENT_LABEL: value})[DEPLOYMENT_LABEL]

    @field_validator("gpu_node_selector", "api_pod_selector", "dns_pod_selector")
    @classmethod
    def _selector(cls, value: dict[str, str]) -> dict[str, str]:
        return check_labels(value)

    @field_validator("api_egress_cidrs")
    @classmethod
    def _cidrs(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        return check_cidrs(value)

    @model_validator(mode="after")
    def _consistent(self) -> KubernetesProviderConfig:
        if self.in_cluster and (self.kubeconfig or self.context):
            raise ValueError("in_cluster uses the service account; drop kubeconfig and context")
        if not self.api_pod_selector and not self.api_egress_cidrs:
            raise ValueError(
                "sandboxes without network need a way to the api: set "
                "api_pod_selector or api_egress_cidrs"
            )
        if any(not 0 < port < 65536 for port in self.api_ports):
            raise ValueError("api_ports must be between 1 and 65535")
        return self


class KubernetesProviderOptions(ProviderOptions):
    """Per-sandbox options of the kubernetes provider (a pool's ``sandbox_config``): the
    image and command, and where its pods are scheduled (a placement key given replaces the
    provider's default, the GPU ones included)."""

    command: tuple[str, ...] | None = Field(default=None, min_length=1, description="argv")
    image: str | None = Field(default=None, min_length=1, description="another image")
    node_selector: dict[str, str] | None = None
    tolerations: tuple[Toleration, ...] | None = None

    @field_validator("node_selector")
    @classmethod
    def _selector(cls, value: dict[str, str] | None) -> dict[str, str] | None:
        return None if value is None else check_labels(value)


# -- manifests ----------------------------------------------------------------------------


def sandbox_labels(config: KubernetesProviderConfig, spec: SandboxSpec) -> dict[str, str]:
    return {**spec.managed_labels(), DEPLOYMENT_LABEL: config.deployment}


def container_resources(resources: Resources, gpu_resource: str) -> JSON:
    """Requests equal to limits for cpu and memory (what the sandbox asked for, no more), and
    GPUs as an extended-resource limit, which the scheduler counts as the request too."""
    requests: dict[str, str] = {}
    limits: dict[str, str] = {}
    if resources.cpu:
        requests["cpu"] = limits["cpu"] = f"{max(1, round(resources.cpu * 1000))}m"
    if resources.memory_mb:
        requests["memory"] = limits["memory"] = f"{resources.memory_mb}Mi"
    if resources.gpu:
        limits[gpu_resource] = str(resources.gpu)
    return {key: value for key, value in (("requests", requests), ("limits", limits)) if value}


def env_entries(env: Mapping[str, str], secret: str) -> list[JSON]:
    """Every variable as a plain value but the token, a reference to the Secret instead."""
    entries: list[JSON] = [{"name": k, "value": v} for k, v in env.items() if k != TOKEN_ENV]
    entries.append(
        {"name": TOKEN_ENV, "valueFrom": {"secretKeyRef": {"name": secret, "key": TOKEN_KEY}}}
    )
    return entries


def _placement(
    config: KubernetesProviderConfig, spec: SandboxSpec, options: KubernetesProviderOptions
) -> JSON:
    gpu = spec.resources.gpu > 0
    selector = (
        options.node_selector
        if options.node_selector is not None
        else (config.gpu_node_selector if gpu else {})
    )
    tolerations = (
        options.tolerations
        if options.tolerations is not None
        else (config.gpu_tolerations if gpu else ())
    )
    placement: JSON = {}
    if selector:
        placement["nodeSelector"] = dict(selector)
    if tolerations:
        placement["tolerations"] = [
            t.model_dump(by_alias=True, exclude_none=True) for t in tolerations
        ]
    return placement


def _pod_spec(
    config: KubernetesProviderConfig,
    spec: SandboxSpec,
    options: KubernetesProviderOptions,
    name: str,
) -> JSON:
    container: JSON = {
        "name": CONTAINER,
        "image": spec.image or options.image or config.image,
        "env": env_entries(spec.sandbox_env(), secret_name(name)),
        "resources": container_resources(spec.resources, config.gpu_resource),
    }
    if options.command or config.command:
        container["command"] = list(options.command or config.command or ())
    # No service-discovery variables of the namespace and no API token unless asked for:
    # the sandbox gets the environment the spec gives it.
    pod: JSON = {
        "restartPolicy": "Never",
        "containers": [container],
        "enableServiceLinks": False,
        "automountServiceAccountToken": config.automount_service_account_token,
    }
    # Never root, whatever the image says (restricted or not).
    pod["securityContext"] = {
        "runAsNonRoot": True,
        "runAsUser": config.sandbox_uid,
        "runAsGroup": config.sandbox_gid,
    }
    if config.restricted_pod_security:
        pod["securityContext"]["seccompProfile"] = {"type": "RuntimeDefault"}
        container["securityContext"] = {
            "allowPrivilegeEscalation": False,
            "capabilities": {"drop": ["ALL"]},
        }
    if config.service_account:
        pod["serviceAccountName"] = config.service_account
    if config.image_pull_secrets:
        pod["imagePullSecrets"] = [{"name": secret} for secret in config.image_pull_secrets]
    return pod


def job_manifest(
    config: KubernetesProviderConfig,
    spec: SandboxSpec,
    options: KubernetesProviderOptions,
) -> JSON:
    """The sandbox's Job, suspended: it is resumed once its Secret (and policy) exist."""
    name, labels = job_name(spec.sandbox_id), sandbox_labels(config, spec)
    pod = _pod_spec(config, spec, options, name) | _placement(config, spec, options)
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {"name": name, "labels": labels},
        "spec": {
            "suspend": True,
            "backoffLimit": 0,
            "activeDeadlineSeconds": spec.resources.timeout_s or config.default_timeout_s,
            "ttlSecondsAfterFinished": config.ttl_seconds_after_finished,
            "template": {"metadata": {"labels": dict(labels)}, "spec": pod},
        },
    }


def owned_metadata(job: JSON, name: str, labels: Mapping[str, str]) -> JSON:
    """Metadata that makes the Job the controller of an object: deleting the Job deletes it."""
    meta = job["metadata"]
    owner = {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "name": meta["name"],
        "uid": meta["uid"],
        "controller": True,
        "blockOwnerDeletion": True,
    }
    return {"name": name, "labels": dict(labels), "ownerReferences": [owner]}


def is_owned_by(obj: JSON, job: JSON) -> bool:
    owners = obj["metadata"].get("ownerReferences") or []
    return any(ref.get("uid") == job["metadata"]["uid"] for ref in owners)


def secret_manifest(job: JSON, labels: Mapping[str, str], token: str) -> JSON:
    meta = owned_metadata(job, secret_name(job["metadata"]["name"]), labels)
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": meta,
        "type": "Opaque",
        "immutable": True,
        "stringData": {TOKEN_KEY: token},
    }


def holds_token(secret: JSON, token: str) -> bool:
    """Whether a token Secret, as the API returns it (``data``, base64), holds ``token``."""
    value = (secret.get("data") or {}).get(TOKEN_KEY)
    try:
        stored = base64.b64decode(str(value), validate=True) if value else b""
    except (binascii.Error, ValueError):
        return False
    return hmac.compare_digest(stored, token.encode())


def _in_namespace(namespace: str) -> JSON:
    return {"matchLabels": {"kubernetes.io/metadata.name": namespace}}


def resolved_addresses(host: str) -> list[str]:
    """The addresses ``host`` resolves to now, as /32 or /128 networks.

    Raises:
        OSError: it does not resolve.
    """
    found = {info[4][0] for info in socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)}
    return sorted(str(ipaddress.ip_network(address)) for address in found)


def allowed_host_rules(
    hosts: Sequence[str], resolve: Callable[[str], list[str]] = resolved_addresses
) -> list[JSON]:
    """NetworkPolicy egress rules for a spec's ``allowed_hosts``: each entry's address or
    network, a name's addresses as it resolves at provision time, and its port if it has one.

    Raises:
        OSError: a name does not resolve.
    """
    rules = []
    for rule in parse_host_rules(tuple(hosts)):
        network = rule.network
        cidrs = [str(network)] if network is not None else resolve(rule.host)
        entry: JSON = {"to": [{"ipBlock": {"cidr": cidr}} for cidr in cidrs]}
        if rule.port is not None:
            entry["ports"] = [{"protocol": "TCP", "port": rule.port}]
        rules.append(entry)
    return rules


def network_policy_manifest(
    config: KubernetesProviderConfig, spec: SandboxSpec, job: JSON, allowed: Sequence[JSON] = ()
) -> JSON:
    """Egress from the sandbox's pod to DNS and the api only, and to ``allowed`` (the rules
    of its allowed hosts, :func:`allowed_host_rules`). Ingress is left alone: exec and logs
    go through the kubelet, and a dial-in transport needs it."""
    dns: JSON = {"ports": [{"protocol": "UDP", "port": 53}, {"protocol": "TCP", "port": 53}]}
    if config.dns_pod_selector:
        dns["to"] = [
            {
                "namespaceSelector": _in_namespace(config.dns_namespace),
                "podSelector": {"matchLabels": dict(config.dns_pod_selector)},
            }
        ]
    peers: list[JSON] = []
    if config.api_pod_selector:
        peers.append({"podSelector": {"matchLabels": dict(config.api_pod_selector)}})
        if config.api_namespace:
            peers[0]["namespaceSelector"] = _in_namespace(config.api_namespace)
    peers += [{"ipBlock": {"cidr": cidr}} for cidr in config.api_egress_cidrs]
    api: JSON = {"to": peers}
    if config.api_ports:
        api["ports"] = [{"protocol": "TCP", "port": port} for port in config.api_ports]
    pod = {SANDBOX_LABEL: spec.sandbox_id, DEPLOYMENT_LABEL: config.deployment}
    meta = owned_metadata(job, policy_name(job["metadata"]["name"]), sandbox_labels(config, spec))
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": meta,
        "spec": {
            "podSelector": {"matchLabels": pod},
            "policyTypes": ["Egress"],
            "egress": [dns, api, *allowed],
        },
    }


# -- exec ---------------------------------------------------------------------------------


def exec_argv(
    command: str | Sequence[str],
    *,
    env: Mapping[str, str] | None = None,
    cwd: str | None = None,
    timeout_s: float | None = None,
) -> list[str]:
    """The argv the pod exec API runs for one command.

    The exec API has no env, working directory or timeout, so the command is wrapped: ``env
    NAME=VALUE ...``, then ``sh -c 'cd -- "$1" && shift && exec "$@"'`` with the directory
    and the argv as positional parameters, then ``timeout -s KILL``. Values travel as argv
    words of their own and never through shell parsing, so no quoting is involved.
    """
    argv = ["/bin/sh", "-c", command] if isinstance(command, str) else list(command)
    if not argv:
        raise InvalidProviderConfigError("exec needs a command; got an empty argv")
    if timeout_s is not None:
        argv = ["timeout", "-s", "KILL", str(max(1, math.ceil(timeout_s))), *argv]
    if cwd:
        argv = ["/bin/sh", "-c", _CD_WRAPPER, "corral-exec", cwd, *argv]
    if env:
        bad = sorted(name for name in env if not _ENV_NAME.match(name))
        if bad:
            raise InvalidProviderConfigError(f"invalid variable name(s) for exec: {bad}")
        argv = ["env", *(f"{name}={value}" for name, value in env.items()), *argv]
    return argv


def exec_exit(raw_status: str, stderr: str) -> tuple[int, str]:
    """The exit code in the exec error channel's ``Status`` (v4 and v5 alike). A command that
    did not start at all (not found, not executable) is a result too: 127 or 126, with the
    reason on stderr. A stream that ended without a status failed."""
    try:
        status = json.loads(raw_status) if raw_status else None
    except ValueError:
        status = None
    if not isinstance(status, dict) or not status:
        raise ProviderUnavailableError("the exec stream ended without the command's status")
    if status.get("status") == "Success":
        return 0, stderr
    causes = (status.get("details") or {}).get("causes") or []
    codes = [cause["message"] for cause in causes if cause.get("reason") == "ExitCode"]
    if status.get("reason") == "NonZeroExitCode" and codes:
        return int(codes[0]), stderr
    message = str(status.get("message") or status.get("reason") or "the command did not run")
    return (127 if "not found" in message else 126), f"{stderr}{message}\n"


def lines(chunks: Iterable[bytes]) -> Iterator[str]:
    """Log chunks as lines (a last line without newline included)."""
    pending = b""
    for chunk in chunks:
        pending += chunk
        *complete, pending = pending.split(b"\n")
        yield from (line.decode(errors="replace") for line in complete)
    if pending:
        yield pending.decode(errors="replace")


# -- reading answers ----------------------------------------------------------------------


def api_message(body: Any, reason: Any, secret: str | None = None) -> str:
    """The ``message`` of an error answer's Status body (else the HTTP reason), shortened,
    with ``secret`` scrubbed out."""
    try:
        text = str(json.loads(body or "{}").get("message") or reason or "")
    except (ValueError, AttributeError):
        text = str(reason or "")
    if secret:
        text = text.replace(secret, "[redacted]")
    return text if len(text) < 500 else text[:497] + "..."


def server_time(headers: Any) -> datetime:
    """The API server's clock, from an answer's Date header; this machine's without one."""
    date = (headers or {}).get("Date") or (headers or {}).get("date")
    if date:
        with contextlib.suppress(TypeError, ValueError):
            return parsedate_to_datetime(str(date)).astimezone(UTC)
    return datetime.now(UTC)


def parse_time(value: Any) -> datetime | None:
    """A ``metav1.Time`` as the SDK serialises it (ISO 8601, ``Z`` or an offset)."""
    return datetime.fromisoformat(str(value).replace("Z", "+00:00")) if value else None


def is_suspended(job: JSON) -> bool:
    return bool((job.get("spec") or {}).get("suspend"))


def newest_pod(pods: Sequence[JSON]) -> JSON | None:
    """The Job's current pod: a live one before ended ones, then the newest."""

    def rank(pod: JSON) -> tuple[bool, str, str]:
        live = (pod.get("status") or {}).get("phase") in ("Pending", "Running")
        meta = pod["metadata"]
        return live, str(meta.get("creationTimestamp") or ""), str(meta["name"])

    return max(pods, key=rank, default=None)


def _container_state(pod: JSON | None, key: str) -> JSON:
    """The sandbox container's ``running``/``waiting``/``terminated`` state, or {}."""
    statuses = ((pod or {}).get("status") or {}).get("containerStatuses") or []
    state = next((s.get("state") or {} for s in statuses if s.get("name") == CONTAINER), {})
    return dict(state.get(key) or {})


def exited_status(terminated: JSON) -> SandboxStatus:
    """A container that ended: 0 is a clean end, anything else a failure with its cause."""
    code = terminated.get("exitCode")
    return exit_status(
        code if isinstance(code, int) else None,
        out_of_memory=terminated.get("reason") == "OOMKilled",
        detail=terminated.get("message"),
    )


def finished_status(job: JSON, pod: JSON | None) -> SandboxStatus | None:
    """The Job's outcome once the job controller has decided it, else None. ``FailureTarget``
    and ``SuccessCriteriaMet`` (1.31+) precede ``Failed`` and ``Complete`` and decide too."""
    conditions = (job.get("status") or {}).get("conditions") or []
    true = {c["type"]: c for c in conditions if c.get("status") == "True"}
    failed = true.get("Failed") or true.get("FailureTarget")
    terminated = _container_state(pod, "terminated")
    if failed is not None:
        code = terminated.get("exitCode")
        if failed.get("reason") == "DeadlineExceeded":
            detail = failed.get("message") or "the sandbox outlived its timeout"
            return SandboxStatus(
                state=SandboxState.FAILED, reason=f"deadline exceeded: {detail}", exit_code=code
            )
        if code not in (None, 0):
            return exited_status(terminated)
        why = failed.get("message") or failed.get("reason") or "the Job failed"
        return SandboxStatus(state=SandboxState.FAILED, reason=f"failed: {why}", exit_code=code)
    if "Complete" in true or "SuccessCriteriaMet" in true:
        return SandboxStatus(state=SandboxState.TERMINATED, reason="completed", exit_code=0)
    return None


def pod_status(pod: JSON) -> SandboxStatus:
    """A pod of an undecided Job, by its phase (waiting trouble is read separately)."""
    phase = (pod.get("status") or {}).get("phase")
    if phase == "Running":
        return SandboxStatus(state=SandboxState.RUNNING)
    if phase in ("Succeeded", "Failed"):
        terminated = _container_state(pod, "terminated")
        if terminated:
            return exited_status(terminated)
        state = SandboxState.TERMINATED if phase == "Succeeded" else SandboxState.FAILED
        return SandboxStatus(state=state, reason=f"pod {phase.lower()}")
    return SandboxStatus(state=SandboxState.PROVISIONING)


def stuck_waiting(pod: JSON) -> JSON | None:
    """The sandbox container's ``waiting`` state when it will not start on its own."""
    waiting = _container_state(pod, "waiting")
    return waiting if waiting.get("reason") in STUCK_REASONS else None


def stuck_status(
    waiting: JSON, pod: JSON, events: Sequence[JSON], now: datetime, grace_s: float
) -> SandboxStatus:
    """Failed, with what the kubelet said, once the trouble has lasted ``grace_s`` since its
    first Warning (else since the pod was made) on the clock ``now`` is read from."""
    warnings = [e for e in events if e.get("type") == "Warning" and e.get("message")]
    starts = [parse_time(e.get("firstTimestamp") or e.get("eventTime")) for e in warnings]
    known = [moment for moment in starts if moment is not None]
    since = min(known) if known else parse_time(pod["metadata"].get("creationTimestamp"))
    waited = max(0.0, (now - (since or now)).total_seconds())
    if waiting.get("reason") not in _HOPELESS_REASONS and waited < grace_s:
        return SandboxStatus(state=SandboxState.PROVISIONING, reason=str(waiting["reason"]))

    def newest(candidates: list[JSON]) -> JSON | None:
        def when(event: JSON) -> str:
            return str(event.get("lastTimestamp") or event.get("eventTime") or "")

        return max(candidates, key=when, default=None)

    pulls = [e for e in warnings if str(e["message"]).startswith("Failed to pull image")]
    said = newest(pulls) or newest([e for e in warnings if not e["message"].startswith("Error:")])
    message = said["message"] if said else waiting.get("message") or waiting["reason"]
    return SandboxStatus(
        state=SandboxState.FAILED,
        reason=f"the container could not start ({waiting['reason']}, {math.floor(waited)}s): "
        f"{message}",
    )


def listed_state(job: JSON) -> SandboxState:
    """A Job's state as far as the Job alone tells (the inventory): its decided outcome,
    RUNNING when its pod is ready (on clusters without ``status.ready``: active), else
    PROVISIONING. Never a final state for a Job still under way."""
    decided = finished_status(job, None)
    if decided is not None:
        return decided.state
    status = job.get("status") or {}
    ready = status.get("ready")
    if not is_suspended(job) and (
        (ready or 0) > 0 or (ready is None and (status.get("active") or 0) > 0)
    ):
        return SandboxState.RUNNING
    return SandboxState.PROVISIONING


def is_live(job: JSON) -> bool:
    """Holds a place: neither finished nor being deleted."""
    return not job["metadata"].get("deletionTimestamp") and finished_status(job, None) is None


def object_count(quantity: str) -> int:
    """An object-count quantity of a ResourceQuota (``10``, ``1k``) as an int."""
    factors = {"k": 1_000, "M": 1_000_000, "G": 1_000_000_000}
    text = str(quantity).strip()
    if text and text[-1] in factors:
        return int(float(text[:-1]) * factors[text[-1]])
    return int(float(text))
