"""The control plane of the Modal stand-in: the SDK's own generated ``ModalClient`` service
(``modal_proto.api_grpc.ModalClientBase``), serving the RPCs ``modal.App.lookup``,
``modal.Image``, ``modal.Secret.from_dict`` and ``modal.Sandbox`` send, with Modal's gRPC
status codes. Every other RPC answers ``UNIMPLEMENTED`` naming itself, so a new SDK calling
something else fails loudly rather than hanging."""

from __future__ import annotations

import asyncio
import base64
import hmac
import json
import secrets
import time
from collections.abc import Awaitable, Callable
from typing import Any

from google.protobuf import empty_pb2, text_format
from google.protobuf.message import Message
from grpclib import GRPCError, Status
from grpclib.server import Stream
from modal_proto import api_pb2
from modal_proto.api_grpc import ModalClientBase

from tests.standins.modal_state import (
    TOKEN_ID_HEADER,
    TOKEN_SECRET_HEADER,
    ModalState,
    RecordedRequest,
    StandinSandbox,
    new_id,
)

IMAGE_BUILDER_VERSION = "2025.06"
MASK = "<masked>"

Handler = Callable[[Any, Message, Stream[Any, Any]], Awaitable[Message]]


class Gate:
    """What every RPC of both services passes first: recorded, then faults, then auth."""

    def __init__(self, state: ModalState, credentials: Callable[[], tuple[str, str]]) -> None:
        self.state = state
        self.credentials = credentials

    async def enter(self, method: str, stream: Stream[Any, Any], request: Message) -> None:
        metadata = {
            k: (MASK if k == TOKEN_SECRET_HEADER else str(v)) for k, v in stream.metadata.items()
        }
        with self.state.lock:
            self.state.requests.append(
                RecordedRequest(method, metadata, text_format.MessageToString(request))
            )
        fault = self.state.take_fault(method)
        if fault is not None:
            if fault.delay_s:
                await asyncio.sleep(fault.delay_s)
            if fault.status is not None:
                raise GRPCError(fault.status, fault.message or f"injected {fault.status.name}")

    def check_token(self, stream: Stream[Any, Any]) -> None:
        token_id, token_secret = self.credentials()
        given_id = str(stream.metadata.get(TOKEN_ID_HEADER, ""))
        given_secret = str(stream.metadata.get(TOKEN_SECRET_HEADER, ""))
        if not given_id or not given_secret:
            raise GRPCError(Status.UNAUTHENTICATED, "Token missing. Could not authenticate client.")
        if given_id != token_id or not hmac.compare_digest(given_secret, token_secret):
            raise GRPCError(
                Status.UNAUTHENTICATED, f"Token {given_id} is invalid or has been revoked."
            )

    def issue_auth_token(self) -> str:
        """A JWT-shaped token (the SDK reads its ``exp``) valid for an hour."""
        claims = {"exp": int(time.time()) + 3600, "jti": secrets.token_hex(8)}
        parts = [{"alg": "none", "typ": "JWT"}, claims]
        token = ".".join(_b64(json.dumps(p).encode()) for p in parts) + ".standin"
        with self.state.lock:
            self.state.auth_tokens.add(token)
        return token

    def check_auth_token(self, stream: Stream[Any, Any]) -> None:
        given = str(stream.metadata.get("x-modal-auth-token", ""))
        with self.state.lock:
            known = given in self.state.auth_tokens
        if not known:
            raise GRPCError(Status.UNAUTHENTICATED, "missing or invalid x-modal-auth-token")


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).decode().rstrip("=")


def serve_unary(handler: Handler) -> Callable[[Any, Stream[Any, Any]], Awaitable[None]]:
    """A unary RPC: read the request, pass the gate, answer with what ``handler`` returns.
    The ``…V2`` RPCs (and the V2 command router access) also need the short-lived auth
    token ``AuthTokenGet`` issued, as Modal's do."""
    name = handler.__name__

    async def rpc(self: Any, stream: Stream[Any, Any]) -> None:
        request = await stream.recv_message()
        assert request is not None
        await self.gate.enter(name, stream, request)
        self.gate.check_token(stream)
        if name.endswith("V2") or name == "SandboxGetCommandRouterAccess":
            self.gate.check_auth_token(stream)
        await stream.send_message(await handler(self, request, stream))

    rpc.__name__ = name
    return rpc


def fill_unimplemented(cls: type[Any]) -> type[Any]:
    """Answer every RPC the class does not serve with UNIMPLEMENTED, naming it."""
    for name in sorted(getattr(cls, "__abstractmethods__", ())):

        async def unimplemented(self: Any, stream: Stream[Any, Any], _name: str = name) -> None:
            request = await stream.recv_message()
            await self.gate.enter(_name, stream, request or empty_pb2.Empty())
            raise GRPCError(Status.UNIMPLEMENTED, f"the Modal stand-in does not serve {_name}")

        unimplemented.__name__ = name
        setattr(cls, name, unimplemented)
    cls.__abstractmethods__ = frozenset()
    return cls


