"""The e2b provider: one E2B cloud sandbox per corral sandbox, through the official ``e2b`` SDK.

A sandbox is made from a template with the spec's environment (the registration token and
control URL included) in ``envs``, corral's labels in ``metadata`` and the work's timeout;
without network (``allow_network=false``) its egress is denied but to the control plane;
the runner is then started in the background inside it, and dials out to the control URL.
Statuses come from the sandbox info (``running``, ``paused``; gone means ended), terminate is
kill (not found counts as done), pause and resume map to E2B's, exec runs through the SDK's
commands, and ``list_managed`` queries by metadata.

The API key is the org's stored credential, else ``CORRAL_E2B_API_KEY``
(:func:`corral.providers.credentials.resolve_credential`); it is passed per call, never stored in
the sandbox. The inventory, which has no org, uses ``CORRAL_E2B_API_KEY``.
"""

from __future__ import annotations

import contextlib
import logging
import shlex
import time
from collections.abc import Iterator, Mapping, Sequence
from datetime import UTC
from typing import Any
from urllib.parse import urlsplit

import httpx
from e2b import (
    AuthenticationException,
    CommandExitException,
    NotFoundException,
    RateLimitException,
    Sandbox,
    SandboxException,
    SandboxQuery,
    ServiceBusyException,
    TimeoutException,
)
from pydantic import SecretStr

from corral.providers.base import (
    DEFAULT_EXEC_OUTPUT_MAX_BYTES,
    ExecResult,
    ManagedSandbox,
    SandboxHandle,
    SandboxSpec,
    SandboxState,
    SandboxStatus,
)
from corral.providers.configs.e2b import E2BProviderConfig, E2BProviderOptions
from corral.providers.descriptors import BUILTIN
from corral.providers.egress.rules import vendor_allow_list
from corral.providers.errors import (
    InvalidProviderConfigError,
    ProviderTimeoutError,
    ProviderUnavailableError,
    SandboxCreateError,
    SandboxNotRunningError,
)
from corral.providers.size_limits import ExecOutput
from corral.providers.vendor import VendorProvider

__all__ = ["E2BProvider", "E2BProviderConfig", "E2BProviderOptions"]

log = logging.getLogger(__name__)

PROVIDER_ID = "e2b"
DEPLOYMENT_LABEL = "corral.deployment"
_PAGE = 100


