"""Importing corral.providers loads no provider SDK, even when every SDK is installed."""

from __future__ import annotations

import importlib.util
import subprocess
import sys

SDKS = ("docker", "kubernetes", "e2b", "vercel.sandbox", "modal", "daytona")


def test_the_sdks_are_installed_so_the_next_test_means_something() -> None:
    assert [name for name in SDKS if importlib.util.find_spec(name) is None] == []


def test_import_providers_loads_no_sdk() -> None:
    probe = (
        "import sys, corral.providers, corral.providers.registry, corral.providers.capabilities, "
        "corral.cli.providers; "
        "from corral.providers.registry import default_registry; default_registry.get('local'); "
        # `corral providers list` and routing read descriptors: still no SDK
        "rows = default_registry.describe(); "
        "[default_registry.capabilities_of(p) for p in default_registry.known_ids()]; "
        f"print(sorted(m for m in {SDKS!r} if m in sys.modules))"
    )
    result = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, check=True
    )
    assert result.stdout.strip() == "[]"