def _tags(tags: Any) -> dict[str, str]:
    return {tag.tag_name: tag.tag_value for tag in tags}


def result_proto(result: tuple[int, int] | None) -> api_pb2.GenericResult:
    if result is None:
        return api_pb2.GenericResult()
    status, code = result
    exception = {3: "Sandbox terminated", 4: "Sandbox timed out"}.get(status, "")
    return api_pb2.GenericResult(status=status, exitcode=code, exception=exception)


@fill_unimplemented
class ModalApi(ModalClientBase):
    """The control-plane RPCs: apps, environments, images, secrets, sandboxes."""

    def __init__(self, gate: Gate, router_url: Callable[[], str]) -> None:
        self.gate = gate
        self.state = gate.state
        self.router_url = router_url

    @serve_unary
    async def ClientHello(self, request: Message, stream: Stream[Any, Any]) -> Message:
        return api_pb2.ClientHelloResponse(image_builder_version=IMAGE_BUILDER_VERSION)

    @serve_unary
    async def AppGetOrCreate(self, request: Any, stream: Stream[Any, Any]) -> Message:
        key = f"{request.environment_name}/{request.app_name}"
        with self.state.lock:
            app_id = self.state.apps.setdefault(key, new_id("ap"))
        return api_pb2.AppGetOrCreateResponse(app_id=app_id)

    @serve_unary
    async def EnvironmentGetOrCreate(self, request: Any, stream: Stream[Any, Any]) -> Message:
        settings = api_pb2.EnvironmentSettings(image_builder_version=IMAGE_BUILDER_VERSION)
        metadata = api_pb2.EnvironmentMetadata(
            name=request.deployment_name or "main", settings=settings
        )
        return api_pb2.EnvironmentGetOrCreateResponse(environment_id="en-main", metadata=metadata)

    @serve_unary
    async def ImageGetOrCreate(self, request: Any, stream: Stream[Any, Any]) -> Message:
        made_from = text_format.MessageToString(request.image)
        with self.state.lock:
            known = [i for i, m in self.state.images.items() if m == made_from]
            image_id = known[0] if known else new_id("im")
            self.state.images[image_id] = made_from
        # Answered as already built: nothing is built here.
        return api_pb2.ImageGetOrCreateResponse(
            image_id=image_id,
            result=api_pb2.GenericResult(status=api_pb2.GenericResult.GENERIC_STATUS_SUCCESS),
            metadata=api_pb2.ImageMetadata(python_version_info="Python 3.12.0"),
        )

    @serve_unary
    async def ImageFromId(self, request: Any, stream: Stream[Any, Any]) -> Message:
        with self.state.lock:
            if request.image_id not in self.state.images:
                raise GRPCError(Status.NOT_FOUND, f"Image {request.image_id} not found")
        return api_pb2.ImageFromIdResponse(
            image_id=request.image_id,
            metadata=api_pb2.ImageMetadata(python_version_info="Python 3.12.0"),
        )

    @serve_unary
    async def SecretGetOrCreate(self, request: Any, stream: Stream[Any, Any]) -> Message:
        if not request.env_dict:
            raise GRPCError(Status.NOT_FOUND, f"Secret {request.deployment_name!r} not found")
        secret_id = new_id("st")
        with self.state.lock:
            self.state.secrets[secret_id] = dict(request.env_dict)
        return api_pb2.SecretGetOrCreateResponse(secret_id=secret_id)

    @serve_unary
    async def AuthTokenGet(self, request: Any, stream: Stream[Any, Any]) -> Message:
        return api_pb2.AuthTokenGetResponse(token=self.gate.issue_auth_token())

    # -- sandboxes: V1 (a GPU, or MODAL_SANDBOX_V2=0) and V2 (the SDK's default) -----------

    @serve_unary
    async def SandboxCreate(self, request: Any, stream: Stream[Any, Any]) -> Message:
        env: dict[str, str] = {}
        for secret_id in request.definition.secret_ids:
            env.update(self._secret(secret_id))
        sandbox = self._create(request, env, version=1)
        return api_pb2.SandboxCreateResponse(sandbox_id=sandbox.sandbox_id)

    @serve_unary
    async def SandboxCreateV2(self, request: Any, stream: Stream[Any, Any]) -> Message:
        env: dict[str, str] = {}
        for secret_id in request.definition.secret_ids:
            env.update(self._secret(secret_id))
        for source in request.secret_sources:  # Secret.from_dict travels inline in V2
            env.update(self._secret(source.secret_id) if source.secret_id else source.env.contents)
        sandbox = self._create(request, env, version=2)
        jwt = self._router_jwt(sandbox.task_id)
        return api_pb2.SandboxCreateV2Response(
            sandbox_id=sandbox.sandbox_id,
            task_id=sandbox.task_id,
            metadata=api_pb2.SandboxHandleMetadata(app_id=sandbox.app_id),
            command_router_access=api_pb2.CommandRouterAccess(jwt=jwt, url=self.router_url()),
        )

    def _secret(self, secret_id: str) -> dict[str, str]:
        with self.state.lock:
            if secret_id not in self.state.secrets:
                raise GRPCError(Status.NOT_FOUND, f"Secret {secret_id} not found")
            return dict(self.state.secrets[secret_id])

    def _create(self, request: Any, env: dict[str, str], *, version: int) -> StandinSandbox:
        definition = request.definition
        with self.state.lock:
            if definition.image_id not in self.state.images:
                raise GRPCError(Status.NOT_FOUND, f"Image {definition.image_id} not found")
            taken = [
                s
                for s in self.state.live()
                if definition.name and s.app_id == request.app_id and s.name == definition.name
            ]
            if taken:
                raise GRPCError(
                    Status.ALREADY_EXISTS,
                    f"Sandbox with name '{definition.name}' already exists in this App",
                )
            sandbox = self._new_sandbox(request, env, version)
            self.state.sandboxes[sandbox.sandbox_id] = sandbox
        self.state.start(sandbox)
        return sandbox

    def _new_sandbox(self, request: Any, env: dict[str, str], version: int) -> StandinSandbox:
        definition, resources = request.definition, request.definition.resources
        # A V1 id is "sb-" and 22 letters and digits; the SDK takes any other shape for V2.
        sandbox_id = new_id("sb") if version == 1 else f"sb-v2{new_id('x')}"
        return StandinSandbox(
            sandbox_id=sandbox_id,
            task_id=new_id("ta"),
            version=version,
            app_id=request.app_id,
            name=definition.name,
            tags=_tags(request.tags),
            argv=list(definition.entrypoint_args) or ["sleep", "infinity"],
            env=env,
            image_id=definition.image_id,
            gpu_type=resources.gpu_config.gpu_type,
            gpu_count=resources.gpu_config.count,
            milli_cpu=resources.milli_cpu,
            memory_mb=resources.memory_mb,
            timeout_s=definition.timeout_secs or 300,
            workdir=self.state.root / sandbox_id,
            created_at=time.monotonic(),
        )

    def _sandbox(self, sandbox_id: str, version: int) -> StandinSandbox:
        with self.state.lock:
            sandbox = self.state.sandboxes.get(sandbox_id)
            if sandbox is None or sandbox.version != version:
                raise GRPCError(Status.NOT_FOUND, f"Sandbox {sandbox_id} not found")
            self.state.refresh(sandbox)
            return sandbox

    def _router_jwt(self, task_id: str) -> str:
        with self.state.lock:
            return self.state.jwts.setdefault(task_id, secrets.token_urlsafe(24))

    @serve_unary
    async def SandboxGetTaskId(self, request: Any, stream: Stream[Any, Any]) -> Message:
        return self._task_id(self._sandbox(request.sandbox_id, 1))

    @serve_unary
    async def SandboxGetTaskIdV2(self, request: Any, stream: Stream[Any, Any]) -> Message:
        return self._task_id(self._sandbox(request.sandbox_id, 2))

    @staticmethod
    def _task_id(sandbox: StandinSandbox) -> Message:
        if sandbox.result is not None:
            return api_pb2.SandboxGetTaskIdResponse(task_result=result_proto(sandbox.result))
        return api_pb2.SandboxGetTaskIdResponse(task_id=sandbox.task_id)

    @serve_unary
    async def SandboxWait(self, request: Any, stream: Stream[Any, Any]) -> Message:
        return await self._wait(self._sandbox(request.sandbox_id, 1), request.timeout)

    @serve_unary
    async def SandboxWaitV2(self, request: Any, stream: Stream[Any, Any]) -> Message:
        return await self._wait(self._sandbox(request.sandbox_id, 2), request.timeout)

    async def _wait(self, sandbox: StandinSandbox, timeout_s: float) -> Message:
        deadline = time.monotonic() + max(0.0, timeout_s)
        while sandbox.result is None and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
            self.state.refresh(sandbox)
        result = result_proto(sandbox.result)
        metadata = api_pb2.SandboxHandleMetadata(app_id=sandbox.app_id, result=result)
        return api_pb2.SandboxWaitResponse(result=result, metadata=metadata)

    @serve_unary
    async def SandboxTerminate(self, request: Any, stream: Stream[Any, Any]) -> Message:
        return self._terminate(self._sandbox(request.sandbox_id, 1))

    @serve_unary
    async def SandboxTerminateV2(self, request: Any, stream: Stream[Any, Any]) -> Message:
        return self._terminate(self._sandbox(request.sandbox_id, 2))

    def _terminate(self, sandbox: StandinSandbox) -> Message:
        existing = result_proto(sandbox.result)
        self.state.terminate(sandbox)
        return api_pb2.SandboxTerminateResponse(existing_result=existing)

    @serve_unary
    async def SandboxGetFromName(self, request: Any, stream: Stream[Any, Any]) -> Message:
        return self._by_name(request, 1)

    @serve_unary
    async def SandboxGetFromNameV2(self, request: Any, stream: Stream[Any, Any]) -> Message:
        return self._by_name(request, 2)

    def _by_name(self, request: Any, version: int) -> Message:
        key = f"{request.environment_name}/{request.app_name}"
        with self.state.lock:
            app_id = self.state.apps.get(key)
            found = [
                s
                for s in self.state.live()
                if s.app_id == app_id and s.name == request.sandbox_name and s.version == version
            ]
        if not found:
            raise GRPCError(
                Status.NOT_FOUND,
                f"Sandbox with name '{request.sandbox_name}' not found in App '{request.app_name}'",
            )
        metadata = api_pb2.SandboxHandleMetadata(app_id=found[0].app_id)
        return api_pb2.SandboxGetFromNameResponse(sandbox_id=found[0].sandbox_id, metadata=metadata)

    @serve_unary
    async def SandboxList(self, request: Any, stream: Stream[Any, Any]) -> Message:
        return self._list(request, versions=(1,))

    @serve_unary
    async def SandboxListV2(self, request: Any, stream: Stream[Any, Any]) -> Message:
        return self._list(request, versions=(1, 2))  # lists both, as Modal's does

    def _list(self, request: Any, versions: tuple[int, ...]) -> Message:
        wanted = _tags(request.tags)
        before = request.before_timestamp or float("inf")
        with self.state.lock:
            everything = [*self.state.sandboxes.values()]
            sandboxes = everything if request.include_finished else self.state.live()
            chosen = [
                s
                for s in sandboxes
                if s.version in versions
                and (not request.app_id or s.app_id == request.app_id)
                and wanted.items() <= s.tags.items()
                and s.created_at < before
            ]
        chosen.sort(key=lambda s: s.created_at, reverse=True)
        return api_pb2.SandboxListResponse(sandboxes=[self._info(s) for s in chosen[:25]])

    @staticmethod
    def _info(sandbox: StandinSandbox) -> api_pb2.SandboxInfo:
        return api_pb2.SandboxInfo(
            id=sandbox.sandbox_id,
            # Monotonic seconds: only ever compared with each other (list paging).
            created_at=sandbox.created_at,
            app_id=sandbox.app_id,
            name=sandbox.name,
            tags=[api_pb2.SandboxTag(tag_name=k, tag_value=v) for k, v in sandbox.tags.items()],
            task_info=api_pb2.TaskInfo(id=sandbox.task_id, result=result_proto(sandbox.result)),
            metadata=api_pb2.SandboxHandleMetadata(app_id=sandbox.app_id),
        )

    @serve_unary
    async def SandboxTagsGet(self, request: Any, stream: Stream[Any, Any]) -> Message:
        return self._tags_of(self._sandbox(request.sandbox_id, 1))

    @serve_unary
    async def SandboxTagsGetV2(self, request: Any, stream: Stream[Any, Any]) -> Message:
        return self._tags_of(self._sandbox(request.sandbox_id, 2))

    @staticmethod
    def _tags_of(sandbox: StandinSandbox) -> Message:
        tags = [api_pb2.SandboxTag(tag_name=k, tag_value=v) for k, v in sandbox.tags.items()]
        return api_pb2.SandboxTagsGetResponse(tags=tags)

    @serve_unary
    async def TaskGetCommandRouterAccess(self, request: Any, stream: Stream[Any, Any]) -> Message:
        with self.state.lock:
            known = [s for s in self.state.sandboxes.values() if s.task_id == request.task_id]
        if not known:
            raise GRPCError(Status.NOT_FOUND, f"Task {request.task_id} not found")
        jwt = self._router_jwt(request.task_id)
        return api_pb2.TaskGetCommandRouterAccessResponse(jwt=jwt, url=self.router_url())

    @serve_unary
    async def SandboxGetCommandRouterAccess(
        self, request: Any, stream: Stream[Any, Any]
    ) -> Message:
        with self.state.lock:
            known = [
                s
                for s in self.state.sandboxes.values()
                if s.sandbox_id == request.sandbox_id or s.task_id == request.task_id
            ]
        if not known:
            raise GRPCError(Status.NOT_FOUND, "Sandbox not found")
        jwt = self._router_jwt(known[0].task_id)
        return api_pb2.SandboxGetCommandRouterAccessResponse(jwt=jwt, url=self.router_url())
