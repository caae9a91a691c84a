"""The agentrun provider: Aliyun AgentRun's code interpreter, through the official
``agentrun-sdk``, for ``code`` work items alone (a code interpreter: no runner dials in).

For each item the provider worker calls :meth:`AgentRunProvider.run_code`: a code-interpreter
sandbox named by corral's sandbox id is made from the configured template (``POST
/sandboxes``), waited for (``GET /sandboxes/{id}/health``), given a Python context (``POST
/sandboxes/{id}/contexts``), and the wrapped program (:mod:`corral.runner.inline_code`) is
executed in it (``POST /sandboxes/{id}/contexts/execute``, with the hard timeout); then the
context and the sandbox are deleted, whatever happened. These are the SDK's data-plane calls,
signed with the AccessKey (``Agentrun-Authorization``, AGENTRUN4-HMAC-SHA256).

Errors before the execute call map as every provider's do (the status table of
:mod:`corral.providers.vendor`; connection errors transient); an error after it was sent is
:class:`~corral.providers.errors.ExecutionOutcomeUnknownError`: the code may have run, so the
attempt is not retried. A timeout of the execute call (the vendor's, or the client's at the
limit plus a grace) is a ``CodeRun`` with ``timed_out``.

Credentials: the org's stored credential (``corral credentials set --org ORG --provider
agentrun``: ``ACCESS_KEY_ID:ACCESS_KEY_SECRET``, or a JSON object with ``access_key_id``,
``access_key_secret`` and optionally ``account_id``), else ``CORRAL_AGENTRUN_API_KEY`` in the
same form, else ``AGENTRUN_ACCESS_KEY_ID`` / ``AGENTRUN_ACCESS_KEY_SECRET``. The account id
and region come from the credential or the configuration, else ``AGENTRUN_ACCOUNT_ID`` /
``AGENTRUN_REGION``. They are handed to the SDK explicitly on every call; nothing of them is
stored in a handle, label or message.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import httpx
from pydantic import SecretStr

from corral.providers.base import (
    CodeRun,
    SandboxHandle,
    SandboxSpec,
    SandboxState,
    SandboxStatus,
)
from corral.providers.configs.agentrun import AgentRunConfig
from corral.providers.credentials import credential_env_var
from corral.providers.descriptors import BUILTIN
from corral.providers.errors import (
    CredentialMissingError,
    ExecutionOutcomeUnknownError,
    InvalidProviderConfigError,
    ProviderError,
    ProviderTimeoutError,
    ProviderUnavailableError,
    SandboxCreateError,
)
from corral.providers.vendor import VendorProvider
from corral.runner import inline_code

__all__ = ["AgentRunConfig", "AgentRunProvider"]

_SDK_LOGGER = "agentrun-logger"


def _not_the_banner(record: logging.LogRecord) -> bool:
    """False for the SDK's import-time banner, which asks for DISABLE_BREAKING_CHANGES_WARNING
    in the environment (corral pins a minimum version instead)."""
    return "DISABLE_BREAKING_CHANGES_WARNING" not in str(record.msg)


@contextlib.contextmanager
def _banner_dropped() -> Iterator[None]:
    """While the SDK is imported, its banner is dropped; the process's environment, and the
    SDK's logger once imported, are left as they were."""
    logger = logging.getLogger(_SDK_LOGGER)
    logger.addFilter(_not_the_banner)
    try:
        yield
    finally:
        logger.removeFilter(_not_the_banner)


with _banner_dropped():
    from agentrun.sandbox.client import SandboxClient
    from agentrun.sandbox.code_interpreter_sandbox import CodeInterpreterSandbox
    from agentrun.utils.config import Config
    from agentrun.utils.exception import AgentRunError, HTTPError, ResourceNotExistError

log = logging.getLogger(__name__)
logging.getLogger(_SDK_LOGGER).setLevel(logging.WARNING)  # no per-call INFO noise

PROVIDER_ID = "agentrun"
TIMEOUT_EXIT_CODE = 124
_PROBE_SANDBOX = "corral-health-probe"
_ENDED = frozenset({"TERMINATED", "DELETED", "STOPPED", "FAILED", "DELETING", "STOPPING"})


@dataclass(frozen=True)
class _Credential:
    access_key_id: str
    access_key_secret: SecretStr
    account_id: str | None = None


