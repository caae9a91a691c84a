"""The Modal stand-in itself, called with a bare grpclib stub of the SDK's generated service
(no SDK logic in between): it checks the token, answers with gRPC status codes, names the
RPCs it does not serve, injects faults and delays, and runs a sandbox's entrypoint with the
environment of its secrets."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import pytest
from google.protobuf import empty_pb2
from grpclib import GRPCError, Status
from grpclib.client import Channel
from modal_proto import api_pb2
from modal_proto.api_grpc import ModalClientStub

from tests.standins.modal import ModalStandin

T = TypeVar("T")


def call(
    standin: ModalStandin,
    rpc: Callable[[ModalClientStub, dict[str, str]], Awaitable[T]],
    *,
    token: tuple[str, str] | None = None,
) -> T:
    token_id, token_secret = token or (standin.token_id, standin.token_secret)
    metadata = {"x-modal-token-id": token_id, "x-modal-token-secret": token_secret}
    metadata = {k: v for k, v in metadata.items() if v}  # an empty one is sent as none

    async def run() -> T:
        channel = Channel("127.0.0.1", standin.port)
        try:
            return await rpc(ModalClientStub(channel), metadata)
        finally:
            channel.close()

    return asyncio.run(run())


def status_of(
    standin: ModalStandin,
    rpc: Callable[[ModalClientStub, dict[str, str]], Awaitable[Any]],
    **kw: Any,
) -> Status:
    with pytest.raises(GRPCError) as raised:
        call(standin, rpc, **kw)
    return raised.value.status


def test_a_wrong_or_missing_token_is_unauthenticated(modal_standin: ModalStandin) -> None:
    def hello(stub: ModalClientStub, md: dict[str, str]) -> Awaitable[Any]:
        return stub.ClientHello(empty_pb2.Empty(), metadata=md)

    assert call(modal_standin, hello).image_builder_version
    wrong = (modal_standin.token_id, "as-wrong")
    assert status_of(modal_standin, hello, token=wrong) is Status.UNAUTHENTICATED
    assert status_of(modal_standin, hello, token=("", "")) is Status.UNAUTHENTICATED


def test_unserved_rpcs_are_unimplemented_and_named(modal_standin: ModalStandin) -> None:
    def deploy(stub: ModalClientStub, md: dict[str, str]) -> Awaitable[Any]:
        return stub.AppDeploy(api_pb2.AppDeployRequest(), metadata=md)

    with pytest.raises(GRPCError) as raised:
        call(modal_standin, deploy)
    assert raised.value.status is Status.UNIMPLEMENTED
    assert "AppDeploy" in (raised.value.message or "")


def test_injected_faults_and_delays_then_normal_service(modal_standin: ModalStandin) -> None:
    def app(stub: ModalClientStub, md: dict[str, str]) -> Awaitable[Any]:
        return stub.AppGetOrCreate(api_pb2.AppGetOrCreateRequest(app_name="faults"), metadata=md)

    modal_standin.fail("AppGetOrCreate", Status.RESOURCE_EXHAUSTED)
    modal_standin.fail("AppGetOrCreate", Status.PERMISSION_DENIED)
    assert status_of(modal_standin, app) is Status.RESOURCE_EXHAUSTED
    assert status_of(modal_standin, app) is Status.PERMISSION_DENIED
    modal_standin.delay("AppGetOrCreate", 0.5)
    started = time.monotonic()
    first = call(modal_standin, app).app_id
    assert time.monotonic() - started >= 0.5
    assert call(modal_standin, app).app_id == first  # get-or-create: the same app
    missing = api_pb2.SandboxWaitRequest(sandbox_id="sb-0000000000000000000000")
    unknown = status_of(modal_standin, lambda stub, md: stub.SandboxWait(missing, metadata=md))
    assert unknown is Status.NOT_FOUND


def test_a_sandbox_runs_its_entrypoint_with_its_secrets_and_records_its_gpu(
    modal_standin: ModalStandin,
) -> None:
    async def create(stub: ModalClientStub, md: dict[str, str]) -> str:
        app = await stub.AppGetOrCreate(api_pb2.AppGetOrCreateRequest(app_name="raw"), metadata=md)
        image = await stub.ImageGetOrCreate(
            api_pb2.ImageGetOrCreateRequest(app_id=app.app_id), metadata=md
        )
        secret = await stub.SecretGetOrCreate(
            api_pb2.SecretGetOrCreateRequest(env_dict={"GREETING": "hello"}), metadata=md
        )
        definition = api_pb2.Sandbox(
            entrypoint_args=["sh", "-c", 'echo "$GREETING"'],
            image_id=image.image_id,
            secret_ids=[secret.secret_id],
            resources=api_pb2.Resources(gpu_config=api_pb2.GPUConfig(gpu_type="H100", count=2)),
            timeout_secs=60,
        )
        made = await stub.SandboxCreate(
            api_pb2.SandboxCreateRequest(app_id=app.app_id, definition=definition), metadata=md
        )
        wait = api_pb2.SandboxWaitRequest(sandbox_id=made.sandbox_id, timeout=10)
        result = (await stub.SandboxWait(wait, metadata=md)).result
        assert (result.status, result.exitcode) == (api_pb2.GenericResult.GENERIC_STATUS_SUCCESS, 0)
        return made.sandbox_id

    sandbox = modal_standin.sandbox(call(modal_standin, create))
    assert sandbox.gpu == "H100:2"
    assert sandbox.log() == "hello\n"
