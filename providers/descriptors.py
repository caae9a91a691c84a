"""One descriptor per provider: everything corral knows of it without importing it.

A descriptor names a provider (id, display name), says what it can do (its capability
matrix, with the default substrate), what to install for it (the SDK modules and the
package extra) and where its class is (a lazy factory). Routing, billing, the session
limit, queue declaration, pool validation, ``corral providers list`` and the admin api all
read descriptors, through :mod:`corral.providers.registry`; importing this module loads no
SDK. A provider whose SDK is optional names an SDK-free module holding its config and options
models (``models``), so that its schema renders where the SDK is not installed; the others'
models are the class's, loaded with it.

Built-in providers are described here. A provider registered in the process or installed
through the ``corral.providers`` entry-point group is described by its class
(:meth:`ProviderDescriptor.of_class`): its ``default_capabilities``, else nothing optional.
"""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from corral.providers.capabilities import (
    CLOUD_RUNTIMES,
    EVERYWHERE,
    SELF_HOSTED_REQUIREMENTS,
    SELF_HOSTED_RUNTIMES,
    UNDECLARED,
    ProviderCapabilities,
    Substrate,
    matrix,
)
from corral.providers.config import ProviderConfig, ProviderOptions
from corral.providers.errors import ProviderDependencyError

if TYPE_CHECKING:  # the base imports this module for its capabilities
    from corral.providers.base import SandboxProvider


@dataclass(frozen=True)
class ModelsAt:
    """Where a provider's config and options models are, in a module that needs no SDK."""

    module: str
    config: str
    options: str | None = None  # None: the provider takes no per-sandbox options


@dataclass(frozen=True)
class ProviderDescriptor:
    """A provider: its names, its matrix, what it needs installed and where its class is."""

    id: str
    display_name: str
    capabilities: ProviderCapabilities  # the class default; a pool may narrow or override
    module: str  # the lazy factory: ``module:class_name`` builds the provider
    class_name: str
    sdk_modules: tuple[str, ...] = ()
    extra: str | None = None  # ``pip install 'corral[<extra>]'`` brings the SDK
    # The SDK-free module with the config and options models, and their class names.
    models: ModelsAt | None = None

    @property
    def substrate(self) -> Substrate:
        """The agent-card kinds a pool of this provider offers unless it says otherwise."""
        return self.capabilities.substrate

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
                f"provider {self.id} needs the {', '.join(missing)} package, which is not "
                f"installed: pip install 'corral[{self.extra or self.id}]'"
            )
        module = importlib.import_module(self.module)
        provider_class: type[SandboxProvider] = getattr(module, self.class_name)
        return provider_class

    @property
    def config_model(self) -> type[ProviderConfig]:
        """The provider's configuration model: from its models module when it names one
        (no SDK needed), else from its class (which imports the provider and its SDK).

        Raises:
            ProviderDependencyError: the class is needed and its SDK is not installed.
        """
        if self.models is None:
            return self.load().config_model
        config: type[ProviderConfig] = getattr(
            importlib.import_module(self.models.module), self.models.config
        )
        return config

    @property
    def options_model(self) -> type[ProviderOptions]:
        """The model of its per-sandbox options, found as :attr:`config_model` is.

        Raises:
            ProviderDependencyError: the class is needed and its SDK is not installed.
        """
        if self.models is None:
            return self.load().options_model
        if self.models.options is None:
            return ProviderOptions
        options: type[ProviderOptions] = getattr(
            importlib.import_module(self.models.module), self.models.options
        )
        return options

    @classmethod
    def of_class(cls, provider_class: type[SandboxProvider]) -> ProviderDescriptor:
        """The descriptor of a provider that is not built in: what its class declares."""
        return cls(
            id=provider_class.id,
            display_name=provider_class.display_name,
            capabilities=provider_class.default_capabilities or UNDECLARED,
            module=provider_class.__module__,
            class_name=provider_class.__qualname__,
        )


