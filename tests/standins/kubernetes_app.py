"""The stand-in's HTTP and WebSocket surface: URL routing in the API server's layout
(``/api/v1/...``, ``/apis/batch/v1/...``, ``/apis/networking.k8s.io/v1/...``), verbs, pod logs
and pod exec, every error as a ``Status`` body. A plain ASGI callable, served by uvicorn on
loopback. Every answer carries a ``Date`` header from the stand-in's clock, so simulated time
(``advance``) shows to a client that reads the API server's clock, as a provider measuring
grace periods on the cluster's clock does."""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, MutableMapping
from dataclasses import dataclass
from email.utils import format_datetime
from typing import Any
from urllib.parse import parse_qs, unquote

from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.websockets import WebSocket

from tests.standins.kubernetes_api import (
    GROUPS,
    JSON,
    RESOURCES,
    ApiError,
    ResourceType,
    bad_request,
    method_not_allowed,
    unknown_path,
)
from tests.standins.kubernetes_exec import (
    PROTOCOLS,
    ExecHandler,
    ExecRequest,
    choose_protocol,
    serve_exec,
)
from tests.standins.kubernetes_gate import Gate, Identity
from tests.standins.kubernetes_store import Store

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

_VERBS = {"GET": "get", "POST": "create", "PUT": "update", "PATCH": "patch", "DELETE": "delete"}
_WAITING = {
    "ErrImagePull": "trying and failing to pull image",
    "ImagePullBackOff": "image can't be pulled",
}


@dataclass(frozen=True)
class Target:
    """What a URL names: a resource type, a namespace (None: all), a name, a subresource."""

    rt: ResourceType
    namespace: str | None
    name: str | None = None
    sub: str | None = None


def parse_path(path: str) -> Target | None:
    """Map a URL path to a served resource, or None for a path this server does not know."""
    parts = [unquote(part) for part in path.strip("/").split("/")]
    if tuple(parts[:2]) == ("api", "v1"):
        group, rest = "", parts[2:]
    elif len(parts) >= 3 and parts[0] == "apis" and parts[1] in GROUPS and parts[2] == "v1":
        group, rest = parts[1], parts[3:]
    else:
        return None
    namespace: str | None = None
    if len(rest) >= 3 and rest[0] == "namespaces" and rest[2] in RESOURCES:
        namespace, rest = rest[1], rest[2:]
    if not rest or rest[0] not in RESOURCES or len(rest) > 3:
        return None
    rt = RESOURCES[rest[0]]
    if rt.group != group or (namespace is not None and not rt.namespaced):
        return None
    if not rt.namespaced:
        namespace = ""
    target = Target(rt, namespace, *rest[1:])
    if target.name is not None and target.namespace is None:
        return None  # a named object is always addressed within its namespace
    return target


def _flag(params: dict[str, list[str]], name: str) -> bool:
    return (params.get(name) or ["false"])[-1].lower() in ("true", "1")


def _one(params: dict[str, list[str]], name: str) -> str | None:
    values = params.get(name)
    return values[-1] if values else None


def _json_body(raw: bytes) -> Any:
    try:
        return json.loads(raw) if raw.strip() else {}
    except ValueError as error:
        raise bad_request(f"couldn't get version/kind; json parse error: {error}") from error


def _container(pod: JSON, requested: str | None) -> str:
    names = [container["name"] for container in pod["spec"]["containers"]]
    pod_name = pod["metadata"]["name"]
    if requested is None:
        if len(names) > 1:
            listed = " ".join(names)
            raise bad_request(
                f"a container name must be specified for pod {pod_name}, choose one of: [{listed}]"
            )
        return str(names[0])
    if requested not in names:
        raise bad_request(f"container {requested} is not valid for pod {pod_name}")
    return requested


