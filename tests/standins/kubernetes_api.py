"""Wire-level vocabulary of the Kubernetes API stand-in: which resources it serves, the
``Status`` bodies the real API server answers errors with, RFC 3339 times, and label and field
selectors.

Kept apart from the state and the HTTP layer so that both speak the exact same error shapes:
the official client turns these bodies into ``ApiException`` objects, and a provider that parses
``reason`` or ``details`` must see what a real cluster sends."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

JSON = dict[str, Any]


@dataclass(frozen=True)
class ResourceType:
    """One served resource, named the way the API server names it in URLs and messages."""

    plural: str
    kind: str
    group: str = ""
    version: str = "v1"
    namespaced: bool = True
    verbs: frozenset[str] = frozenset({"get", "list"})

    @property
    def api_version(self) -> str:
        return f"{self.group}/{self.version}" if self.group else self.version

    @property
    def qualified(self) -> str:
        """``jobs.batch`` or ``secrets``: the form NotFound and AlreadyExists messages use."""
        return f"{self.plural}.{self.group}" if self.group else self.plural

    @property
    def qualified_kind(self) -> str:
        """``Job.batch`` or ``Secret``: the form Invalid messages use."""
        return f"{self.kind}.{self.group}" if self.group else self.kind


_WRITE = frozenset({"get", "list", "create", "update", "patch", "delete"})
RESOURCES: dict[str, ResourceType] = {
    "jobs": ResourceType("jobs", "Job", "batch", verbs=_WRITE),
    "secrets": ResourceType("secrets", "Secret", verbs=_WRITE),
    "pods": ResourceType("pods", "Pod", verbs=frozenset({"get", "list", "patch", "delete"})),
    "events": ResourceType("events", "Event"),
    "resourcequotas": ResourceType("resourcequotas", "ResourceQuota"),
    "namespaces": ResourceType("namespaces", "Namespace", namespaced=False),
    "networkpolicies": ResourceType(
        "networkpolicies", "NetworkPolicy", "networking.k8s.io", verbs=_WRITE
    ),
}
# The API groups served under ``/apis/<group>/v1`` (the core group is ``/api/v1``).
GROUPS = frozenset(rt.group for rt in RESOURCES.values() if rt.group)


def rfc3339(moment: datetime) -> str:
    """Kubernetes ``metav1.Time``: UTC, second precision, ``Z`` suffix."""
    return moment.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


class ApiError(Exception):
    """An error the stand-in answers with: HTTP code, ``Status`` body and extra headers."""

    def __init__(self, body: JSON, headers: dict[str, str] | None = None) -> None:
        super().__init__(body.get("message", ""))
        self.body = body
        self.code: int = body["code"]
        self.headers = headers or {}


def failure(code: int, reason: str, message: str, details: JSON | None = None) -> JSON:
    """A ``Status`` body with ``status: Failure``, shaped like the API server's."""
    body: JSON = {
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": message,
        "reason": reason,
    }
    if details is not None:
        body["details"] = details
    body["code"] = code
    return body


def _details(rt: ResourceType, name: str | None, kind: str | None = None) -> JSON:
    details: JSON = {}
    if name:
        details["name"] = name
    if rt.group:
        details["group"] = rt.group
    details["kind"] = kind or rt.plural
    return details


def success(rt: ResourceType, name: str, uid: str) -> JSON:
    """What DELETE answers when the object is gone at once (no finalizer kept it)."""
    details = _details(rt, name) | {"uid": uid}
    return {
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Success",
        "details": details,
    }


def not_found(rt: ResourceType, name: str) -> ApiError:
    return ApiError(
        failure(404, "NotFound", f'{rt.qualified} "{name}" not found', _details(rt, name))
    )


def already_exists(rt: ResourceType, name: str) -> ApiError:
    message = f'{rt.qualified} "{name}" already exists'
    return ApiError(failure(409, "AlreadyExists", message, _details(rt, name)))


def exceeded_quota(
    rt: ResourceType, name: str, quota: str, *, resource: str, used: str, hard: str
) -> ApiError:
    """403 from the ResourceQuota admission plugin, worded as the API server words it."""
    message = (
        f'{rt.qualified} "{name}" is forbidden: exceeded quota: {quota}, requested: '
        f"{resource}=1, used: {resource}={used}, limited: {resource}={hard}"
    )
    return ApiError(failure(403, "Forbidden", message, _details(rt, name)))


