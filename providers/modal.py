"""The modal provider: one Modal Sandbox per corral sandbox, through the official ``modal`` SDK.

A sandbox is ``modal.Sandbox.create`` in the configured app (looked up, created if missing),
named after corral's sandbox id, from the configured image (a registry reference, or an
``im-…`` image id), running corral's runner command, with the spec's cpu, memory, timeout
and GPUs (``resources.gpu`` of the configured GPU type), corral's labels as tags, and the
spec's environment — the registration token and control URL included — as a Secret made
from a dict, never on the command line or in a tag. Without network (``allow_network``
false) its egress is limited to the control plane's host.

Statuses come from ``poll()``: no return code is running; ended ones are told apart with
``wait()`` (terminated, timed out, or the entrypoint's exit code); a sandbox Modal no longer
knows is terminated. Terminate is idempotent, exec goes through ``Sandbox.exec``, and
``list_managed`` lists the app's sandboxes by tag.

The credential is the org's stored one, else ``CORRAL_MODAL_API_KEY``
(:func:`corral.providers.credentials.resolve_credential`), holding the Modal token as
``token_id:token_secret``. It is given to the SDK client made for each call, never to the
sandbox. The inventory, which has no org, uses ``CORRAL_MODAL_API_KEY``.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import math
import posixpath
import time
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from typing import Any, TypeVar
from urllib.parse import urlsplit

import modal
import modal.exception as mx
from modal_proto import api_pb2
from pydantic import SecretStr

from corral.providers.base import (
    DEFAULT_EXEC_OUTPUT_MAX_BYTES,
    ExecResult,
    ManagedSandbox,
    SandboxHandle,
    SandboxSpec,
    SandboxState,
    SandboxStatus,
    exit_status,
)
from corral.providers.configs.modal import ModalProviderConfig, ModalProviderOptions
from corral.providers.credentials import credential_env_var
from corral.providers.descriptors import BUILTIN
from corral.providers.errors import (
    CredentialRejectedError,
    InvalidProviderConfigError,
    ProviderTimeoutError,
    ProviderUnavailableError,
    SandboxCreateError,
    SandboxNotRunningError,
)
from corral.providers.size_limits import ExecOutput, OutputBuffer
from corral.providers.vendor import VendorProvider

__all__ = ["ModalProvider", "ModalProviderConfig", "ModalProviderOptions"]

log = logging.getLogger(__name__)

# hpack (HTTP/2 header compression, under grpclib) logs every header it encodes at DEBUG, the
# Modal token secret among them: unless an operator set its level, keep it quieter than that.
_HPACK = logging.getLogger("hpack")
if _HPACK.level == logging.NOTSET:
    _HPACK.setLevel(logging.INFO)

PROVIDER_ID = "modal"
DEPLOYMENT_LABEL = "corral.deployment"
T = TypeVar("T")


class ModalProvider(VendorProvider):
    """Modal Sandboxes (dial-out runners, GPUs, tag inventory)."""

    id = PROVIDER_ID
    display_name = BUILTIN["modal"].display_name
    vendor = "Modal"
    api_name = "the Modal API"
    credential_noun = "token"
    credential_form = " (token_id:token_secret)"
    config_model = ModalProviderConfig
    options_model = ModalProviderOptions
    config: ModalProviderConfig

    # -- contract ------------------------------------------------------------------------

    def provision(self, spec: SandboxSpec) -> SandboxHandle:
        options = self.parse_options(spec)
        assert isinstance(options, ModalProviderOptions)
        network = _network(spec)
        token = self._token(spec.org_id)

        async def make(client: modal.Client) -> str:
            app = await self._app(client, create=True)
            kwargs = self._create_kwargs(spec, options, network)
            try:
                sandbox = await modal.Sandbox.create.aio(*kwargs.pop("args"), app=app, **kwargs)
            except mx.AlreadyExistsError:  # a second delivery of the same provision
                found = await self._by_name(client, spec.sandbox_id)
                if found is None:  # it ended meanwhile: its name is free again
                    raise
                return found.object_id
            return sandbox.object_id

        action = f"creating a sandbox from image {options.image or self.config.image!r}"
        external_id = self._call(
            action, spec.org_id, token, make, self.config.create_timeout_s, creating=True
        )
        return self._handle(spec, external_id)

    def status(self, handle: SandboxHandle) -> SandboxStatus:
        async def read(client: modal.Client) -> SandboxStatus:
            sandbox = await self._find(client, handle)
            if sandbox is None:
                return SandboxStatus(
                    state=SandboxState.TERMINATED, reason="sandbox no longer exists"
                )
            code = await sandbox.poll.aio()
            if code is None:
                return SandboxStatus(state=SandboxState.RUNNING)
            return await _ended(sandbox, code)

        return self._call("reading a sandbox", handle.org_id, self._token(handle.org_id), read)

    def terminate(self, handle: SandboxHandle) -> None:
        async def stop(client: modal.Client) -> None:
            sandbox = await self._find(client, handle)
            if sandbox is not None:  # gone already: done
                await sandbox.terminate.aio(wait=True)

        self._call("terminating a sandbox", handle.org_id, self._token(handle.org_id), stop)

    def _probe(self, key: SecretStr, org_id: str | None) -> None:
        token = _split_token(key, _whose(org_id))

        async def lookup(client: modal.Client) -> None:
            await self._app(client, create=False)  # any answer but a refusal will do

        self._call("looking the app up", org_id, token, lookup)

    # -- optional abilities ---------------------------------------------------------------

    def exec_command(
        self,
        handle: SandboxHandle,
        command: str | Sequence[str],
        *,
        env: Mapping[str, str] | None = None,
        cwd: str | None = None,
        timeout_s: float | None = None,
        max_output_bytes: int = DEFAULT_EXEC_OUTPUT_MAX_BYTES,
    ) -> ExecResult:
        argv = ["/bin/sh", "-c", command] if isinstance(command, str) else list(command)
        if not argv:
            raise InvalidProviderConfigError("exec needs a command; got an empty argv")
        workdir = posixpath.join(self.config.workdir or "/", cwd) if cwd else None
        output = ExecOutput(max_output_bytes)
        started = time.monotonic()

        async def run(client: modal.Client) -> int:
            sandbox = await self._find(client, handle)
            if sandbox is None or await sandbox.poll.aio() is not None:
                raise SandboxNotRunningError(f"sandbox {handle.external_id} is not running")
            try:
                process = await sandbox.exec.aio(
                    *argv,
                    env=dict(env or {}),
                    workdir=workdir,
                    timeout=math.ceil(timeout_s) if timeout_s else None,
                    text=False,
                )
                # Both streams read as they come, into the bounded buffers (read() keeps all).
                await asyncio.gather(
                    _drain(process.stdout, output.stdout), _drain(process.stderr, output.stderr)
                )
                code: int = await process.wait.aio()
            finally:
                # An exec opens a connection of its own to the sandbox's task (the SDK's
                # command router), which the client's close leaves open: one per call.
                await sandbox.detach.aio()  # type: ignore[no-untyped-call]  # unannotated in the SDK
            return code

        # The command's own timeout is Modal's to enforce; the call waits a little longer.
        limit = max(self.config.request_timeout_s, (timeout_s or 0) + self.config.request_timeout_s)
        token = self._token(handle.org_id)
        code = self._call("running a command", handle.org_id, token, run, limit)
        if timeout_s and code == -1:  # the SDK's answer for a command past its deadline
            raise ProviderTimeoutError(
                f"the command in {handle.external_id} outlived its {timeout_s:g}s timeout"
            )
        return output.result(exit_code=code, duration_s=time.monotonic() - started)

    def list_managed(self) -> list[ManagedSandbox]:
        key = _split_token(self._inventory_key(), _whose(None))
        wanted = {"corral.managed": "true", DEPLOYMENT_LABEL: self.config.deployment}

        async def listing(client: modal.Client) -> list[ManagedSandbox]:
            app = await self._app(client, create=False)
            if app is None:
                return []
            managed = []
            async for sandbox in modal.Sandbox.list.aio(
                app_id=app.app_id, tags=wanted, client=client
            ):
                managed.append(self._managed(sandbox.object_id, await sandbox.get_tags.aio()))
            return managed

        return self._call("listing sandboxes", None, key, listing)

    def _managed(self, external_id: str, tags: dict[str, str]) -> ManagedSandbox:
        sandbox_id = tags.get("corral.sandbox-id", "")
        handle = SandboxHandle(
            provider_id=self.id,
            external_id=external_id,
            metadata={"org_id": tags.get("corral.org-id", "unknown"), "sandbox_id": sandbox_id},
        )
        # Modal lists running sandboxes only.
        return ManagedSandbox(
            handle=handle, sandbox_id=sandbox_id, labels=tags, state=SandboxState.RUNNING
        )

    # -- internals -----------------------------------------------------------------------

    def _create_kwargs(
        self, spec: SandboxSpec, options: ModalProviderOptions, network: dict[str, Any]
    ) -> dict[str, Any]:
        resources = spec.resources
        gpu = None
        if resources.gpu:
            kind = options.gpu_type or self.config.gpu_type
            gpu = kind if resources.gpu == 1 else f"{kind}:{resources.gpu}"
        return {
            "args": list(options.command or self.config.command),
            "name": spec.sandbox_id,
            "image": _image(options.image or self.config.image),
            # The token and control URL travel as a Secret, never as plain arguments or tags.
            "secrets": [modal.Secret.from_dict(dict(spec.sandbox_env()))],
            "tags": {**spec.managed_labels(), DEPLOYMENT_LABEL: self.config.deployment},
            "timeout": resources.timeout_s or self.config.default_timeout_s,
            "cpu": resources.cpu,
            "memory": resources.memory_mb,
            "gpu": gpu,
            "workdir": self.config.workdir,
            **network,
        }

    async def _app(self, client: modal.Client, *, create: bool) -> modal.App | None:
        try:
            return await modal.App.lookup.aio(
                self.config.app_name,
                create_if_missing=create,
                client=client,
                environment_name=self.config.environment,
            )
        except mx.NotFoundError:
            if create:
                raise
            return None

    async def _find(self, client: modal.Client, handle: SandboxHandle) -> modal.Sandbox | None:
        """The handle's sandbox, None when Modal no longer has it. A handle whose external id
        is corral's sandbox id (a provision that never returned) is looked up by name."""
        if handle.external_id == handle.metadata.get("sandbox_id"):
            return await self._by_name(client, handle.external_id)
        try:
            return await modal.Sandbox.from_id.aio(handle.external_id, client=client)
        except mx.NotFoundError:
            return None

    async def _by_name(self, client: modal.Client, name: str) -> modal.Sandbox | None:
        try:
            return await modal.Sandbox.from_name.aio(
                self.config.app_name, name, environment_name=self.config.environment, client=client
            )
        except mx.NotFoundError:
            return None

    def _token(self, org_id: str) -> tuple[str, str]:
        return _split_token(self._api_key(org_id), _whose(org_id))

    def _call(
        self,
        action: str,
        org_id: str | None,
        token: tuple[str, str],
        work: Callable[[modal.Client], Awaitable[T]],
        timeout_s: float | None = None,
        *,
        creating: bool = False,
    ) -> T:
        """Run ``work`` with a client of its own, holding ``token``, within the timeout."""
        server_url = self.config.server_url or str(modal.config.config["server_url"])
        limit = timeout_s or self.config.request_timeout_s

        async def call() -> T:
            # The client connects on entry (retrying for a minute): inside the time limit.
            async with modal.Client(server_url, api_pb2.CLIENT_TYPE_CLIENT, token) as client:
                return await work(client)

        with self._sdk_errors(action, org_id, limit, creating=creating):
            return asyncio.run(asyncio.wait_for(call(), limit))

    @contextlib.contextmanager
    def _sdk_errors(
        self, action: str, org_id: str | None, limit: float, *, creating: bool = False
    ) -> Iterator[None]:
        """The SDK's exceptions as corral's provider errors, with what to do about them."""
        try:
            yield
        except (TimeoutError, mx.TimeoutError) as exc:
            raise ProviderTimeoutError(
                f"Modal did not answer within {limit:g}s while {action}"
            ) from exc
        except (mx.ConnectionError, mx.ClientClosed, OSError) as exc:
            raise ProviderUnavailableError(
                f"Modal could not be reached while {action}: {exc}"
            ) from exc
        except mx.Error as exc:
            code, status = _status_of(exc)
            if status:
                raise self.status_error(
                    status, action, org_id, str(exc), said=code, creating=creating
                ) from exc
            if isinstance(exc, mx.ConflictError):  # FAILED_PRECONDITION: it has ended
                raise SandboxNotRunningError(
                    f"Modal: the sandbox has ended ({action}): {exc}"
                ) from exc
            raise SandboxCreateError(
                f"Modal refused {action}: {type(exc).__name__}: {exc}"
            ) from exc


