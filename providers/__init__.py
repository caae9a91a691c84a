"""Sandbox providers: the contract, capabilities, registry and the built-in providers.

Importing this package imports no provider SDK; a provider's module (and its SDK) is loaded
only when that provider is chosen.
"""

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
