"""The root of corral's exceptions.

Every error corral raises derives from :class:`CorralError`. Each layer has its own base
(``corral.providers.errors.ProviderError`` for providers, and so on), and each error class carries
a stable ``code`` that is recorded against the work item it concerns. A class's docstring
is its default message, so ``raise SomeError()`` still says something useful.
"""

from __future__ import annotations

from typing import ClassVar


class CorralError(Exception):
    """corral failed."""

    code: ClassVar[str] = "error"
    retryable: ClassVar[bool] = False

    def __init__(self, message: str | None = None) -> None:
        self.message = message or (self.__doc__ or self.code).strip().splitlines()[0]
        super().__init__(self.message)

    def __str__(self) -> str:
        return self.message


class ConfigurationError(CorralError, ValueError):
    """corral's configuration is invalid."""

    code = "invalid_configuration"


class SecretKeyMismatchError(ConfigurationError):
    """a work item's sealed env values cannot be opened with this process's CORRAL_SECRET_KEY"""

    code = "secret_key_mismatch"