def conflict(rt: ResourceType, name: str, why: str | None = None) -> ApiError:
    why = why or (
        "the object has been modified; please apply your changes to the latest version and "
        "try again"
    )
    message = f'Operation cannot be fulfilled on {rt.qualified} "{name}": {why}'
    return ApiError(failure(409, "Conflict", message, _details(rt, name)))


def invalid(rt: ResourceType, name: str, causes: list[JSON]) -> ApiError:
    """422 Invalid; the message lists every cause as ``field: message``, as the server does."""
    parts = [f"{cause['field']}: {cause['message']}" for cause in causes]
    listed = parts[0] if len(parts) == 1 else "[" + ", ".join(parts) + "]"
    message = f'{rt.qualified_kind} "{name}" is invalid: {listed}'
    details = _details(rt, name, kind=rt.kind) | {"causes": causes}
    return ApiError(failure(422, "Invalid", message, details))


def bad_request(message: str) -> ApiError:
    return ApiError(failure(400, "BadRequest", message))


def method_not_allowed() -> ApiError:
    message = "the server does not allow this method on the requested resource"
    return ApiError(failure(405, "MethodNotAllowed", message, {}))


def unsupported_media_type(content_type: str) -> ApiError:
    message = (
        f"the body of the request was in an unknown format ({content_type}) - accepted media "
        "types include: application/json-patch+json, application/merge-patch+json, "
        "application/strategic-merge-patch+json"
    )
    return ApiError(failure(415, "UnsupportedMediaType", message, {}))


def unknown_path() -> ApiError:
    return ApiError(
        failure(404, "NotFound", "the server could not find the requested resource", {})
    )


def unauthorized() -> ApiError:
    return ApiError(failure(401, "Unauthorized", "Unauthorized"))


def forbidden(
    rt: ResourceType,
    verb: str,
    namespace: str,
    user: str,
    name: str | None = None,
    *,
    subresource: str | None = None,
) -> ApiError:
    """403 as RBAC words it: which user may not do which verb on what, where."""
    subject = f'{rt.qualified} "{name}"' if name else rt.qualified
    resource = f"{rt.plural}/{subresource}" if subresource else rt.plural
    message = (
        f'{subject} is forbidden: User "{user}" cannot {verb} resource "{resource}" '
        f'in API group "{rt.group}" in the namespace "{namespace}"'
    )
    return ApiError(failure(403, "Forbidden", message, _details(rt, name)))


_INJECTED: dict[int, tuple[str, str]] = {
    400: ("BadRequest", "the request could not be processed"),
    401: ("Unauthorized", "Unauthorized"),
    403: ("Forbidden", "forbidden: the stand-in was told to refuse this request"),
    404: ("NotFound", "the server could not find the requested resource"),
    409: ("Conflict", "the object has been modified"),
    429: ("TooManyRequests", "Too many requests, please try again later."),
    500: ("InternalError", "Internal error occurred: injected by the stand-in"),
    503: ("ServiceUnavailable", "the server is currently unable to handle the request"),
    504: ("Timeout", "the server was unable to return a response in the time allotted"),
}


def injected(code: int, message: str | None, retry_after: int | None) -> ApiError:
    """The error a test asked for, with the reason and headers the real server pairs with it."""
    reason, default = _INJECTED.get(code, ("", f"injected failure {code}"))
    text = message or default
    details: JSON | None = None
    headers: dict[str, str] = {}
    if code == 500:
        details = {"causes": [{"message": text}]}
    if retry_after is not None and code in (429, 503, 504):
        details = {"retryAfterSeconds": retry_after}
        headers["Retry-After"] = str(retry_after)
    return ApiError(failure(code, reason, text, details), headers)


# ---------------------------------------------------------------------------------------------
# Label and field selectors
# ---------------------------------------------------------------------------------------------

_LABEL_NAME = r"([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]"
LABEL_VALUE_RE = re.compile(rf"^({_LABEL_NAME})?$")
_DNS_SUBDOMAIN = r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*"
LABEL_KEY_RE = re.compile(rf"^({_DNS_SUBDOMAIN}/)?{_LABEL_NAME}$")


@dataclass(frozen=True)
class Requirement:
    """One clause of a selector: ``key op values``."""

    key: str
    op: str  # "=", "!=", "in", "notin", "exists", "!"
    values: tuple[str, ...] = field(default=())

    def matches(self, labels: dict[str, str]) -> bool:
        present = self.key in labels
        value = labels.get(self.key)
        if self.op == "exists":
            return present
        if self.op == "!":
            return not present
        if self.op in ("=", "in"):
            return present and value in self.values
        return not present or value not in self.values  # "!=" and "notin"