def _split_token(secret: SecretStr, where: str) -> tuple[str, str]:
    token_id, _, token_secret = secret.get_secret_value().strip().partition(":")
    if not token_id or not token_secret:
        raise CredentialRejectedError(
            f"{where} must be a Modal token as token_id:token_secret (e.g. ak-…:as-…); store it "
            "again in that form"
        )
    return token_id, token_secret


def _image(reference: str) -> modal.Image:
    if reference.startswith("im-"):
        return modal.Image.from_id(reference)
    return modal.Image.from_registry(reference)


def _network(spec: SandboxSpec) -> dict[str, Any]:
    """Sandbox.create's egress arguments: none with network, else the control plane alone
    (the runner dials out to it)."""
    if spec.egress.allow_network:
        return {}
    host = urlsplit(spec.control_url).hostname
    if not host or not spec.control_url.startswith(("http://", "https://")):
        raise InvalidProviderConfigError(
            "a sandbox without network on Modal needs an http(s) CORRAL_CONTROL_URL that Modal "
            "can reach (the runner dials out to it)"
        )
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return {"outbound_domain_allowlist": [host]}
    return {"outbound_cidr_allowlist": [f"{address}/{address.max_prefixlen}"]}


async def _drain(stream: Any, buffer: OutputBuffer) -> None:
    """Read an exec's stdout or stderr to its end, keeping what fits in ``buffer``."""
    async for chunk in stream:
        buffer.add(chunk)