class AgentRunProvider(VendorProvider):
    """Aliyun AgentRun code interpreter: runs ``code`` items through its execute API."""

    id = PROVIDER_ID
    display_name = BUILTIN[PROVIDER_ID].display_name
    vendor = "AgentRun"
    api_name = "the AgentRun data API"
    credential_noun = "AccessKey"
    credential_form = " (ACCESS_KEY_ID:ACCESS_KEY_SECRET)"
    credential_hint = (
        "; without either, AGENTRUN_ACCESS_KEY_ID and AGENTRUN_ACCESS_KEY_SECRET in the "
        "provider workers' environment are used"
    )
    # A configuration the probe cannot even send (no account id, a malformed credential)
    # is an unhealthy provider too.
    unhealthy_errors = (ProviderError,)
    config_model = AgentRunConfig
    config: AgentRunConfig

    # -- the code interpreter ----------------------------------------------------------------

    def run_code(
        self,
        spec: SandboxSpec,
        code: str,
        arguments: Mapping[str, Any],
        *,
        timeout_s: float,
        on_execute: Callable[[SandboxHandle], None] | None = None,
    ) -> CodeRun:
        self.parse_options(spec)
        limit = max(1, math.ceil(min(timeout_s, self.config.max_timeout_s)))
        config = self._sdk_config(
            spec.org_id, request_timeout_s=limit + self.config.execute_grace_s
        )
        marker = inline_code.new_marker()
        source = inline_code.program(code, arguments, marker=marker, env=spec.work_env())
        client = SandboxClient(config=config)
        try:
            box = self._create(client, spec.sandbox_id, config, spec.org_id)
            context = self._context(box, spec.org_id)
            if on_execute is not None:
                on_execute(self._handle(spec, spec.sandbox_id))
            return self._execute(context, source, marker, limit)
        finally:
            self._delete_quietly(client, spec.sandbox_id, config)

    def _create(
        self, client: SandboxClient, sandbox_id: str, config: Config, org_id: str
    ) -> CodeInterpreterSandbox:
        """Make the sandbox (or find the one a failed earlier attempt left) and wait until it
        reports healthy."""
        try:
            made = client.create_sandbox(
                template_name=self.config.template_name,
                sandbox_idle_timeout_seconds=self.config.idle_timeout_s,
                sandbox_id=sandbox_id,
                config=config,
            )
        except HTTPError as exc:
            if exc.status_code == 404:
                raise SandboxCreateError(
                    f"AgentRun has no template {self.config.template_name!r} ({_describe(exc)}): "
                    "create a code-interpreter template by that name, or set template_name"
                ) from exc
            if exc.status_code != 409:  # 409: made by an earlier attempt
                raise self._mapped(exc, "creating a sandbox", org_id) from exc
            made = self._call(lambda: client.get_sandbox(sandbox_id, config=config), org_id)
        box = CodeInterpreterSandbox.model_validate(made.model_dump(by_alias=False))
        box._config = config
        self._wait_ready(box, org_id)
        return box

    def _wait_ready(self, box: CodeInterpreterSandbox, org_id: str) -> None:
        deadline = time.monotonic() + self.config.ready_timeout_s
        while True:
            health = self._call(box.check_health, org_id)
            if isinstance(health, dict) and health.get("status") == "ok":
                return
            if time.monotonic() > deadline:
                raise ProviderTimeoutError(
                    f"AgentRun sandbox {box.sandbox_id} did not report healthy within "
                    f"{self.config.ready_timeout_s:g} s"
                )
            time.sleep(0.5)

    def _context(self, box: CodeInterpreterSandbox, org_id: str) -> Any:
        return self._call(lambda: box.context.create(language="python"), org_id)

    def _execute(self, context: Any, source: str, marker: str, limit: int) -> CodeRun:
        """Send the execute call: from here on, an error means the outcome is unknown."""
        started = time.monotonic()
        try:
            answer = context.execute(code=source, language="python", timeout=limit)
        except (AgentRunError, httpx.HTTPError, OSError) as exc:
            elapsed = time.monotonic() - started
            if _timed_out(exc):
                return CodeRun(
                    stdout="",
                    stderr="",
                    exit_code=TIMEOUT_EXIT_CODE,
                    duration_s=elapsed,
                    timed_out=True,
                )
            raise ExecutionOutcomeUnknownError(
                "the AgentRun execute call failed after it was sent "
                f"({_describe(exc)}); the code may have run, so it is not run again"
            ) from exc
        return _code_run(answer, marker, time.monotonic() - started)

    # -- the contract ------------------------------------------------------------------------

    def provision(self, spec: SandboxSpec) -> SandboxHandle:
        raise SandboxCreateError(
            "agentrun is a code interpreter: it runs code work items itself (run_code) and "
            "makes no sandbox for a runner; route only code items to its pools"
        )

    def status(self, handle: SandboxHandle) -> SandboxStatus:
        config = self._sdk_config(handle.org_id)
        try:
            found = SandboxClient(config=config).get_sandbox(handle.external_id, config=config)
        except ResourceNotExistError:
            return SandboxStatus(state=SandboxState.TERMINATED, reason="sandbox no longer exists")
        except AgentRunError as exc:
            raise self._mapped(exc, "reading a sandbox", handle.org_id) from exc
        status = str(found.status or "").upper()
        if status in _ENDED:
            return SandboxStatus(state=SandboxState.TERMINATED, reason=status.lower())
        return SandboxStatus(state=SandboxState.RUNNING)

    def terminate(self, handle: SandboxHandle) -> None:
        config = self._sdk_config(handle.org_id)
        try:
            SandboxClient(config=config).delete_sandbox(handle.external_id, config=config)
        except ResourceNotExistError:
            return  # gone already: done
        except AgentRunError as exc:
            raise self._mapped(exc, "deleting a sandbox", handle.org_id) from exc

    def _probe(self, key: SecretStr, org_id: str | None) -> None:
        """Reads a sandbox that does not exist: 404 means the data API answered and took the
        credential; 401/403 that it rejected it."""
        config = self._config_for(_parse_credential(key))
        try:
            SandboxClient(config=config).get_sandbox(_PROBE_SANDBOX, config=config)
        except ResourceNotExistError:
            return
        except AgentRunError as exc:
            raise self._mapped(exc, "reading a sandbox", org_id) from exc

    # -- credentials and errors --------------------------------------------------------------

    def _sdk_config(self, org_id: str | None, *, request_timeout_s: float = 30.0) -> Config:
        """The SDK's configuration for one call with the org's credential."""
        return self._config_for(self._credential(org_id), request_timeout_s=request_timeout_s)

    def _config_for(self, credential: _Credential, *, request_timeout_s: float = 30.0) -> Config:
        """The SDK's configuration for one call: everything explicit, so that nothing comes
        from ambient ALIBABA_CLOUD_* variables or an STS overlay.

        Raises:
            InvalidProviderConfigError: no account id and no data endpoint anywhere.
        """
        account = (
            credential.account_id or self.config.account_id or os.environ.get("AGENTRUN_ACCOUNT_ID")
        )
        endpoint = self.config.data_endpoint or os.environ.get("AGENTRUN_DATA_ENDPOINT")
        if not account and not endpoint:
            raise InvalidProviderConfigError(
                "agentrun needs the Aliyun account id: set account_id in the provider's "
                "configuration, AGENTRUN_ACCOUNT_ID, or account_id in the stored credential"
            )
        return Config(
            access_key_id=credential.access_key_id,
            access_key_secret=credential.access_key_secret.get_secret_value(),
            security_token="",
            account_id=account or "",
            region_id=self.config.region or os.environ.get("AGENTRUN_REGION") or "cn-hangzhou",
            timeout=math.ceil(request_timeout_s),
            data_endpoint=endpoint or "",
            control_endpoint="",
        )

    def _key(self, org_id: str | None) -> SecretStr:
        """The org's stored credential, else ``CORRAL_AGENTRUN_API_KEY``, else the
        ``AGENTRUN_ACCESS_KEY_*`` pair (as ``ID:SECRET``).

        Raises:
            CredentialMissingError: none of them is set; says how to set each.
        """
        try:
            return super()._key(org_id)
        except CredentialMissingError:
            pass
        key_id = os.environ.get("AGENTRUN_ACCESS_KEY_ID")
        key_secret = os.environ.get("AGENTRUN_ACCESS_KEY_SECRET")
        if key_id and key_secret:
            return SecretStr(f"{key_id}:{key_secret}")
        raise CredentialMissingError(_missing_message(org_id))

    def _credential(self, org_id: str | None) -> _Credential:
        """The credential :meth:`_key` finds, read.

        Raises:
            CredentialMissingError: there is none.
            InvalidProviderConfigError: it is malformed.
        """
        return _parse_credential(self._key(org_id))

    def _call(self, call: Callable[[], Any], org_id: str | None) -> Any:
        try:
            return call()
        except AgentRunError as exc:
            raise self._mapped(exc, "calling the data API", org_id) from exc

    def _mapped(self, exc: AgentRunError, doing: str, org_id: str | None) -> ProviderError:
        """The corral error for an SDK error, before any code ran: the status table's for an
        HTTP status, else a timeout or an unreachable API (transient)."""
        status = exc.status_code if isinstance(exc, HTTPError) else 0
        if status:
            return self.status_error(status, doing, org_id, "", said=_describe(exc))
        if _timed_out(exc):
            return ProviderTimeoutError(f"AgentRun did not answer in time while {doing}")
        return ProviderUnavailableError(
            f"AgentRun could not be reached while {doing} ({_describe(exc)})"
        )

    def _delete_quietly(self, client: SandboxClient, sandbox_id: str, config: Config) -> None:
        with contextlib.suppress(ResourceNotExistError):
            try:
                client.delete_sandbox(sandbox_id, config=config)
            except AgentRunError:  # the idle timeout and the reaper catch what is left
                log.warning("deleting an AgentRun sandbox failed", extra={"sandbox_id": sandbox_id})


