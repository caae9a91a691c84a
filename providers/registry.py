"""Find a provider class by id.

Lookup order:

1. providers registered in this process with :func:`register_provider`;
2. built-in providers, imported lazily so that importing :mod:`corral.providers` loads no SDK;
3. the ``corral.providers`` entry-point group, for third-party packages.

Two entry points with the same name are an error (which one would win is undefined). An
entry point whose name is already taken by a registered or built-in provider is ignored
with a :class:`ShadowedProviderWarning`. An unknown id fails closed, listing the known ids.
"""

from __future__ import annotations

import importlib
import importlib.util
import threading
import warnings
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from importlib.metadata import EntryPoint, distributions
from typing import Any, Literal

from corral.providers.base import SandboxProvider
from corral.providers.capabilities import ProviderCapabilities, class_default_capabilities
from corral.providers.config import ProviderConfig
from corral.providers.errors import (
    InvalidProviderConfigError,
    ProviderDependencyError,
    ProviderRegistryError,
    UnknownProviderError,
)

ENTRY_POINT_GROUP = "corral.providers"

ProviderSource = Literal["registered", "builtin", "entry-point"]


class ShadowedProviderWarning(UserWarning):
    """An entry point was ignored because a registered or built-in provider has its name."""


@dataclass(frozen=True)
class BuiltinProvider:
    """Where a built-in provider lives and what it needs installed."""

    provider_id: str
    module: str
    class_name: str
    sdk_modules: tuple[str, ...] = ()
    extra: str | None = None

    def missing_sdk(self) -> list[str]:
        return [name for name in self.sdk_modules if importlib.util.find_spec(name) is None]

    def load(self) -> type[SandboxProvider]:
        """Import the provider's module and return its class.

        Raises:
            ProviderDependencyError: the SDK is not installed; names the extra to install.
        """
        missing = self.missing_sdk()
        if missing:
            raise ProviderDependencyError(
                f"provider {self.provider_id} needs the {', '.join(missing)} package, which is "
                f"not installed: pip install 'corral[{self.extra or self.provider_id}]'"
            )
        module = importlib.import_module(self.module)
        provider_class: type[SandboxProvider] = getattr(module, self.class_name)
        return provider_class


BUILTIN_PROVIDERS: Mapping[str, BuiltinProvider] = {
    "local": BuiltinProvider("local", "corral.providers.local", "LocalProvider"),
    "docker": BuiltinProvider(
        "docker",
        "corral.providers.docker",
        "DockerProvider",
        sdk_modules=("docker",),
        extra="docker",
    ),
    "kubernetes": BuiltinProvider(
        "kubernetes",
        "corral.providers.kubernetes",
        "KubernetesProvider",
        sdk_modules=("kubernetes",),
    ),
    "e2b": BuiltinProvider("e2b", "corral.providers.e2b", "E2BProvider", sdk_modules=("e2b",)),
    "daytona": BuiltinProvider(
        "daytona", "corral.providers.daytona", "DaytonaProvider", sdk_modules=("daytona",)
    ),
}


@dataclass(frozen=True)
class ProviderInfo:
    """One row of ``corral providers list``."""

    provider_id: str
    source: ProviderSource
    sdk_installed: bool
    display_name: str | None
    capabilities: ProviderCapabilities | None
    problem: str | None = None


EntryPointSource = Callable[[], Iterable[EntryPoint]]


def _installed_entry_points() -> Iterable[EntryPoint]:
    """Every entry point of the group, one per installed distribution.

    ``importlib.metadata.entry_points()`` keeps only one entry point per name, which would
    hide two packages claiming the same provider id, so distributions are walked here.
    """
    seen: set[str] = set()
    for distribution in distributions():
        name = (distribution.metadata["Name"] or "").lower().replace("_", "-")
        if name in seen:  # the same distribution found twice on sys.path
            continue
        seen.add(name)
        yield from (ep for ep in distribution.entry_points if ep.group == ENTRY_POINT_GROUP)


