"""Providers under contract. A new provider joins the suite by adding a ProviderCase."""

from __future__ import annotations

import shutil
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from providers.base import SandboxProvider
from providers.local import LocalProvider
from providers.testing import InMemoryProvider
from tests.conftest import require

READY_LINE = "corral-contract-ready"


@dataclass(frozen=True)
class ProviderCase:
    name: str
    provider_class: type[SandboxProvider]
    # Builds the provider from a scratch directory it may use.
    build: Callable[[Path], SandboxProvider]
    # provider_options for a sandbox that prints READY_LINE and then keeps running.
    long_running_options: dict[str, Any]
    needs_bwrap: bool = False


LONG_RUNNING_COMMAND = ["sh", "-c", f"echo {READY_LINE}; exec sleep 300"]

CASES = [
    ProviderCase(
        "in-memory",
        InMemoryProvider,
        lambda root: InMemoryProvider(),
        {"log_lines": [READY_LINE]},
    ),
    ProviderCase(
        "local-bwrap",
        LocalProvider,
        lambda root: LocalProvider({"root_dir": root, "isolation": "required"}),
        {"command": LONG_RUNNING_COMMAND},
        needs_bwrap=True,
    ),
    ProviderCase(
        "local-plain",
        LocalProvider,
        lambda root: LocalProvider({"root_dir": root, "isolation": "off"}),
        {"command": LONG_RUNNING_COMMAND},
    ),
]


def cases_with(ability: type | None = None) -> list[Any]:
    """pytest params for the cases whose provider class implements ``ability``."""
    chosen = [c for c in CASES if ability is None or issubclass(c.provider_class, ability)]
    return [pytest.param(c, id=c.name) for c in chosen]


@pytest.fixture
def provider_for(tmp_path: Path) -> Iterator[Callable[[ProviderCase], SandboxProvider]]:
    """Builds the case's provider; terminates whatever it still owns at teardown."""
    built: list[SandboxProvider] = []

    def build(case: ProviderCase) -> SandboxProvider:
        if case.needs_bwrap:
            require(shutil.which("bwrap") is not None, "bubblewrap")
        provider = case.build(tmp_path / "root")
        built.append(provider)
        return provider

    yield build
    for provider in built:
        for managed in getattr(provider, "list_managed", list)():
            provider.terminate(managed.handle)