class E2BProvider(VendorProvider):
    """E2B cloud sandboxes (dial-out runners, pause/resume, metadata inventory)."""

    id = PROVIDER_ID
    display_name = BUILTIN["e2b"].display_name
    vendor = "E2B"
    api_name = "the E2B API"
    config_model = E2BProviderConfig
    options_model = E2BProviderOptions
    config: E2BProviderConfig

    # -- contract ------------------------------------------------------------------------

    def provision(self, spec: SandboxSpec) -> SandboxHandle:
        options = self.parse_options(spec)
        assert isinstance(options, E2BProviderOptions)
        api_key = self._api_key(spec.org_id)
        existing = self._find(spec.sandbox_id, api_key)
        if existing is not None:  # a second delivery of the same provision
            return self._handle(spec, existing)
        template = options.template or self.config.template
        labels = {**spec.managed_labels(), DEPLOYMENT_LABEL: self.config.deployment}
        extra: dict[str, Any] = {}
        if not spec.egress.allow_network or spec.egress.restricted:
            extra["network"] = _control_plane_only(spec.control_url, spec.egress.allowed_hosts)
        if self.config.pace() is not None:
            # corral paces the creates and waits out a 429 itself (the pace slows): the SDK's
            # own quick retries of one would only add to what the vendor refuses.
            extra["retries"] = 0
        action = f"creating a sandbox from template {template!r}"
        with self._sdk_errors(action, spec.org_id, creating=True):
            sandbox = Sandbox.create(
                template=template,
                timeout=spec.resources.timeout_s or self.config.default_timeout_s,
                metadata=labels,
                envs=spec.sandbox_env(),
                **extra,
                **self._opts(api_key),
            )
        try:
            with self._sdk_errors("starting the runner", spec.org_id):
                sandbox.commands.run(self.config.runner_command, background=True)
        except Exception:
            self._kill(sandbox.sandbox_id, api_key)  # nothing half-made stays behind
            raise
        return self._handle(spec, sandbox.sandbox_id)

    def status(self, handle: SandboxHandle) -> SandboxStatus:
        api_key = self._api_key(handle.org_id)
        try:
            with self._sdk_errors("reading a sandbox", handle.org_id):
                info = Sandbox.get_info(handle.external_id, **self._opts(api_key))
        except SandboxNotRunningError:
            return SandboxStatus(state=SandboxState.TERMINATED, reason="sandbox no longer exists")
        if str(info.state) == "paused":
            return SandboxStatus(state=SandboxState.READY, reason="paused")
        return SandboxStatus(state=SandboxState.RUNNING)

    def terminate(self, handle: SandboxHandle) -> None:
        self._kill(handle.external_id, self._api_key(handle.org_id))

    def _probe(self, key: SecretStr, org_id: str | None) -> None:
        with self._sdk_errors("listing sandboxes", None):
            Sandbox.list(limit=1, **self._opts(key)).next_items()

    # -- optional abilities ---------------------------------------------------------------

    def pause(self, handle: SandboxHandle) -> None:
        with self._sdk_errors("pausing a sandbox", handle.org_id):
            Sandbox.pause(handle.external_id, **self._opts(self._api_key(handle.org_id)))

    def resume(self, handle: SandboxHandle) -> None:
        with self._sdk_errors("resuming a sandbox", handle.org_id):
            Sandbox.connect(handle.external_id, **self._opts(self._api_key(handle.org_id)))

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
        if self.status(handle).state is not SandboxState.RUNNING:
            raise SandboxNotRunningError(f"sandbox {handle.external_id} is not running")
        line = command if isinstance(command, str) else shlex.join(command)
        opts = self._opts(self._api_key(handle.org_id))
        output = ExecOutput(max_output_bytes)
        started = time.monotonic()
        with self._sdk_errors("running a command", handle.org_id):
            sandbox = Sandbox.connect(handle.external_id, **opts)
            try:
                # Output goes to the bounded buffers as it streams in; the SDK keeps none.
                result: Any = sandbox.commands.run(
                    line,
                    envs=dict(env or {}),
                    cwd=cwd,
                    timeout=timeout_s or 0,
                    on_stdout=output.stdout.add,
                    on_stderr=output.stderr.add,
                    retain_output=False,
                )
            except CommandExitException as exited:
                result = exited  # a non-zero exit is an answer, not an error
        return output.result(exit_code=result.exit_code, duration_s=time.monotonic() - started)

    def list_managed(self) -> list[ManagedSandbox]:
        key = self._inventory_key()
        query = SandboxQuery(
            metadata={"corral.managed": "true", DEPLOYMENT_LABEL: self.config.deployment}
        )
        managed = []
        with self._sdk_errors("listing sandboxes", None):
            pages = Sandbox.list(query=query, limit=_PAGE, **self._opts(key))
            while pages.has_next:
                managed += [self._managed(info) for info in pages.next_items()]
        return managed

    def _managed(self, info: Any) -> ManagedSandbox:
        labels = {str(k): str(v) for k, v in (info.metadata or {}).items()}
        sandbox_id = labels.get("corral.sandbox-id", "")
        org_id = labels.get("corral.org-id", "unknown")
        handle = SandboxHandle(
            provider_id=self.id,
            external_id=info.sandbox_id,
            metadata={"org_id": org_id, "sandbox_id": sandbox_id},
        )
        paused = str(info.state) == "paused"
        return ManagedSandbox(
            handle=handle,
            sandbox_id=sandbox_id,
            labels=labels,
            started_at=info.started_at.astimezone(UTC) if info.started_at else None,
            state=SandboxState.READY if paused else SandboxState.RUNNING,
        )

    # -- internals -----------------------------------------------------------------------

    def _opts(self, api_key: SecretStr) -> dict[str, Any]:
        opts: dict[str, Any] = {
            "api_key": api_key.get_secret_value(),
            "request_timeout": self.config.request_timeout_s,
            "debug": False,
        }
        for name in ("domain", "api_url", "sandbox_url"):
            value = getattr(self.config, name)
            if value:
                opts[name] = value
        return opts

    def _find(self, sandbox_id: str, api_key: SecretStr) -> str | None:
        query = SandboxQuery(
            metadata={"corral.sandbox-id": sandbox_id, DEPLOYMENT_LABEL: self.config.deployment}
        )
        with self._sdk_errors("looking a sandbox up", None):
            found = Sandbox.list(query=query, limit=1, **self._opts(api_key)).next_items()
        return found[0].sandbox_id if found else None

    def _kill(self, external_id: str, api_key: SecretStr) -> None:
        with self._sdk_errors("killing a sandbox", None):
            Sandbox.kill(external_id, **self._opts(api_key))  # False: already gone, done

    @contextlib.contextmanager
    def _sdk_errors(
        self, action: str, org_id: str | None, *, creating: bool = False
    ) -> Iterator[None]:
        """The SDK's exceptions as corral's provider errors, with what to do about them."""
        try:
            yield
        except TimeoutException as exc:  # no answer in time (not an HTTP status)
            raise ProviderTimeoutError(f"E2B timed out while {action}: {exc}") from exc
        except (AuthenticationException, ServiceBusyException, SandboxException) as exc:
            status = _status_of(exc)
            if not status:
                raise SandboxCreateError(f"E2B refused {action} (no status): {exc}") from exc
            raise self.status_error(status, action, org_id, str(exc), creating=creating) from exc
        except httpx.TimeoutException as exc:
            raise ProviderTimeoutError(f"E2B did not answer in time while {action}") from exc
        except httpx.TransportError as exc:
            raise ProviderUnavailableError(
                f"E2B could not be reached while {action}: {exc}"
            ) from exc


