"""Errors raised by providers and the provider registry.

Two families matter to callers: :class:`TransientProviderError` (try again later, with
backoff) and :class:`PermanentProviderError` (retrying cannot help; fail the work item
with this message). Every message says what was wrong and what to do about it, and never
contains a token or credential.
"""

from __future__ import annotations

from corral.shared.errors import CorralError


class ProviderError(CorralError):
    """The sandbox provider failed."""

    code = "provider_error"


class TransientProviderError(ProviderError):
    """The sandbox provider failed in a way that may pass; retry later."""

    code = "provider_transient"
    retryable = True


class PermanentProviderError(ProviderError):
    """The sandbox provider failed in a way that retrying cannot fix."""

    code = "provider_permanent"


class SandboxCreateError(PermanentProviderError):
    """The provider could not create the sandbox."""

    code = "create_failed"


class SandboxVerificationError(PermanentProviderError):
    """The sandbox was created but did not become ready."""

    code = "readiness_failed"


class CredentialMissingError(PermanentProviderError):
    """No credential is configured for this provider."""

    code = "credential_missing"


class CredentialRejectedError(PermanentProviderError):
    """The provider refused the credential (401/403); the message names which one to fix."""

    code = "credential_rejected"


class CapacityExhaustedError(TransientProviderError):
    """The provider has no free capacity right now."""

    code = "capacity_exhausted"


class RateLimitedError(CapacityExhaustedError):
    """The provider refused for its rate limit or quota (an HTTP 429): a paced provider's
    item waits for its pace (the pace slows) instead of counting a retry."""

    code = "rate_limited"


class ProviderUnavailableError(TransientProviderError):
    """The provider cannot be reached right now."""

    code = "provider_unavailable"


class ProviderTimeoutError(TransientProviderError, TimeoutError):
    """The provider did not answer in time."""

    code = "provider_timeout"


class InvalidProviderConfigError(PermanentProviderError, ValueError):
    """A provider's configuration or options are invalid."""

    code = "invalid_config"


class InvalidCapabilityOverrideError(InvalidProviderConfigError):
    """A pool's runtime_provides override is malformed."""

    code = "invalid_capability_override"


class UnknownProviderError(PermanentProviderError, LookupError):
    """No provider is known by that id."""

    code = "unknown_provider"


class ProviderDependencyError(PermanentProviderError, ImportError):
    """The provider's SDK is not installed."""

    code = "provider_sdk_missing"


class ProviderRegistryError(ProviderError):
    """The provider registry is inconsistent (for example two entry points share a name)."""

    code = "provider_registry_conflict"


class SandboxPathError(PermanentProviderError, ValueError):
    """A file path points outside the sandbox's work directory."""

    code = "path_outside_sandbox"


class SandboxFileNotFoundError(PermanentProviderError, FileNotFoundError):
    """There is no such file in the sandbox."""

    code = "file_not_found"


class ExecutionOutcomeUnknownError(PermanentProviderError):
    """A code interpreter's execute call failed after it was sent: the code may have run,
    so the attempt must not be retried (a work item never runs twice)."""

    code = "execution_outcome_unknown"


class SandboxNotRunningError(PermanentProviderError):
    """The operation needs a running sandbox, and this one is not running."""

    code = "sandbox_not_running"


class FileTooLargeError(PermanentProviderError):
    """The file is larger than the caller's limit; nothing past the limit was kept."""

    code = "file_too_large"

    def __init__(self, source: str, max_bytes: int) -> None:
        super().__init__(f"{source!r} is larger than the limit of {max_bytes} bytes")
        self.max_bytes = max_bytes
