"""Sandbox providers: the contract, capabilities, registry and the built-in providers.

Importing this package imports no provider SDK; a provider's module (and its SDK) is loaded
only when that provider is chosen. The names below load with their modules when one is first
used, not with the package: a module of it alone (the settings read :mod:`.config` and
:mod:`.egress.rules`) then costs only itself, which `corral dispatch` notices as it starts.
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from corral.providers.base import (
        Capacity,
        Egress,
        ExecResult,
        ManagedSandbox,
        ProviderHealth,
        Resources,
        SandboxHandle,
        SandboxProvider,
        SandboxSpec,
        SandboxState,
        SandboxStatus,
        SandboxUsage,
        SupportsCapacityQuery,
        SupportsEndLog,
        SupportsExec,
        SupportsFiles,
        SupportsInventory,
        SupportsLogs,
        SupportsPauseResume,
        SupportsUsage,
        ToolchainDemand,
    )
    from corral.providers.capabilities import ProviderCapabilities, Substrate, derive_capabilities
    from corral.providers.registry import create_provider, get_provider_class, register_provider

__all__ = [
    "Capacity",
    "Egress",
    "ExecResult",
    "ManagedSandbox",
    "ProviderCapabilities",
    "ProviderHealth",
    "Resources",
    "SandboxHandle",
    "SandboxProvider",
    "SandboxSpec",
    "SandboxState",
    "SandboxStatus",
    "SandboxUsage",
    "Substrate",
    "SupportsCapacityQuery",
    "SupportsEndLog",
    "SupportsExec",
    "SupportsFiles",
    "SupportsInventory",
    "SupportsLogs",
    "SupportsPauseResume",
    "SupportsUsage",
    "ToolchainDemand",
    "create_provider",
    "derive_capabilities",
    "get_provider_class",
    "register_provider",
]

_HOLDERS = ("base", "capabilities", "registry")  # the modules the names above come from


def __getattr__(name: str) -> Any:
    """A name of :data:`__all__`, from its module (imported now, the first time)."""
    if name in __all__:
        for holder in _HOLDERS:
            found = vars(import_module(f"{__name__}.{holder}"))
            if name in found:
                return found[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