# AgentRun's code interpreter: its execute call's hard timeout, and the regions it is
# offered in.
AGENTRUN_HARD_TIMEOUT_S = 30
AGENTRUN_REGIONS = ("cn-hangzhou", "cn-beijing", "cn-shanghai", "cn-shenzhen", "cn-guangzhou")

# The built-in providers, with their columns of the reference capability matrix.
# `gpu` is never a class default: only an operator's override declares it.
BUILTIN: Mapping[str, ProviderDescriptor] = {
    descriptor.id: descriptor
    for descriptor in (
        ProviderDescriptor(
            id="local",
            display_name="Local processes",
            capabilities=matrix(
                supports_exec_files=True,  # exec_command, upload_file, download_file
                transport_model="either",
                enforces_allowed_hosts=True,  # corral's egress proxy, no network of its own
                enforces_secret_bindings=True,
                supports_capacity_query=True,
                idle_cost_model="zero",
                billing_model="fixed",
                substrate=Substrate(
                    runtime_kinds=SELF_HOSTED_RUNTIMES | {"host-binary"},
                    requirement_kinds=SELF_HOSTED_REQUIREMENTS | {"host-binary"},
                ),
            ),
            module="corral.providers.local.provider",
            class_name="LocalProvider",
        ),
        ProviderDescriptor(
            id="docker",
            display_name="Docker Engine",
            capabilities=matrix(
                supports_exec_files=True,  # exec_command, upload_file, download_file
                transport_model="either",
                enforces_allowed_hosts=True,  # corral's egress proxy, network mode none
                enforces_secret_bindings=True,
                supports_capacity_query=True,
                supports_item_image=True,
                idle_cost_model="zero",
                billing_model="fixed",
                substrate=Substrate(
                    runtime_kinds=SELF_HOSTED_RUNTIMES, requirement_kinds=SELF_HOSTED_REQUIREMENTS
                ),
            ),
            module="corral.providers.docker.provider",
            class_name="DockerProvider",
            sdk_modules=("docker",),
            extra="docker",
            models=ModelsAt(
                "corral.providers.configs.docker", "DockerProviderConfig", "DockerProviderOptions"
            ),
        ),
        ProviderDescriptor(
            id="kubernetes",
            display_name="Kubernetes",
            capabilities=matrix(
                enforces_allowed_hosts=True,  # a NetworkPolicy to their addresses
                transport_model="either",
                supports_capacity_query=True,
                supports_item_image=True,
                idle_cost_model="metered",
                billing_model="fixed",
                substrate=Substrate(
                    runtime_kinds=SELF_HOSTED_RUNTIMES, requirement_kinds=SELF_HOSTED_REQUIREMENTS
                ),
            ),
            module="corral.providers.kubernetes.provider",
            class_name="KubernetesProvider",
            sdk_modules=("kubernetes",),
            extra="kubernetes",
            models=ModelsAt(
                "corral.providers.kubernetes.objects",
                "KubernetesProviderConfig",
                "KubernetesProviderOptions",
            ),
        ),
        ProviderDescriptor(
            id="e2b",
            display_name="E2B",
            capabilities=matrix(
                enforces_allowed_hosts=True,  # allow_out/deny_out, no ports
                transport_model="dial-in",
                # CPU and memory are the template's, fixed when it is built: not per sandbox.
                sized_resources=(),
                supports_fs_snapshot=True,
                supports_pause_resume=True,
                idle_cost_model="zero",
                billing_model="wall-clock",
                substrate=Substrate(
                    runtime_kinds=CLOUD_RUNTIMES, requirement_kinds=EVERYWHERE | {"long-running"}
                ),
            ),
            module="corral.providers.e2b",
            class_name="E2BProvider",
            sdk_modules=("e2b",),
            extra="e2b",
            models=ModelsAt(
                "corral.providers.configs.e2b", "E2BProviderConfig", "E2BProviderOptions"
            ),
        ),
        ProviderDescriptor(
            id="daytona",
            display_name="Daytona",
            capabilities=matrix(
                supports_exec_files=True,  # exec_command, upload_file, download_file
                transport_model="dial-in",
                supports_fs_snapshot=True,
                idle_cost_model="storage-only",
                billing_model="wall-clock",
                substrate=Substrate(runtime_kinds=CLOUD_RUNTIMES, requirement_kinds=EVERYWHERE),
            ),
            module="corral.providers.daytona.provider",
            class_name="DaytonaProvider",
            sdk_modules=("daytona",),
            extra="daytona",
            models=ModelsAt(
                "corral.providers.configs.daytona",
                "DaytonaProviderConfig",
                "DaytonaProviderOptions",
            ),
        ),
        ProviderDescriptor(
            id="modal",
            display_name="Modal",
            capabilities=matrix(
                transport_model="dial-in",
                supports_fs_snapshot=True,
                supports_gpu=True,  # the matrix's GPU column: `requires gpu` routes here
                idle_cost_model="metered",
                billing_model="wall-clock",
                substrate=Substrate(runtime_kinds=CLOUD_RUNTIMES, requirement_kinds=EVERYWHERE),
            ),
            module="corral.providers.modal",
            class_name="ModalProvider",
            sdk_modules=("modal",),
            extra="modal",
            models=ModelsAt(
                "corral.providers.configs.modal", "ModalProviderConfig", "ModalProviderOptions"
            ),
        ),
        ProviderDescriptor(
            id="vercel",
            display_name="Vercel Sandbox",
            capabilities=matrix(
                supports_exec_files=True,  # exec_command, upload_file, download_file
                enforces_allowed_hosts=True,  # its network policy, no ports
                transport_model="dial-in",
                supports_fs_snapshot=True,
                idle_cost_model="metered",
                billing_model="active-cpu",
                max_session_duration_seconds=18_000,
                substrate=Substrate(
                    runtime_kinds=(CLOUD_RUNTIMES - {"langchain-runnable"}) | {"npm"},
                    requirement_kinds=EVERYWHERE | {"toolchain:node"},
                ),
            ),
            module="corral.providers.vercel",
            class_name="VercelProvider",
            sdk_modules=("vercel.sandbox",),
            extra="vercel",
            models=ModelsAt(
                "corral.providers.configs.vercel", "VercelProviderConfig", "VercelProviderOptions"
            ),
        ),
        ProviderDescriptor(
            id="agentrun",
            display_name="Aliyun AgentRun code interpreter",
            capabilities=matrix(
                # No runner: the provider worker calls the execute-code API (code items only).
                transport_model="dial-out",
                max_session_duration_seconds=AGENTRUN_HARD_TIMEOUT_S,
                regions=AGENTRUN_REGIONS,
                idle_cost_model="zero",
                billing_model="wall-clock",
                work_kinds=("code",),
                # AgentRun's API executes javascript too, but corral's inline program
                # (runner/inline_code.py) is Python: javascript code is not routed here.
                code_languages=("python",),
                sized_resources=(),  # the code interpreter template's size
                substrate=Substrate(runtime_kinds=frozenset({"python-pip"})),
            ),
            module="corral.providers.agentrun",
            class_name="AgentRunProvider",
            sdk_modules=("agentrun",),
            extra="agentrun",
            models=ModelsAt("corral.providers.configs.agentrun", "AgentRunConfig", None),
        ),
    )
}


def declared_capabilities(provider_class: type[SandboxProvider]) -> ProviderCapabilities:
    """A provider class's default matrix: its built-in descriptor's, else what the class
    declares (``default_capabilities``), else nothing optional."""
    builtin = BUILTIN.get(provider_class.id)
    if builtin is not None:
        return builtin.capabilities
    return provider_class.default_capabilities or UNDECLARED
