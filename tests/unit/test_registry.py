"""Registry lookup order, lazy built-ins, entry points, and fail-closed unknown ids."""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

import pytest

from corral.providers.capabilities import UNDECLARED
from corral.providers.descriptors import BUILTIN, ProviderDescriptor
from corral.providers.errors import (
    InvalidProviderConfigError,
    ProviderDependencyError,
    ProviderRegistryError,
    UnknownProviderError,
)
from corral.providers.local.provider import LocalProvider
from corral.providers.registry import ProviderRegistry, ShadowedProviderWarning
from corral.providers.testing import InMemoryProvider


def no_entry_points() -> list:  # type: ignore[type-arg]
    return []


class OtherLocal(InMemoryProvider):
    id = "local"
    display_name = "A local stand-in"


def test_builtin_local_loads_lazily() -> None:
    registry = ProviderRegistry(entry_point_source=no_entry_points)
    assert registry.get("local") is LocalProvider


def test_registered_provider_wins_over_builtin() -> None:
    registry = ProviderRegistry(entry_point_source=no_entry_points)
    registry.register(OtherLocal)
    assert registry.get("local") is OtherLocal
    with pytest.raises(ProviderRegistryError, match="replace=True"):
        registry.register(InMemoryProvider.__class__("X", (InMemoryProvider,), {"id": "local"}))


def test_unknown_provider_fails_closed_listing_known_ids() -> None:
    registry = ProviderRegistry(entry_point_source=no_entry_points)
    registry.register(InMemoryProvider)
    with pytest.raises(UnknownProviderError) as raised:
        registry.get("dokcer")
    assert "'dokcer'" in str(raised.value)
    known = ", ".join(sorted([*BUILTIN, "in-memory"]))
    assert f"known providers: {known}" in str(raised.value)


def test_missing_sdk_names_the_extra_to_install() -> None:
    builtins = {
        **BUILTIN,
        "cloudy": ProviderDescriptor(
            id="cloudy",
            display_name="Cloudy",
            capabilities=UNDECLARED,
            module="providers.cloudy",
            class_name="CloudyProvider",
            sdk_modules=("corral_test_sdk_that_is_not_installed",),
            extra="cloudy",
        ),
    }
    registry = ProviderRegistry(builtins=builtins, entry_point_source=no_entry_points)
    with pytest.raises(ProviderDependencyError) as raised:
        registry.get("cloudy")
    assert isinstance(raised.value, ImportError)
    assert "pip install 'corral[cloudy]'" in str(raised.value)
    assert "corral_test_sdk_that_is_not_installed" in str(raised.value)
    [row] = [info for info in registry.describe() if info.provider_id == "cloudy"]
    assert not row.sdk_installed and row.problem is not None


def test_known_ids_are_the_providers_corral_has_and_nothing_else() -> None:
    registry = ProviderRegistry(entry_point_source=no_entry_points)
    assert registry.known_ids() == sorted(BUILTIN)
    for provider_id in ("nosuch", "daytona-typo"):
        assert not registry.is_known(provider_id)
        with pytest.raises(
            UnknownProviderError, match=f"known providers: {', '.join(sorted(BUILTIN))}"
        ):
            registry.require_known(provider_id)
    registry.register(InMemoryProvider)
    assert registry.is_known("in-memory")


def test_a_descriptor_needs_no_import_and_matches_its_class() -> None:
    registry = ProviderRegistry(entry_point_source=no_entry_points)
    for provider_id, descriptor in BUILTIN.items():
        assert registry.descriptor(provider_id) is descriptor
        if descriptor.missing_sdk():
            continue
        provider_class = descriptor.load()
        assert (provider_class.id, provider_class.display_name) == (
            descriptor.id,
            descriptor.display_name,
        )
        assert descriptor.config_model is provider_class.config_model


def test_a_provider_that_is_not_built_in_is_described_by_its_class() -> None:
    registry = ProviderRegistry(entry_point_source=no_entry_points)

    class Declared(InMemoryProvider):
        id = "declared"
        display_name = "Declares its matrix"
        default_capabilities = BUILTIN["e2b"].capabilities

    class Silent(InMemoryProvider):
        id = "silent"
        display_name = "Declares nothing"

    registry.register(Declared)
    registry.register(Silent)
    assert registry.capabilities_of("declared") == BUILTIN["e2b"].capabilities
    assert registry.capabilities_of("silent") == UNDECLARED
    assert registry.descriptor("declared").display_name == "Declares its matrix"


def test_invalid_provider_config_names_the_key() -> None:
    registry = ProviderRegistry(entry_point_source=no_entry_points)
    with pytest.raises(InvalidProviderConfigError) as raised:
        registry.create("local", {"root_dri": "/tmp/x"})
    assert "'root_dri'" in str(raised.value)
    assert "root_dir" in str(raised.value)  # the allowed keys are listed


