"""The stand-in's cluster state: objects by resource, namespace and name, with the metadata the
API server stamps (uid, resourceVersion, creationTimestamp), the generic verbs, and deletion
with garbage collection by ``ownerReferences``.

One re-entrant lock guards everything: the HTTP server's thread and the test's thread both read
and drive this state, and every public method takes the lock."""

from __future__ import annotations

import copy
import json
import threading
import uuid
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

from tests.standins import kubernetes_validation as validation
from tests.standins.kubernetes_api import (
    JSON,
    RESOURCES,
    ResourceType,
    already_exists,
    bad_request,
    conflict,
    exceeded_quota,
    invalid,
    matches_fields,
    matches_labels,
    not_found,
    parse_field_selector,
    parse_label_selector,
    rfc3339,
    success,
)
from tests.standins.kubernetes_exec import ExecHandler, default_exec
from tests.standins.kubernetes_jobs import JobController, PodRuntime, random_suffix
from tests.standins.kubernetes_patch import apply_patch

POLICIES = ("Foreground", "Background", "Orphan")
_META_ORDER = (
    "name",
    "generateName",
    "namespace",
    "uid",
    "resourceVersion",
    "generation",
    "creationTimestamp",
    "deletionTimestamp",
    "deletionGracePeriodSeconds",
    "labels",
    "annotations",
    "ownerReferences",
    "finalizers",
)


class Clock:
    """Wall time plus a skew a test can advance, so deadlines pass without sleeping."""

    def __init__(self) -> None:
        self.skew = 0.0

    def now(self) -> datetime:
        return datetime.now(UTC) + timedelta(seconds=self.skew)


@dataclass
class PendingDeletion:
    due: datetime
    plural: str
    namespace: str
    name: str
    policy: str


def _ordered_meta(meta: JSON) -> JSON:
    ordered = {key: meta[key] for key in _META_ORDER if meta.get(key) not in (None, {}, [])}
    rest = {
        key: value for key, value in meta.items() if key not in _META_ORDER and value is not None
    }
    return ordered | rest


