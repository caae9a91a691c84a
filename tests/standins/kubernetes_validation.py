"""Defaulting and validation the API server applies to Jobs, Secrets and NetworkPolicies on the
way in.

Only the rules a provider can trip over are here (names, labels, the pod template's required
fields, a Job's restart policy, Secret data encoding), with the server's own cause reasons and
wording, so a malformed object fails here with the 422 a cluster would send."""

from __future__ import annotations

import base64
import binascii
import copy
import ipaddress
import re
from typing import Any

from tests.standins.kubernetes_api import (
    JSON,
    LABEL_KEY_RE,
    LABEL_VALUE_RE,
    ResourceType,
    bad_request,
)

DNS_SUBDOMAIN_RE = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
DNS_LABEL_RE = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
CONFIG_KEY_RE = re.compile(r"^[-._a-zA-Z0-9]+$")
SECRET_MAX_BYTES = 1024 * 1024

_SUBDOMAIN_HELP = (
    "a lowercase RFC 1123 subdomain must consist of lower case alphanumeric characters, '-' or "
    "'.', and must start and end with an alphanumeric character (e.g. 'example.com', regex used "
    "for validation is '[a-z0-9]([-a-z0-9]*[a-z0-9])?(\\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*')"
)
_LABEL_HELP = (
    "a lowercase RFC 1123 label must consist of lower case alphanumeric characters or '-', and "
    "must start and end with an alphanumeric character (e.g. 'my-name',  or '123-abc', regex "
    "used for validation is '[a-z0-9]([-a-z0-9]*[a-z0-9])?')"
)
_LABEL_VALUE_HELP = (
    "a valid label must be an empty string or consist of alphanumeric characters, '-', '_' or "
    "'.', and must start and end with an alphanumeric character (e.g. 'MyValue',  or "
    "'my_value',  or '12345', regex used for validation is "
    "'(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?')"
)


def required(path: str) -> JSON:
    return {"reason": "FieldValueRequired", "message": "Required value", "field": path}


def invalid_value(path: str, value: Any, detail: str) -> JSON:
    shown = f'"{value}"' if isinstance(value, str) else str(value)
    message = f"Invalid value: {shown}: {detail}"
    return {"reason": "FieldValueInvalid", "message": message, "field": path}


def unsupported(path: str, value: str, supported: list[str]) -> JSON:
    listed = ", ".join(f'"{item}"' for item in supported)
    message = f'Unsupported value: "{value}": supported values: {listed}'
    return {"reason": "FieldValueNotSupported", "message": message, "field": path}


def _name_causes(path: str, name: Any, *, label: bool = False) -> list[JSON]:
    limit, pattern, helptext = (
        (63, DNS_LABEL_RE, _LABEL_HELP) if label else (253, DNS_SUBDOMAIN_RE, _SUBDOMAIN_HELP)
    )
    if not isinstance(name, str) or not pattern.match(name):
        return [invalid_value(path, name, helptext)]
    if len(name) > limit:
        return [invalid_value(path, name, f"must be no more than {limit} characters")]
    return []


def label_causes(path: str, labels: Any) -> list[JSON]:
    """Every key and value checked as ``ValidateLabels`` does."""
    if not labels:
        return []
    if not isinstance(labels, dict):
        return [invalid_value(path, str(labels), "must be a map of strings")]
    causes: list[JSON] = []
    for key, value in labels.items():
        if not LABEL_KEY_RE.match(str(key)) or len(str(key).rsplit("/", 1)[-1]) > 63:
            causes.append(invalid_value(path, key, "name part must be a valid label name"))
        if not isinstance(value, str) or not LABEL_VALUE_RE.match(value):
            causes.append(invalid_value(path, value, _LABEL_VALUE_HELP))
        elif len(value) > 63:
            causes.append(invalid_value(path, value, "must be no more than 63 characters"))
    return causes


def meta_causes(meta: JSON) -> list[JSON]:
    causes = _name_causes("metadata.name", meta.get("name"))
    causes += label_causes("metadata.labels", meta.get("labels"))
    for index, ref in enumerate(meta.get("ownerReferences") or []):
        for field in ("apiVersion", "kind", "name", "uid"):
            if not ref.get(field):
                causes.append(required(f"metadata.ownerReferences[{index}].{field}"))
    return causes


def _container_causes(containers: Any) -> list[JSON]:
    path = "spec.template.spec.containers"
    if not isinstance(containers, list) or not containers:
        return [required(path)]
    causes: list[JSON] = []
    seen: set[str] = set()
    for index, container in enumerate(containers):
        here = f"{path}[{index}]"
        name = container.get("name") if isinstance(container, dict) else None
        if not name:
            causes.append(required(f"{here}.name"))
        else:
            causes += _name_causes(f"{here}.name", name, label=True)
            if name in seen:
                causes.append(
                    {
                        "reason": "FieldValueDuplicate",
                        "message": f'Duplicate value: "{name}"',
                        "field": f"{here}.name",
                    }
                )
            seen.add(name)
        if not isinstance(container, dict) or not container.get("image"):
            causes.append(required(f"{here}.image"))
    return causes