class StandinApp:
    """ASGI entry point; state lives in ``Store`` and the checks in ``Gate``."""

    def __init__(self, store: Store, gate: Gate, version: tuple[int, int]) -> None:
        self.store = store
        self.gate = gate
        self.version = version

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            await self._http(scope, receive, send)
        elif scope["type"] == "websocket":
            await self._websocket(WebSocket(scope, receive, send))

    async def _http(self, scope: Scope, receive: Receive, send: Send) -> None:
        request = Request(scope, receive)
        raw = await request.body()
        method, path, query = request.method, request.url.path, request.url.query
        entry = self.gate.record(method, path, query, raw, dict(request.headers))
        try:
            lost = await self.gate.apply_failures(method, path)
            identity = self.gate.authenticate(request.headers.get("authorization"))
            response = self._dispatch(
                identity, request, raw, parse_qs(query, keep_blank_values=True)
            )
            if lost is not None:
                raise lost  # served, and its answer lost on the way back
        except ApiError as error:
            response = JSONResponse(error.body, error.code, headers=error.headers)
        response.headers["date"] = format_datetime(self.store.clock.now(), usegmt=True)
        entry.status = response.status_code
        await response(scope, receive, send)

    def _dispatch(
        self, identity: Identity, request: Request, raw: bytes, params: dict[str, list[str]]
    ) -> Response:
        path = request.url.path
        if path.rstrip("/") == "/version":
            return JSONResponse(self._version_info())
        target = parse_path(path)
        if target is None:
            raise unknown_path()
        verb = _VERBS.get(request.method, "")
        if request.method == "GET" and target.name is None:
            verb = "watch" if _flag(params, "watch") else "list"
        if target.sub in ("exec", "log"):
            subject = verb if target.sub == "log" else "create"
            self.gate.authorize(
                identity, target.rt, subject, target.namespace, target.name, subresource=target.sub
            )
        else:
            self.gate.authorize(identity, target.rt, verb, target.namespace, target.name)
        if target.sub is not None:
            return self._subresource(request.method, target, params)
        if verb == "watch":
            raise bad_request("the stand-in does not serve watch requests; poll with list or get")
        if verb not in target.rt.verbs:
            raise method_not_allowed()
        if _one(params, "dryRun"):
            raise bad_request("dryRun is not supported by the stand-in")
        return self._verb(verb, target, request.headers.get("content-type", ""), raw, params)

    def _verb(
        self, verb: str, target: Target, content_type: str, raw: bytes, params: dict[str, list[str]]
    ) -> Response:
        plural, namespace, name = target.rt.plural, target.namespace, target.name
        with self.store.lock:
            self.store.tick()
            if verb == "list":
                selectors = (_one(params, "labelSelector"), _one(params, "fieldSelector"))
                return JSONResponse(self.store.collection(plural, namespace, *selectors))
            if verb == "create" and name is None and namespace is not None:
                return JSONResponse(self.store.create(plural, namespace, _json_body(raw)), 201)
            if name is None or namespace is None:
                raise method_not_allowed()
            if verb == "get":
                return JSONResponse(self.store.get(plural, namespace, name))
            if verb == "update":
                return JSONResponse(self.store.replace(plural, namespace, name, _json_body(raw)))
            if verb == "patch":
                return JSONResponse(self.store.patch(plural, namespace, name, content_type, raw))
            if verb == "delete":
                options = _json_body(raw)
                for key in ("propagationPolicy", "gracePeriodSeconds"):
                    if (value := _one(params, key)) is not None:
                        options.setdefault(key, value)
                code, body = self.store.delete(plural, namespace, name, options)
                return JSONResponse(body, code)
        raise method_not_allowed()

    def _subresource(self, method: str, target: Target, params: dict[str, list[str]]) -> Response:
        plural, namespace, name = target.rt.plural, target.namespace or "", target.name or ""
        if target.sub == "status" and plural in ("jobs", "pods") and method == "GET":
            with self.store.lock:
                self.store.tick()
                return JSONResponse(self.store.get(plural, namespace, name))
        if target.sub == "log" and plural == "pods" and method == "GET":
            return PlainTextResponse(self._pod_log(namespace, name, params))
        if target.sub == "exec" and plural == "pods" and method in ("GET", "POST"):
            raise bad_request("Upgrade request required")
        raise method_not_allowed() if target.sub in ("status", "log", "exec") else unknown_path()

    def _pod_log(self, namespace: str, name: str, params: dict[str, list[str]]) -> str:
        """``GET .../log``: the text a test set, after the checks the kubelet makes."""
        with self.store.lock:
            self.store.tick()
            pod = self.store.live("pods", namespace, name)
            container = _container(pod, _one(params, "container"))
            if _flag(params, "previous"):
                raise bad_request(
                    f'previous terminated container "{container}" in pod "{name}" not found'
                )
            statuses = pod["status"].get("containerStatuses") or []
            state: JSON = next((s["state"] for s in statuses if s["name"] == container), {})
            if waiting := state.get("waiting"):
                why = _WAITING.get(waiting.get("reason", ""), waiting.get("reason", ""))
                raise bad_request(
                    f'container "{container}" in pod "{name}" is waiting to start: {why}'
                )
            runtime = self.store.runtime.get((namespace, name))
            text = runtime.log if runtime else ""
        if (tail := _one(params, "tailLines")) is not None:
            lines = text.splitlines(keepends=True)
            text = "".join(lines[-int(tail) :]) if int(tail) > 0 else ""
        if (limit := _one(params, "limitBytes")) is not None:
            text = text.encode()[: int(limit)].decode(errors="ignore")
        return text

    def _exec_handler(self, target: Target, params: dict[str, list[str]]) -> ExecHandler:
        """The checks the API server and kubelet make before a stream opens, then the handler."""
        with self.store.lock:
            self.store.tick()
            pod = self.store.live("pods", target.namespace or "", target.name or "")
            container = _container(pod, _one(params, "container"))
            phase = pod["status"].get("phase")
            if phase in ("Succeeded", "Failed"):
                raise bad_request(
                    f"cannot exec into a container in a completed pod; current phase is {phase}"
                )
            if phase != "Running":
                raise bad_request(
                    f'unable to upgrade connection: container not found ("{container}")'
                )
            return self.store.exec_handler(pod)

    async def _websocket(self, websocket: WebSocket) -> None:
        """Pod exec. Refusals go out as plain HTTP answers to the upgrade, as the API server
        sends them; the client raises them as an ``ApiException``."""
        path, query = websocket.url.path, websocket.url.query
        entry = self.gate.record("GET", path, query, b"", dict(websocket.headers))
        params = parse_qs(query, keep_blank_values=True)
        try:
            lost = await self.gate.apply_failures("GET", path)
            if lost is not None:
                raise lost  # an upgrade refused is never served: no answer to lose
            identity = self.gate.authenticate(websocket.headers.get("authorization"))
            target = parse_path(path)
            if (
                target is None
                or target.sub != "exec"
                or target.rt.plural != "pods"
                or target.name is None
            ):
                raise unknown_path()
            self.gate.authorize(
                identity, target.rt, "create", target.namespace, target.name, subresource="exec"
            )
            argv = params.get("command") or []
            if not argv:
                raise bad_request("you must specify at least 1 command")
            offered = websocket.scope.get("subprotocols") or [
                websocket.headers.get("sec-websocket-protocol", "")
            ]
            protocol = choose_protocol(",".join(offered))
            if protocol is None:
                raise bad_request(f"none of the offered subprotocols is served: {PROTOCOLS}")
            handler = self._exec_handler(target, params)
        except ApiError as error:
            entry.status = error.code
            await websocket.send_denial_response(
                JSONResponse(error.body, error.code, headers=error.headers)
            )
            return
        entry.status = 101
        request = ExecRequest(
            argv, _flag(params, "stdout"), _flag(params, "stderr"), _flag(params, "tty")
        )
        await serve_exec(websocket, protocol, request, handler)

    def _version_info(self) -> JSON:
        major, minor = self.version
        return {
            "major": str(major),
            "minor": str(minor),
            "gitVersion": f"v{major}.{minor}.0",
            "gitCommit": "0" * 40,
            "gitTreeState": "clean",
            "buildDate": "2024-08-13T07:28:49Z",
            "goVersion": "go1.22.5",
            "compiler": "gc",
            "platform": "linux/amd64",
        }
