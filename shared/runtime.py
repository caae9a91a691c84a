"""What one corral process holds: its settings, its database, and its provider instances.

Tasks and api handlers reach them through :func:`current`; a process sets its runtime once
at start (:func:`install`), and tests or ``corral dev`` install their own.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from corral.providers.base import SandboxProvider
from corral.providers.credentials import CredentialResolver
from corral.providers.registry import create_provider, default_registry
from corral.shared.credential_store import SqlCredentialStore
from corral.shared.db import Database
from corral.shared.envelope import Limits
from corral.shared.settings import CoreSettings

T = TypeVar("T")


@dataclass
class Runtime:
    settings: CoreSettings
    db: Database
    _providers: dict[str, SandboxProvider] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _parts: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_settings(cls, settings: CoreSettings | None = None) -> Runtime:
        resolved = settings or CoreSettings()
        return cls(settings=resolved, db=Database.from_settings(resolved))

    def provider(self, provider_id: str) -> SandboxProvider:
        """The process's instance of ``provider_id``, built once from its configuration.

        Raises:
            UnknownProviderError, ProviderDependencyError, InvalidProviderConfigError.
        """
        with self._lock:
            instance = self._providers.get(provider_id)
            if instance is None:
                config = self.settings.provider_config.get(provider_id)
                instance = create_provider(provider_id, config)
                instance.use_state_dir(self.settings.state_dir)
                instance.use_credentials(
                    CredentialResolver(
                        SqlCredentialStore(self.db.engine), secret_key=self.settings.secret_key
                    )
                )
                self._providers[provider_id] = instance
            return instance

    def knows_provider(self, provider_id: str) -> bool:
        """Whether this process has (or can build) a provider of that id."""
        with self._lock:
            if provider_id in self._providers:
                return True
        return default_registry.is_known(provider_id)

    def part(self, name: str, build: Callable[[Runtime], T]) -> T:
        """The process's one ``name`` object (e.g. the provision path's batches), built by
        ``build`` on first use; it lives as long as this runtime."""
        with self._lock:
            if name not in self._parts:
                self._parts[name] = build(self)
            found: T = self._parts[name]
            return found

    def use_provider(self, instance: SandboxProvider) -> None:
        """Use ``instance`` for its id (tests hand in a configured or fake provider)."""
        with self._lock:
            self._providers[instance.id] = instance


_current: Runtime | None = None
_current_lock = threading.Lock()


def install(runtime: Runtime) -> Runtime:
    global _current  # noqa: PLW0603 - one runtime per process, set at start
    with _current_lock:
        _current = runtime
    return runtime


def reset() -> None:
    """Forget the installed runtime (tests that install their own clean up with this)."""
    global _current  # noqa: PLW0603
    with _current_lock:
        _current = None


def message_limits() -> Limits:
    """What reading one broker message may cost in this process (``CORRAL_MAX_MESSAGE_*``)."""
    return current().settings.message_limits()


def current() -> Runtime:
    """The process's runtime, built from the environment on first use."""
    global _current  # noqa: PLW0603
    with _current_lock:
        if _current is None:
            _current = Runtime.from_settings()
        return _current