class ProviderRegistry:
    """Provider ids to classes. One default instance serves the process; tests make their own."""

    def __init__(
        self,
        *,
        builtins: Mapping[str, BuiltinProvider] = BUILTIN_PROVIDERS,
        entry_point_source: EntryPointSource = _installed_entry_points,
    ) -> None:
        self._builtins = dict(builtins)
        self._entry_point_source = entry_point_source
        self._registered: dict[str, type[SandboxProvider]] = {}
        self._entry_points: dict[str, EntryPoint] | None = None
        self._lock = threading.Lock()

    def register(self, provider_class: type[SandboxProvider], *, replace: bool = False) -> None:
        """Make ``provider_class`` available under its ``id``; it wins over everything else.

        Raises:
            ProviderRegistryError: the id is already registered and ``replace`` is False.
        """
        provider_id = provider_class.id
        with self._lock:
            current = self._registered.get(provider_id)
            if current is not None and current is not provider_class and not replace:
                raise ProviderRegistryError(
                    f"provider {provider_id} is already registered as {current.__qualname__}; "
                    "pass replace=True to replace it"
                )
            self._registered[provider_id] = provider_class

    def known_ids(self) -> list[str]:
        return sorted({*self._registered, *self._builtins, *self._discover()})

    def get(self, provider_id: str) -> type[SandboxProvider]:
        """The provider class for ``provider_id``.

        Raises:
            UnknownProviderError: no provider has that id; lists the known ids.
            ProviderDependencyError: the provider's SDK is not installed.
            ProviderRegistryError: two entry points claim the id.
        """
        registered = self._registered.get(provider_id)
        if registered is not None:
            return registered
        builtin = self._builtins.get(provider_id)
        if builtin is not None:
            return builtin.load()
        entry_point = self._discover().get(provider_id)
        if entry_point is not None:
            return self._load_entry_point(entry_point)
        raise UnknownProviderError(
            f"unknown provider {provider_id!r}; known providers: {', '.join(self.known_ids())}"
        )

    def create(
        self, provider_id: str, config: ProviderConfig | Mapping[str, Any] | None = None
    ) -> SandboxProvider:
        """An instance of the provider, with its configuration validated.

        Raises:
            UnknownProviderError, ProviderDependencyError: as for :meth:`get`.
            InvalidProviderConfigError: the configuration is invalid; names the bad keys.
        """
        return self.get(provider_id)(config)

    def describe(self) -> list[ProviderInfo]:
        """Every known provider, whether it can be loaded here, and what it declares."""
        rows: list[ProviderInfo] = []
        for provider_id in self.known_ids():
            source = self._source_of(provider_id)
            try:
                provider_class = self.get(provider_id)
            except ProviderDependencyError as exc:
                rows.append(ProviderInfo(provider_id, source, False, None, None, str(exc)))
                continue
            try:
                capabilities = provider_class(None).capabilities
            except InvalidProviderConfigError:
                # Needs configuration to be built; its class default still describes it.
                capabilities = class_default_capabilities(provider_id)
            rows.append(
                ProviderInfo(provider_id, source, True, provider_class.display_name, capabilities)
            )
        return rows

    def _source_of(self, provider_id: str) -> ProviderSource:
        if provider_id in self._registered:
            return "registered"
        if provider_id in self._builtins:
            return "builtin"
        return "entry-point"

    def _discover(self) -> dict[str, EntryPoint]:
        """Entry points by name, read once. Shadowed ones are warned about and dropped."""
        with self._lock:
            if self._entry_points is None:
                self._entry_points = self._read_entry_points()
            found = dict(self._entry_points)
        for name in [n for n in found if n in self._registered or n in self._builtins]:
            warnings.warn(
                f"entry point {found[name].value!r} for provider {name!r} is ignored: a "
                f"{self._source_of(name)} provider already has that id",
                ShadowedProviderWarning,
                stacklevel=3,
            )
            del found[name]
        return found

    def _read_entry_points(self) -> dict[str, EntryPoint]:
        by_name: dict[str, EntryPoint] = {}
        for entry_point in self._entry_point_source():
            other = by_name.get(entry_point.name)
            if other is not None and other.value != entry_point.value:
                raise ProviderRegistryError(
                    f"two entry points in group {ENTRY_POINT_GROUP} are named "
                    f"{entry_point.name!r} ({other.value} and {entry_point.value}); uninstall "
                    "one of the packages that provide them"
                )
            by_name[entry_point.name] = entry_point
        return by_name

    @staticmethod
    def _load_entry_point(entry_point: EntryPoint) -> type[SandboxProvider]:
        try:
            loaded = entry_point.load()
        except ImportError as exc:
            raise ProviderDependencyError(
                f"provider {entry_point.name} ({entry_point.value}) cannot be imported: {exc}; "
                "install the package that provides it with its extras"
            ) from exc
        if not (isinstance(loaded, type) and issubclass(loaded, SandboxProvider)):
            raise ProviderRegistryError(
                f"entry point {entry_point.name} ({entry_point.value}) is not a "
                "SandboxProvider subclass"
            )
        if loaded.id != entry_point.name:
            raise ProviderRegistryError(
                f"entry point {entry_point.name!r} loads a provider whose id is {loaded.id!r}; "
                "the two must match"
            )
        return loaded


default_registry = ProviderRegistry()


def register_provider(provider_class: type[SandboxProvider], *, replace: bool = False) -> None:
    """Register a provider class in the process-wide registry (it wins over built-ins)."""
    default_registry.register(provider_class, replace=replace)


def get_provider_class(provider_id: str) -> type[SandboxProvider]:
    return default_registry.get(provider_id)


def create_provider(
    provider_id: str, config: ProviderConfig | Mapping[str, Any] | None = None
) -> SandboxProvider:
    return default_registry.create(provider_id, config)