def _code_run(answer: Any, marker: str, elapsed: float) -> CodeRun:
    """A ``CodeRun`` from the execute call's answer: its ``results`` items (``stdout``,
    ``stderr``, ``error``, ``endOfExecution``) and corral's marker line."""
    results = answer.get("results", []) if isinstance(answer, dict) else []
    stdout, stderr, status = "", "", "ok"
    for entry in results if isinstance(results, list) else []:
        kind, text = entry.get("type"), str(entry.get("text") or "")
        if kind == "stdout":
            stdout = _joined(stdout, text)
        elif kind in ("stderr", "error"):
            stderr = _joined(stderr, text or str(entry.get("traceback") or entry.get("value")))
        elif kind == "endOfExecution":
            status = str(entry.get("status") or "ok")
    if status == "timeout":
        return CodeRun(
            stdout=inline_code.split_output(stdout, marker).stdout,
            stderr=stderr,
            exit_code=TIMEOUT_EXIT_CODE,
            duration_s=elapsed,
            timed_out=True,
        )
    outcome = inline_code.split_output(stdout, marker)
    return CodeRun(
        stdout=outcome.stdout,
        stderr=stderr,
        exit_code=0 if outcome.ok else 1,
        duration_s=elapsed,
        result=outcome.result,
        error=outcome.error,
    )