def _control_plane_only(control_url: str, allowed_hosts: tuple[str, ...]) -> dict[str, list[str]]:
    """E2B egress rules for a sandbox without network or with allowed hosts: all outbound
    traffic denied but to the control plane, which the runner must reach, and the allowed
    hosts (names and networks; E2B has no ports).

    Raises:
        InvalidProviderConfigError: no http(s) control URL, or an allowed host with a port.
    """
    host = urlsplit(control_url).hostname
    if not host or not control_url.startswith(("http://", "https://")):
        raise InvalidProviderConfigError(
            "a sandbox without network on E2B needs an http(s) CORRAL_CONTROL_URL that E2B "
            "can reach (the runner dials out to it)"
        )
    names, networks = vendor_allow_list(allowed_hosts, "E2B")
    return {"deny_out": ["0.0.0.0/0"], "allow_out": [host, *names, *networks]}


# Connect (envd) error codes by the HTTP status they stand for.
_CONNECT_STATUS = {
    "UNAUTHENTICATED": 401,
    "PERMISSION_DENIED": 403,
    "RESOURCE_EXHAUSTED": 429,
    "INTERNAL": 500,
    "UNKNOWN": 500,
    "UNAVAILABLE": 503,
    "DEADLINE_EXCEEDED": 504,
}


def _connect_status(exc: BaseException) -> int:
    """The status a sandbox's envd meant, from the Connect error behind an SDK exception."""
    code = getattr(exc.__cause__ or exc.__context__, "code", None)
    return _CONNECT_STATUS.get(getattr(code, "name", ""), 0)


def _status_of(exc: BaseException) -> int:
    """The HTTP status an SDK exception stands for (0: none): the one it carries, else its
    class's, else the one a sandbox's envd meant by its Connect error."""
    carried = getattr(exc, "status_code", None)
    if carried:
        return int(carried)
    for kind, status in _CLASS_STATUS:
        if isinstance(exc, kind):
            return status
    return _connect_status(exc)


# The SDK's exceptions that carry no status of their own, by the status they stand for.
_CLASS_STATUS: tuple[tuple[type[BaseException], int], ...] = (
    (AuthenticationException, 401),
    (NotFoundException, 404),
    (RateLimitException, 429),
    (ServiceBusyException, 503),
)
