"""The runner's exceptions, rooted in :class:`RunnerError`.

The runner is standard library only, so it cannot derive from ``corral.shared.errors``; it
follows the same habits instead: one root, the docstring as the default message.
"""

from __future__ import annotations


class RunnerError(Exception):
    """The runner failed."""

    def __init__(self, message: str | None = None) -> None:
        self.message = message or (self.__doc__ or "runner error").strip().splitlines()[0]
        super().__init__(self.message)

    def __str__(self) -> str:
        return self.message


class ConfigurationError(RunnerError, ValueError):
    """The runner's environment is incomplete or invalid."""


class ControlError(RunnerError):
    """The control plane could not be reached or answered with an error."""

    def __init__(
        self,
        message: str | None = None,
        *,
        status: int | None = None,
        retry_after_s: float | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.retry_after_s = retry_after_s  # the answer's Retry-After, when it had one

    @property
    def retryable(self) -> bool:
        """Unreachable or failing (5xx) may pass; a 4xx answer will not change on retry."""
        return self.status is None or self.status >= 500


class ThrottledError(ControlError):
    """The control plane answered 429: too many calls; wait ``retry_after_s`` and try again."""


class UnauthorizedError(ControlError):
    """The control plane refused the token (401): invalid, used, expired or revoked."""


class ConflictError(ControlError):
    """The control plane answered 409: another runner already holds this work item."""


class ProtocolError(RunnerError, ValueError):
    """The control plane sent a body the runner does not understand."""