def job_causes(job: JSON) -> list[JSON]:
    """Validate a defaulted Job the way the batch API group does on create and update."""
    causes = meta_causes(job.get("metadata") or {})
    spec = job.get("spec") or {}
    template = spec.get("template") or {}
    causes += label_causes("spec.template.labels", (template.get("metadata") or {}).get("labels"))
    pod_spec = template.get("spec") or {}
    causes += _container_causes(pod_spec.get("containers"))
    policy = pod_spec.get("restartPolicy")
    if not policy:
        causes.append(required("spec.template.spec.restartPolicy"))
    elif policy not in ("OnFailure", "Never"):
        causes.append(
            unsupported("spec.template.spec.restartPolicy", policy, ["OnFailure", "Never"])
        )
    for field in (
        "backoffLimit",
        "activeDeadlineSeconds",
        "ttlSecondsAfterFinished",
        "parallelism",
        "completions",
    ):
        value = spec.get(field)
        if value is not None and (not isinstance(value, int) or value < 0):
            causes.append(
                invalid_value(f"spec.{field}", value, "must be greater than or equal to 0")
            )
    if spec.get("activeDeadlineSeconds") == 0:
        causes.append(invalid_value("spec.activeDeadlineSeconds", 0, "must be greater than 0"))
    return causes


def default_job(job: JSON, uid: str) -> JSON:
    """What defaulting and ``PrepareForCreate`` add: the generated selector and its labels,
    the spec defaults, and the Job's own labels copied from the template when it has none."""
    job = copy.deepcopy(job)
    name = job["metadata"].get("name", "")
    spec = job.setdefault("spec", {})
    generated = {
        "batch.kubernetes.io/controller-uid": uid,
        "batch.kubernetes.io/job-name": name,
        "controller-uid": uid,
        "job-name": name,
    }
    template = spec.setdefault("template", {})
    template_meta = template.setdefault("metadata", {})
    template_meta["labels"] = dict(template_meta.get("labels") or {}) | generated
    if not spec.get("manualSelector"):
        spec["selector"] = {"matchLabels": {"batch.kubernetes.io/controller-uid": uid}}
    for field, value in (
        ("parallelism", 1),
        ("completions", 1),
        ("backoffLimit", 6),
        ("completionMode", "NonIndexed"),
        ("suspend", False),
        ("podReplacementPolicy", "TerminatingOrFailed"),
    ):
        spec.setdefault(field, value)
    pod_spec = template.setdefault("spec", {})
    pod_defaults: JSON = {
        "dnsPolicy": "ClusterFirst",
        "schedulerName": "default-scheduler",
        "securityContext": {},
        "terminationGracePeriodSeconds": 30,
    }
    for key, default in pod_defaults.items():
        pod_spec.setdefault(key, default)
    for container in pod_spec.get("containers") or []:
        if isinstance(container, dict):
            _default_container(container)
    if not job["metadata"].get("labels"):
        job["metadata"]["labels"] = dict(template_meta["labels"])
    job.setdefault("status", {})
    return job


def _default_container(container: JSON) -> None:
    image = str(container.get("image") or "")
    tag = image.rsplit("/", 1)[-1]
    pinned = "@" in image or (":" in tag and not tag.endswith(":latest"))
    container.setdefault("imagePullPolicy", "IfNotPresent" if pinned else "Always")
    container.setdefault("resources", {})
    container.setdefault("terminationMessagePath", "/dev/termination-log")
    container.setdefault("terminationMessagePolicy", "File")


def prepare_secret(rt: ResourceType, secret: JSON) -> JSON:
    """Decode-time work: ``data`` must be base64 (a 400, as JSON decoding fails on the
    server), ``stringData`` folds into ``data``, ``type`` defaults to Opaque."""
    secret = copy.deepcopy(secret)
    data = secret.get("data") or {}
    for key, value in data.items():
        try:
            base64.b64decode(str(value), validate=True)
        except (binascii.Error, ValueError) as error:
            raise bad_request(
                f'{rt.kind} in version "v1" cannot be handled as a {rt.kind}: illegal base64 '
                f"data at input byte 0 (key {key!r})"
            ) from error
    for key, value in (secret.pop("stringData", None) or {}).items():
        data[key] = base64.b64encode(str(value).encode()).decode()
    if data:
        secret["data"] = data
    secret.setdefault("type", "Opaque")
    return secret


