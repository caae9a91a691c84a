"""What one corral process holds: its settings, its database, and its provider instances.

Tasks and api handlers reach them through :func:`current`; a process sets its runtime once
at start (:func:`install`), and tests or ``corral dev`` install their own.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from sqlalchemy.exc import SQLAlchemyError

from corral.providers.base import SandboxProvider
from corral.providers.credentials import CredentialResolver
from corral.providers.registry import create_provider, default_registry
from corral.shared.broker.envelope import Limits
from corral.shared.keyring import keyring_of
from corral.shared.settings import CoreSettings
from corral.shared.store.credential_store import SqlCredentialStore
from corral.shared.store.db import Database
from corral.shared.store.provider_configs import effective_config

T = TypeVar("T")
log = logging.getLogger(__name__)


@dataclass
class Runtime:
    settings: CoreSettings
    db: Database
    _providers: dict[str, SandboxProvider] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _parts: dict[str, Any] = field(default_factory=dict)
    # When each provider's stored configuration was last read, and what it was.
    _config_checked: dict[str, tuple[float, dict[str, Any] | None]] = field(default_factory=dict)
    _pinned: set[str] = field(default_factory=set)  # handed in by use_provider: kept as is

    @classmethod
    def from_settings(cls, settings: CoreSettings | None = None) -> Runtime:
        resolved = settings or CoreSettings()
        return cls(settings=resolved, db=Database.from_settings(resolved))

    def provider(self, provider_id: str) -> SandboxProvider:
        """The process's instance of ``provider_id``, built from the deployment's
        configuration (:func:`corral.shared.store.provider_configs.effective_config`): the stored
        one is read again at most every ``provider_config_refresh_s``, and a changed one
        builds a new instance for the calls after it (sandboxes already made are reached
        through their handles, which any instance can use).

        Raises:
            UnknownProviderError, ProviderDependencyError, InvalidProviderConfigError.
        """
        with self._lock:
            instance = self._providers.get(provider_id)
            if provider_id in self._pinned:
                assert instance is not None
                return instance
            now = time.monotonic()
            checked = self._config_checked.get(provider_id)
            due = checked is None or now - checked[0] >= self.settings.provider_config_refresh_s
            if instance is not None and not due:
                return instance
            config = self._read_config(provider_id, instance)
            if instance is None or (checked is not None and config != checked[1]):
                instance = self.build_provider(provider_id, config)
                self._providers[provider_id] = instance
            self._config_checked[provider_id] = (now, config)
            return instance

    def _read_config(
        self, provider_id: str, instance: SandboxProvider | None
    ) -> dict[str, Any] | None:
        try:
            return effective_config(self.db, self.settings, provider_id).config
        except SQLAlchemyError:
            if instance is None:
                raise
            # The database is away: keep the configuration in use, read again next time.
            log.warning("stored provider configuration not readable; keeping the current one")
            checked = self._config_checked.get(provider_id)
            return checked[1] if checked else None

    def build_provider(self, provider_id: str, config: dict[str, Any] | None) -> SandboxProvider:
        """A new instance of the provider with ``config``, this process's state directory and
        credentials (the cached one is :meth:`provider`'s).

        Raises:
            UnknownProviderError, ProviderDependencyError, InvalidProviderConfigError.
        """
        instance = create_provider(provider_id, config)
        instance.use_state_dir(self.settings.state_dir)
        instance.use_egress_openings(self.settings.open_networks)
        instance.use_egress_upstream_ca(self.settings.egress_upstream_ca_file)
        instance.use_credentials(
            CredentialResolver(
                SqlCredentialStore(self.db.engine), keyring=keyring_of(self.settings)
            )
        )
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

    def built_providers(self) -> list[SandboxProvider]:
        """The provider instances this process has built or been handed, so far."""
        with self._lock:
            return list(self._providers.values())

    def use_provider(self, instance: SandboxProvider) -> None:
        """Use ``instance`` for its id (tests hand in a configured or fake provider)."""
        with self._lock:
            self._providers[instance.id] = instance
            self._pinned.add(instance.id)


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