class Store:
    """Objects and the generic verbs on them; Jobs get their lifecycle from ``jobs``."""

    def __init__(self, namespaces: Iterable[str], gc_delay: float = 0.0) -> None:
        self.lock = threading.RLock()
        self.clock = Clock()
        self.gc_delay = gc_delay
        self.runtime: dict[tuple[str, str], PodRuntime] = {}
        self._objects: dict[str, dict[tuple[str, str], JSON]] = {plural: {} for plural in RESOURCES}
        self._resource_version = 1000
        self._pending: list[PendingDeletion] = []
        self.default_exec: ExecHandler = default_exec
        self.job_exec: dict[tuple[str, str], ExecHandler] = {}
        self.jobs = JobController(self)
        for namespace in namespaces:
            self.add_namespace(namespace)

    # -- low level, used by the job controller too --------------------------------------------

    def now(self) -> str:
        return rfc3339(self.clock.now())

    def lookup(self, plural: str, namespace: str, name: str) -> JSON | None:
        """The live stored dict (not a copy), or None."""
        return self._objects[plural].get((namespace, name))

    def items(self, plural: str, namespace: str | None) -> list[JSON]:
        """Live stored dicts sorted by namespace and name, as etcd lists them."""
        found = [obj for (ns, _), obj in self._objects[plural].items() if namespace in (None, ns)]
        return sorted(
            found, key=lambda obj: (obj["metadata"].get("namespace", ""), obj["metadata"]["name"])
        )

    def save(self, plural: str, obj: JSON) -> JSON:
        """Store ``obj`` under a new resourceVersion; every write goes through here."""
        self._resource_version += 1
        obj["metadata"]["resourceVersion"] = str(self._resource_version)
        key = (obj["metadata"].get("namespace", ""), obj["metadata"]["name"])
        self._objects[plural][key] = obj
        return obj

    def insert(self, plural: str, obj: JSON, uid: str | None = None) -> JSON:
        """Stamp server-owned metadata on a new object and store it."""
        rt = RESOURCES[plural]
        meta = obj.setdefault("metadata", {})
        meta["uid"] = uid or str(uuid.uuid4())
        meta["creationTimestamp"] = self.now()
        if plural == "jobs":
            meta["generation"] = 1
        for key in ("resourceVersion", "deletionTimestamp", "deletionGracePeriodSeconds"):
            meta.pop(key, None)
        meta["resourceVersion"] = "0"  # a placeholder that keeps the key's place; save() sets it
        obj["metadata"] = _ordered_meta(meta)
        stored = {"kind": rt.kind, "apiVersion": rt.api_version} | {
            key: value for key, value in obj.items() if key not in ("kind", "apiVersion")
        }
        return self.save(plural, stored)

    def add_namespace(self, name: str) -> None:
        with self.lock:
            if self.lookup("namespaces", "", name) is None:
                namespace = {
                    "metadata": {"name": name, "labels": {"kubernetes.io/metadata.name": name}},
                    "spec": {"finalizers": ["kubernetes"]},
                    "status": {"phase": "Active"},
                }
                self.insert("namespaces", namespace)

    def require_namespace(self, namespace: str) -> None:
        if self.lookup("namespaces", "", namespace) is None:
            raise not_found(RESOURCES["namespaces"], namespace)

    def exec_handler(self, pod: JSON) -> ExecHandler:
        """The pod's own handler, else its Job's, else the default one."""
        namespace, name = pod["metadata"]["namespace"], pod["metadata"]["name"]
        runtime = self.runtime.get((namespace, name))
        if runtime is not None and runtime.exec_handler is not None:
            return runtime.exec_handler
        job = (pod["metadata"].get("labels") or {}).get("batch.kubernetes.io/job-name", "")
        return self.job_exec.get((namespace, job), self.default_exec)

    def live(self, plural: str, namespace: str, name: str) -> JSON:
        obj = self.lookup(plural, namespace, name)
        if obj is None:
            raise not_found(RESOURCES[plural], name)
        return obj

    # -- the generic verbs --------------------------------------------------------------------

    def get(self, plural: str, namespace: str, name: str) -> JSON:
        with self.lock:
            return copy.deepcopy(self.live(plural, namespace, name))

    def collection(
        self,
        plural: str,
        namespace: str | None,
        label_selector: str | None = None,
        field_selector: str | None = None,
    ) -> JSON:
        """A ``<Kind>List``; items carry no kind/apiVersion, as the server's typed lists."""
        rt = RESOURCES[plural]
        labels = parse_label_selector(label_selector)
        fields = parse_field_selector(plural, field_selector)
        with self.lock:
            chosen = [
                {
                    key: value
                    for key, value in copy.deepcopy(obj).items()
                    if key not in ("kind", "apiVersion")
                }
                for obj in self.items(plural, namespace)
                if matches_labels(labels, obj) and matches_fields(fields, obj)
            ]
            meta = {"resourceVersion": str(self._resource_version)}
        return {
            "kind": f"{rt.kind}List",
            "apiVersion": rt.api_version,
            "metadata": meta,
            "items": chosen,
        }

    def create(self, plural: str, namespace: str, body: Any) -> JSON:
        """POST to a collection: decode, default, validate, reject duplicates, store."""
        rt = RESOURCES[plural]
        with self.lock:
            self.require_namespace(namespace)
            obj = self._decode(rt, namespace, body)
            meta = obj["metadata"]
            if not meta.get("name") and meta.get("generateName"):
                meta["name"] = f"{meta['generateName']}{random_suffix()}"
            name = meta.get("name") or ""
            if not name:
                cause = validation.required("metadata.name")
                cause["message"] = "Required value: name or generateName is required"
                raise invalid(rt, "", [cause])
            uid = str(uuid.uuid4())
            obj = self._prepare(rt, obj, uid)
            self._validate(rt, obj)
            if self.lookup(plural, namespace, name) is not None:
                raise already_exists(rt, name)
            self._admit_quota(rt, namespace, name)
            stored = self.insert(plural, obj, uid)
            answer = copy.deepcopy(stored)
            if plural == "jobs":
                self.jobs.job_created(stored)
            return answer

    def replace(self, plural: str, namespace: str, name: str, body: Any) -> JSON:
        """PUT: the whole object, optimistic concurrency on ``metadata.resourceVersion``."""
        rt = RESOURCES[plural]
        with self.lock:
            old = self.live(plural, namespace, name)
            new = self._decode(rt, namespace, body)
            if new["metadata"].get("name") not in (None, name):
                given = new["metadata"]["name"]
                raise bad_request(
                    f"the name of the object ({given}) does not match the name on the URL ({name})"
                )
            return self._update(rt, old, new)

    def patch(self, plural: str, namespace: str, name: str, content_type: str, raw: bytes) -> JSON:
        rt = RESOURCES[plural]
        with self.lock:
            old = self.live(plural, namespace, name)
            new = apply_patch(copy.deepcopy(old), content_type, raw)
            return self._update(rt, old, new)

    def delete(self, plural: str, namespace: str, name: str, options: JSON) -> tuple[int, JSON]:
        """DELETE with ``DeleteOptions``: preconditions, then the propagation policy.

        Background deletes at once and answers a success ``Status`` (200). Foreground and Orphan
        leave the object with a deletionTimestamp and a finalizer until the garbage collector
        has dealt with its dependents, and answer that object with 202, as the server does."""
        rt = RESOURCES[plural]
        with self.lock:
            obj = self.live(plural, namespace, name)
            meta = obj["metadata"]
            self._check_preconditions(rt, meta, options.get("preconditions") or {})
            policy = options.get("propagationPolicy")
            if policy is None and options.get("orphanDependents") is not None:
                policy = "Orphan" if options["orphanDependents"] else "Background"
            # batch/v1 Jobs still orphan their pods by default when deleted through the API.
            policy = policy or ("Orphan" if plural == "jobs" else "Background")
            if policy not in POLICIES:
                raise bad_request(f'propagationPolicy: Unsupported value: "{policy}"')
            if meta.get("deletionTimestamp"):
                return 202, copy.deepcopy(obj)
            if plural == "pods" or policy == "Background":
                answer = copy.deepcopy(obj)
                answer["metadata"]["deletionTimestamp"] = self.now()
                self.remove(plural, namespace, name)
                return (200, answer) if plural == "pods" else (200, success(rt, name, meta["uid"]))
            meta["deletionTimestamp"] = self.now()
            meta["deletionGracePeriodSeconds"] = 0
            meta["finalizers"] = [
                *meta.get("finalizers", []),
                "foregroundDeletion" if policy == "Foreground" else "orphan",
            ]
            obj["metadata"] = _ordered_meta(meta)
            answer = copy.deepcopy(self.save(plural, obj))
            self.schedule_deletion(plural, namespace, name, policy, self.gc_delay)
            return 202, answer

    # -- garbage collection -------------------------------------------------------------------

    def schedule_deletion(
        self, plural: str, namespace: str, name: str, policy: str, delay: float
    ) -> None:
        due = self.clock.now() + timedelta(seconds=delay)
        self._pending.append(PendingDeletion(due, plural, namespace, name, policy))
        if delay <= 0:
            self.tick()

    def dependents(self, namespace: str, owner_uid: str) -> list[tuple[str, JSON]]:
        return [
            (plural, obj)
            for plural, rt in RESOURCES.items()
            if rt.namespaced
            for obj in self.items(plural, namespace)
            if any(
                ref.get("uid") == owner_uid for ref in obj["metadata"].get("ownerReferences") or []
            )
        ]

    def remove(self, plural: str, namespace: str, name: str) -> None:
        """Drop an object now and collect its dependents (background propagation)."""
        obj = self._objects[plural].pop((namespace, name), None)
        if obj is None:
            return
        self._resource_version += 1
        if plural == "pods":
            self.runtime.pop((namespace, name), None)
            self.jobs.pod_removed(obj)
        for dep_plural, dependent in self.dependents(namespace, obj["metadata"]["uid"]):
            self.remove(dep_plural, namespace, dependent["metadata"]["name"])

    def _finish_deletion(self, pending: PendingDeletion) -> None:
        obj = self.lookup(pending.plural, pending.namespace, pending.name)
        if obj is None:
            return
        uid = obj["metadata"]["uid"]
        for dep_plural, dependent in self.dependents(pending.namespace, uid):
            if pending.policy == "Orphan":
                refs = dependent["metadata"].get("ownerReferences") or []
                dependent["metadata"]["ownerReferences"] = [
                    ref for ref in refs if ref.get("uid") != uid
                ]
                self.save(dep_plural, dependent)
            else:
                self.remove(dep_plural, pending.namespace, dependent["metadata"]["name"])
        self.remove(pending.plural, pending.namespace, pending.name)

    def tick(self) -> None:
        """Let simulated time act: pods start, deadlines pass, collected objects go."""
        with self.lock:
            now = self.clock.now()
            self.jobs.tick(now)
            due = [item for item in self._pending if item.due <= now]
            self._pending = [item for item in self._pending if item.due > now]
            for pending in due:
                self._finish_deletion(pending)

    # -- helpers of the verbs -----------------------------------------------------------------

    def _decode(self, rt: ResourceType, namespace: str, body: Any) -> JSON:
        if not isinstance(body, dict):
            raise bad_request(
                f'{rt.kind} in version "{rt.version}" cannot be handled as a {rt.kind}'
            )
        obj = copy.deepcopy(body)
        if obj.get("kind") not in (None, rt.kind):
            raise bad_request(
                f"the kind in the data ({obj['kind']}) does not match the expected kind ({rt.kind})"
            )
        if obj.get("apiVersion") not in (None, rt.api_version):
            raise bad_request(
                f"the API version in the data ({obj['apiVersion']}) does not match the expected "
                f"API version ({rt.api_version})"
            )
        meta = obj.get("metadata") or {}
        if meta.get("namespace") not in (None, "", namespace):
            raise bad_request(
                "the namespace of the provided object does not match the namespace sent on the "
                "request"
            )
        meta["namespace"] = namespace
        obj["metadata"] = meta
        return obj

    def _prepare(self, rt: ResourceType, obj: JSON, uid: str) -> JSON:
        if rt.plural == "jobs":
            return validation.default_job(obj, uid)
        if rt.plural == "secrets":
            return validation.prepare_secret(rt, obj)
        if rt.plural == "networkpolicies":
            return validation.default_network_policy(obj)
        return obj

    def _validate(self, rt: ResourceType, obj: JSON) -> None:
        if rt.plural == "jobs":
            causes = validation.job_causes(obj)
        elif rt.plural == "secrets":
            causes = validation.secret_causes(obj)
        elif rt.plural == "networkpolicies":
            causes = validation.networkpolicy_causes(obj)
        else:
            causes = validation.meta_causes(obj.get("metadata") or {})
        if causes:
            raise invalid(rt, obj["metadata"].get("name", ""), causes)

    def _admit_quota(self, rt: ResourceType, namespace: str, name: str) -> None:
        """The ResourceQuota admission plugin for object counts (``count/jobs.batch``): a
        create beyond a quota's hard limit is refused with its 403, as the API server refuses
        it. ``status.used`` is what a test set; the stand-in runs no quota controller."""
        resource = f"count/{rt.qualified}"
        for quota in self.items("resourcequotas", namespace):
            hard = (quota.get("status") or {}).get("hard", {}).get(resource)
            used = (quota.get("status") or {}).get("used", {}).get(resource, "0")
            if hard is not None and int(used) + 1 > int(hard):
                raise exceeded_quota(
                    rt, name, quota["metadata"]["name"], resource=resource, used=used, hard=hard
                )

    def _check_preconditions(self, rt: ResourceType, meta: JSON, pre: JSON) -> None:
        for field, label in (("uid", "UID"), ("resourceVersion", "ResourceVersion")):
            if pre.get(field) and pre[field] != meta.get(field):
                why = (
                    f"Precondition failed: {label} in precondition: {pre[field]}, "
                    f"{label} in object meta: {meta.get(field)}"
                )
                raise conflict(rt, meta["name"], why)

    def _update(self, rt: ResourceType, old: JSON, new: JSON) -> JSON:
        """The shared end of PUT and PATCH: concurrency check, immutable fields kept,
        validation, and no new resourceVersion when nothing changed."""
        old_meta, meta = old["metadata"], new.get("metadata") or {}
        if meta.get("resourceVersion") not in (None, "", old_meta["resourceVersion"]):
            raise conflict(rt, old_meta["name"])
        for key in (
            "name",
            "namespace",
            "uid",
            "creationTimestamp",
            "generation",
            "deletionTimestamp",
        ):
            if key in old_meta:
                meta[key] = old_meta[key]
        new["metadata"], new["kind"], new["apiVersion"] = meta, rt.kind, rt.api_version
        if rt.plural in ("jobs", "pods"):  # status is written through /status only
            new["status"] = copy.deepcopy(old.get("status", {}))
        if rt.plural == "jobs" and new.get("spec", {}).get("template") != old["spec"]["template"]:
            raise invalid(
                rt,
                old_meta["name"],
                [validation.invalid_value("spec.template", "...", "field is immutable")],
            )
        if rt.plural == "secrets":
            new = validation.prepare_secret(rt, new)
        self._validate(rt, new)
        meta = new["metadata"]
        meta["resourceVersion"] = old_meta["resourceVersion"]
        new["metadata"] = _ordered_meta(meta)
        if json.dumps(new, sort_keys=True) == json.dumps(old, sort_keys=True):
            return copy.deepcopy(old)
        if rt.plural == "jobs" and new.get("spec") != old.get("spec"):
            new["metadata"]["generation"] = old_meta.get("generation", 1) + 1
        stored = {"kind": rt.kind, "apiVersion": rt.api_version} | {
            key: value for key, value in new.items() if key not in ("kind", "apiVersion")
        }
        answer = copy.deepcopy(self.save(rt.plural, stored))
        if rt.plural == "jobs":
            self.jobs.job_updated(old, stored)
        return answer