async def _ended(sandbox: modal.Sandbox, code: int) -> SandboxStatus:
    """The status of a sandbox that has a return code: terminated, timed out or exited."""
    try:
        await sandbox.wait.aio(raise_on_termination=True)
    except mx.SandboxTerminatedError:
        return SandboxStatus(state=SandboxState.TERMINATED, reason="terminated", exit_code=code)
    except mx.SandboxTimeoutError:
        return SandboxStatus(
            state=SandboxState.FAILED,
            reason="timed out: the sandbox outlived its timeout",
            exit_code=code,
        )
    return exit_status(code)


def _whose(org_id: str | None) -> str:
    """Whose Modal credential it is, for a message."""
    return (
        credential_env_var(PROVIDER_ID)
        if org_id is None
        else (f"the modal credential of org {org_id!r}")
    )


# gRPC status codes by the HTTP status they stand for (as grpc-gateway maps them). Those not
# here (INVALID_ARGUMENT, FAILED_PRECONDITION, OUT_OF_RANGE, UNIMPLEMENTED, DATA_LOSS) are
# refusals with no status of the table's.
_GRPC_STATUS = {
    "UNAUTHENTICATED": 401,
    "PERMISSION_DENIED": 403,
    "NOT_FOUND": 404,
    "ALREADY_EXISTS": 409,
    "ABORTED": 409,
    "RESOURCE_EXHAUSTED": 429,
    "CANCELLED": 503,
    "UNKNOWN": 500,
    "INTERNAL": 500,
    "UNAVAILABLE": 503,
    "DEADLINE_EXCEEDED": 504,
}
# The SDK's exceptions raised without a gRPC status (by the client itself), by their code.
_CLASS_CODE: tuple[tuple[type[BaseException], str], ...] = (
    (mx.AuthError, "UNAUTHENTICATED"),
    (mx.PermissionDeniedError, "PERMISSION_DENIED"),
    (mx.NotFoundError, "NOT_FOUND"),
    (mx.AlreadyExistsError, "ALREADY_EXISTS"),
    (mx.ResourceExhaustedError, "RESOURCE_EXHAUSTED"),
    (mx.InternalError, "INTERNAL"),
    (mx.ServiceError, "UNAVAILABLE"),
)


def _status_of(exc: BaseException) -> tuple[str, int]:
    """The gRPC code behind an SDK exception and the HTTP status it stands for (0: none)."""
    grpc_status = getattr(exc, "_grpc_status", None)
    code = getattr(grpc_status, "name", "")
    if not code:
        code = next((name for kind, name in _CLASS_CODE if isinstance(exc, kind)), "")
    return code, _GRPC_STATUS.get(code, 0)
