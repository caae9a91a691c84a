"""A provider's configuration form renders where its SDK is not installed: ``corral providers
schema``, the admin api's schema and the console's form read the descriptor's SDK-free models.

Each case runs in a fresh interpreter where every provider SDK is hidden (as absent as an SDK
that was never installed: ``import`` fails and ``find_spec`` finds nothing)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from corral.providers.descriptors import BUILTIN

HIDDEN = (
    "e2b",
    "e2b_connect",
    "modal",
    "modal_proto",
    "daytona",
    "daytona_api_client",
    "vercel",
    "vercel.sandbox",
    "agentrun",
    "docker",
    "kubernetes",
)

PROBE = """
import json, sys
for name in {hidden!r}:
    sys.modules[name] = None  # what Python holds for a module that cannot be imported

from typer.testing import CliRunner

from corral.cli.providers import app
from corral.providers.registry import default_registry
from corral.scheduler.admin import providers as provider_admin
from corral.scheduler.api.console import forms

provider = {provider!r}
cli = CliRunner().invoke(app, ["schema", provider])
assert cli.exit_code == 0, cli.output
printed = json.loads(cli.output)
admin = provider_admin.provider_schema(provider)
fields = [field.name for field in forms.fields(admin["config"], {{}})]
[row] = [row for row in default_registry.describe() if row.provider_id == provider]
loaded = sorted(name for name in {hidden!r} if sys.modules.get(name) is not None)
print(json.dumps({{
    "same": printed == admin,
    "config": sorted(admin["config"]["properties"]),
    "fields": fields,
    "sdk_installed": row.sdk_installed,
    "loaded": loaded,
}}))
"""

WITH_AN_SDK = sorted(pid for pid, descriptor in BUILTIN.items() if descriptor.sdk_modules)


@pytest.mark.parametrize(
    "provider",
    WITH_AN_SDK,
)
def test_the_schema_renders_without_the_providers_sdk(provider: str) -> None:
    result = subprocess.run(
        [sys.executable, "-c", PROBE.format(hidden=HIDDEN, provider=provider)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    rendered = json.loads(result.stdout.strip().splitlines()[-1])
    assert rendered["same"]  # the cli and the admin api show one document
    assert rendered["config"] and sorted(rendered["fields"]) == rendered["config"]
    assert rendered["sdk_installed"] is False  # the SDK really was out of reach
    assert rendered["loaded"] == []


def test_the_sdks_are_hidden_as_if_never_installed() -> None:
    probe = PROBE.format(hidden=HIDDEN, provider="e2b").split("from typer")[0] + (
        "import importlib.util\n"
        "print([importlib.util.find_spec(n) for n in ('e2b', 'vercel.sandbox')])\n"
        "try:\n    import e2b.api\nexcept ImportError:\n    print('refused')\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, check=True
    )
    assert result.stdout.split() == ["[None,", "None]", "refused"]