def secret_causes(secret: JSON) -> list[JSON]:
    causes = meta_causes(secret.get("metadata") or {})
    total = 0
    for key, value in (secret.get("data") or {}).items():
        if not CONFIG_KEY_RE.match(key) or len(key) > 253:
            causes.append(
                invalid_value(
                    f"data[{key}]",
                    key,
                    "a valid config key must consist of alphanumeric characters, '-', '_' or '.'",
                )
            )
        total += len(base64.b64decode(value))
    if total > SECRET_MAX_BYTES:
        causes.append(
            {
                "reason": "FieldValueTooLong",
                "message": f"Too long: must have at most {SECRET_MAX_BYTES} bytes",
                "field": "data",
            }
        )
    return causes


_POLICY_TYPES = ["Ingress", "Egress"]
_PROTOCOLS = ["TCP", "UDP", "SCTP"]


def _selector_causes(path: str, selector: Any) -> list[JSON]:
    if not isinstance(selector, dict):
        return [invalid_value(path, str(selector), "must be a label selector")]
    return label_causes(f"{path}.matchLabels", selector.get("matchLabels"))


def _cidr_causes(path: str, cidr: Any) -> list[JSON]:
    try:
        ipaddress.ip_network(str(cidr), strict=False)
    except ValueError:
        detail = "must be a valid CIDR value, (e.g. 10.9.8.0/24 or 2001:db8::/64)"
        return [invalid_value(path, cidr, detail)]
    return []


def _peer_causes(path: str, peer: Any) -> list[JSON]:
    """A peer is an ipBlock or pod/namespace selectors, never both, as the server insists."""
    if not isinstance(peer, dict) or not peer:
        return [required(path)]
    selectors = [key for key in ("podSelector", "namespaceSelector") if key in peer]
    if "ipBlock" in peer and selectors:
        return [
            {
                "reason": "FieldValueForbidden",
                "field": path,
                "message": "Forbidden: may not specify more than 1 peer type",
            }
        ]
    causes = [c for key in selectors for c in _selector_causes(f"{path}.{key}", peer[key])]
    if "ipBlock" in peer:
        block = peer["ipBlock"] or {}
        causes += _cidr_causes(f"{path}.ipBlock.cidr", block.get("cidr"))
        for index, excepted in enumerate(block.get("except") or []):
            causes += _cidr_causes(f"{path}.ipBlock.except[{index}]", excepted)
    return causes


def _port_causes(path: str, port: Any) -> list[JSON]:
    if not isinstance(port, dict):
        return [invalid_value(path, str(port), "must be a port")]
    causes: list[JSON] = []
    protocol = port.get("protocol", "TCP")
    if protocol not in _PROTOCOLS:
        causes.append(unsupported(f"{path}.protocol", str(protocol), _PROTOCOLS))
    number = port.get("port")
    if isinstance(number, int) and not 0 < number < 65536:
        causes.append(
            invalid_value(f"{path}.port", number, "must be between 1 and 65535, inclusive")
        )
    return causes


def networkpolicy_causes(policy: JSON) -> list[JSON]:
    """``ValidateNetworkPolicy``, as far as a provider can trip over it: the pod selector, the
    policy types, every rule's peers (one peer type each, valid CIDRs) and ports."""
    causes = meta_causes(policy.get("metadata") or {})
    spec = policy.get("spec") or {}
    if "podSelector" not in spec:
        causes.append(required("spec.podSelector"))
    else:
        causes += _selector_causes("spec.podSelector", spec["podSelector"])
    for index, kind in enumerate(spec.get("policyTypes") or []):
        if kind not in _POLICY_TYPES:
            causes.append(unsupported(f"spec.policyTypes[{index}]", str(kind), _POLICY_TYPES))
    for direction, peers_key in (("ingress", "from"), ("egress", "to")):
        for index, rule in enumerate(spec.get(direction) or []):
            here = f"spec.{direction}[{index}]"
            for n, peer in enumerate(rule.get(peers_key) or []):
                causes += _peer_causes(f"{here}.{peers_key}[{n}]", peer)
            for n, port in enumerate(rule.get("ports") or []):
                causes += _port_causes(f"{here}.ports[{n}]", port)
    return causes


def default_network_policy(policy: JSON) -> JSON:
    """The server's defaults: ``policyTypes`` from the rules given, ports on TCP."""
    policy = copy.deepcopy(policy)
    spec = policy.setdefault("spec", {})
    if not spec.get("policyTypes"):
        spec["policyTypes"] = ["Ingress"] + (["Egress"] if spec.get("egress") else [])
    for direction in ("ingress", "egress"):
        for rule in spec.get(direction) or []:
            for port in rule.get("ports") or []:
                if isinstance(port, dict):
                    port.setdefault("protocol", "TCP")
    return policy