@pytest.fixture
def installed_distributions(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):  # type: ignore[no-untyped-def]
    """Install fake distributions (a dist-info and a module) on sys.path, for real."""

    def install(dist: str, module: str, entry_points: dict[str, str], source: str) -> None:
        (tmp_path / f"{module}.py").write_text(textwrap.dedent(source))
        info = tmp_path / f"{dist}-1.0.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 1.0\n")
        lines = "".join(f"{name} = {target}\n" for name, target in entry_points.items())
        (info / "entry_points.txt").write_text(f"[corral.providers]\n{lines}")

    monkeypatch.syspath_prepend(str(tmp_path))
    yield install
    for name in [m for m in sys.modules if m.startswith("corral_test_plugin")]:
        del sys.modules[name]


PLUGIN_SOURCE = """
from corral.providers.testing import InMemoryProvider

class AcmeProvider(InMemoryProvider):
    id = "acme-cloud"
    display_name = "Acme Cloud"

class ShadowLocal(InMemoryProvider):
    id = "local"
    display_name = "Shadow"
"""


def test_entry_point_provider_is_found(installed_distributions) -> None:  # type: ignore[no-untyped-def]
    installed_distributions(
        "corral-acme",
        "corral_test_plugin_a",
        {"acme-cloud": "corral_test_plugin_a:AcmeProvider"},
        PLUGIN_SOURCE,
    )
    registry = ProviderRegistry()
    provider_class = registry.get("acme-cloud")
    assert provider_class.display_name == "Acme Cloud"
    assert "acme-cloud" in registry.known_ids()


def test_two_entry_points_with_one_name_are_an_error(installed_distributions) -> None:  # type: ignore[no-untyped-def]
    installed_distributions(
        "corral-acme",
        "corral_test_plugin_a",
        {"acme-cloud": "corral_test_plugin_a:AcmeProvider"},
        PLUGIN_SOURCE,
    )
    installed_distributions(
        "corral-acme-fork",
        "corral_test_plugin_b",
        {"acme-cloud": "corral_test_plugin_b:AcmeProvider"},
        PLUGIN_SOURCE,
    )
    with pytest.raises(ProviderRegistryError, match="two entry points") as raised:
        ProviderRegistry().get("acme-cloud")
    assert "corral_test_plugin_a:AcmeProvider" in str(raised.value)
    assert "corral_test_plugin_b:AcmeProvider" in str(raised.value)


def test_entry_point_shadowed_by_builtin_is_warned_and_ignored(installed_distributions) -> None:  # type: ignore[no-untyped-def]
    installed_distributions(
        "corral-shadow",
        "corral_test_plugin_c",
        {"local": "corral_test_plugin_c:ShadowLocal"},
        PLUGIN_SOURCE,
    )
    registry = ProviderRegistry()
    with pytest.warns(ShadowedProviderWarning, match="builtin provider already has that id"):
        known = registry.known_ids()
    assert known.count("local") == 1
    assert registry.get("local") is LocalProvider


def test_entry_point_whose_id_disagrees_is_rejected(installed_distributions) -> None:  # type: ignore[no-untyped-def]
    installed_distributions(
        "corral-liar",
        "corral_test_plugin_d",
        {"acme": "corral_test_plugin_d:AcmeProvider"},
        PLUGIN_SOURCE,
    )
    with pytest.raises(ProviderRegistryError, match="must match"):
        ProviderRegistry().get("acme")


def test_describe_lists_a_provider_that_needs_configuration() -> None:
    from pydantic import SecretStr

    from corral.providers.config import ProviderConfig

    class NeedsKeyConfig(ProviderConfig):
        api_key: SecretStr

    class NeedsKey(InMemoryProvider):
        id = "needs-key"
        display_name = "Needs a key"
        config_model = NeedsKeyConfig  # type: ignore[assignment]

    registry = ProviderRegistry(entry_point_source=no_entry_points)
    registry.register(NeedsKey)
    [row] = [info for info in registry.describe() if info.provider_id == "needs-key"]
    assert row.sdk_installed and row.capabilities is not None


def test_the_package_names_are_their_modules_own_loaded_on_first_use() -> None:
    from corral import providers
    from corral.providers import base, capabilities, registry

    assert providers.SandboxProvider is base.SandboxProvider
    assert providers.derive_capabilities is capabilities.derive_capabilities
    assert providers.register_provider is registry.register_provider
    assert all(getattr(providers, name) is not None for name in providers.__all__)
    with pytest.raises(AttributeError, match="no attribute 'no_such_name'"):
        providers.no_such_name  # noqa: B018 - the lookup is what is tested