def _split_top_level(text: str) -> list[str]:
    """Split on commas that are not inside ``in (a,b)`` parentheses."""
    parts: list[str] = []
    depth = 0
    current = ""
    for char in text:
        depth += {"(": 1, ")": -1}.get(char, 0)
        if char == "," and depth == 0:
            parts.append(current)
            current = ""
        else:
            current += char
    parts.append(current)
    return [part.strip() for part in parts if part.strip()]


_SET_RE = re.compile(r"^(\S+)\s+(in|notin)\s+\((.*)\)$")
_EQ_RE = re.compile(r"^([^\s=!]+)\s*(==|=|!=)\s*(\S*)$")


def _parse_clause(clause: str) -> Requirement:
    if clause.startswith("!"):
        return Requirement(clause[1:].strip(), "!")
    if match := _SET_RE.match(clause):
        values = tuple(value.strip() for value in match.group(3).split(",") if value.strip())
        return Requirement(match.group(1), match.group(2), values)
    if match := _EQ_RE.match(clause):
        op = "=" if match.group(2) in ("=", "==") else "!="
        return Requirement(match.group(1), op, (match.group(3),))
    if re.fullmatch(r"\S+", clause):
        return Requirement(clause, "exists")
    raise bad_request(f"unable to parse requirement: found '{clause}', expected: key, =, !=, in")


def parse_label_selector(text: str | None) -> list[Requirement]:
    """Parse ``a=b,c!=d,e,!f,g in (h,i)`` as ``labels.Parse`` does; 400 when malformed."""
    requirements = [_parse_clause(clause) for clause in _split_top_level(text or "")]
    for requirement in requirements:
        if not LABEL_KEY_RE.match(requirement.key):
            raise bad_request(
                f'unable to parse requirement: key: Invalid value: "{requirement.key}": '
                "name part must consist of alphanumeric characters, '-', '_' or '.'"
            )
        for value in requirement.values:
            if not LABEL_VALUE_RE.match(value) or len(value) > 63:
                raise bad_request(
                    f"unable to parse requirement: values[0][{requirement.key}]: "
                    f'Invalid value: "{value}": a valid label must be an empty string or '
                    "consist of alphanumeric characters, '-', '_' or '.'"
                )
    return requirements


_COMMON_FIELDS = frozenset({"metadata.name", "metadata.namespace"})
FIELD_LABELS: dict[str, frozenset[str]] = {
    "pods": _COMMON_FIELDS
    | {"spec.nodeName", "spec.restartPolicy", "spec.schedulerName", "spec.serviceAccountName"}
    | {"status.phase", "status.podIP", "status.nominatedNodeName"},
    "events": _COMMON_FIELDS
    | {f"involvedObject.{part}" for part in ("kind", "namespace", "name", "uid")}
    | {f"involvedObject.{part}" for part in ("apiVersion", "resourceVersion", "fieldPath")}
    | {"reason", "reportingComponent", "source", "type"},
    "secrets": _COMMON_FIELDS | {"type"},
    "jobs": _COMMON_FIELDS | {"status.successful"},
    "networkpolicies": _COMMON_FIELDS,
}


def _field_value(obj: JSON, path: str) -> str:
    if path == "source":
        path = "source.component"
    if path == "status.successful":
        path = "status.succeeded"
    current: Any = obj
    for part in path.split("."):
        current = current.get(part) if isinstance(current, dict) else None
    if current is None:
        return "0" if path == "status.succeeded" else ""
    return str(current)


def parse_field_selector(plural: str, text: str | None) -> list[Requirement]:
    """Parse ``involvedObject.name=x,type!=Normal``; 400 for fields the server cannot select."""
    supported = FIELD_LABELS.get(plural, _COMMON_FIELDS)
    requirements: list[Requirement] = []
    for clause in _split_top_level(text or ""):
        match = re.fullmatch(r"([^=!]+?)\s*(==|=|!=)\s*(.*)", clause)
        if not match:
            raise bad_request(f"invalid selector: '{clause}'; can't understand '{clause}'")
        key, op, value = match.group(1), match.group(2), match.group(3)
        if key not in supported:
            raise bad_request(f"field label not supported: {key}")
        requirements.append(Requirement(key, "=" if op != "!=" else "!=", (value,)))
    return requirements


def matches_fields(requirements: list[Requirement], obj: JSON) -> bool:
    return all(req.matches({req.key: _field_value(obj, req.key)}) for req in requirements)


def matches_labels(requirements: list[Requirement], obj: JSON) -> bool:
    labels = obj.get("metadata", {}).get("labels") or {}
    return all(requirement.matches(labels) for requirement in requirements)