def _joined(text: str, chunk: str) -> str:
    if text and not text.endswith("\n"):
        text += "\n"
    return text + chunk


def _timed_out(exc: BaseException) -> bool:
    if isinstance(exc, httpx.TimeoutException | TimeoutError):
        return True
    cause = exc.__cause__
    if cause is not None and _timed_out(cause):
        return True
    if isinstance(exc, HTTPError):
        words = f"{exc.error_code or ''} {exc.message or ''}".lower()
        return "timeout" in words or "timed out" in words
    return False


def _describe(exc: BaseException) -> str:
    """The vendor's words, without the request (which carries the code and its env)."""
    if isinstance(exc, HTTPError):
        code = f" {exc.error_code}" if exc.error_code else ""
        return f"HTTP {exc.status_code}{code}: {exc.message}"[:500]
    return type(exc).__name__


def _parse_credential(secret: SecretStr) -> _Credential:
    """``ID:SECRET``, or ``{"access_key_id", "access_key_secret", "account_id"?}``."""
    raw = secret.get_secret_value().strip()
    if raw.startswith("{"):
        try:
            fields = json.loads(raw)
        except ValueError:
            fields = None
        if (
            isinstance(fields, dict)
            and fields.get("access_key_id")
            and fields.get("access_key_secret")
        ):
            account = fields.get("account_id")
            return _Credential(
                str(fields["access_key_id"]),
                SecretStr(str(fields["access_key_secret"])),
                str(account) if account else None,
            )
    else:
        key_id, sep, key_secret = raw.partition(":")
        if sep and key_id and key_secret:
            return _Credential(key_id, SecretStr(key_secret))
    raise InvalidProviderConfigError(
        "the agentrun credential must be ACCESS_KEY_ID:ACCESS_KEY_SECRET or a JSON object "
        "with access_key_id and access_key_secret (and optionally account_id)"
    )


def _how_to_set(org_id: str | None) -> str:
    org = org_id or "ORG"
    return (
        f"store a working AccessKey with `corral credentials set --org {org} --provider "
        f"agentrun`, or set {credential_env_var(PROVIDER_ID)} (ACCESS_KEY_ID:ACCESS_KEY_SECRET) "
        "or AGENTRUN_ACCESS_KEY_ID and AGENTRUN_ACCESS_KEY_SECRET in the provider workers' "
        "environment"
    )


def _missing_message(org_id: str | None) -> str:
    whose = f" for org {org_id!r}" if org_id else ""
    return f"no agentrun credential{whose}: {_how_to_set(org_id)}"
