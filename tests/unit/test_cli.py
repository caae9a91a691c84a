"""The `corral providers` commands."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from corral.cli.app import app
from corral.providers.descriptors import BUILTIN

KNOWN = ", ".join(sorted(BUILTIN))  # the providers corral has, by id

runner = CliRunner()


def test_providers_list_shows_local_with_capabilities() -> None:
    result = runner.invoke(app, ["providers", "list", "--json"])
    assert result.exit_code == 0, result.output
    [local] = [row for row in json.loads(result.output) if row["id"] == "local"]
    assert local["sdk_installed"] is True
    assert local["capabilities"]["billing_model"] == "fixed"
    assert "host-binary" in local["capabilities"]["substrate"]["runtime_kinds"]


def test_providers_schema_is_json_schema_of_config_and_options() -> None:
    result = runner.invoke(app, ["providers", "schema", "local"])
    assert result.exit_code == 0, result.output
    document = json.loads(result.output)
    assert document["config"]["additionalProperties"] is False
    assert "isolation" in document["config"]["properties"]
    assert "command" in document["options"]["properties"]


def test_unknown_provider_is_a_clear_error() -> None:
    result = runner.invoke(app, ["providers", "schema", "dokcer"])
    assert result.exit_code == 2
    assert f"unknown provider 'dokcer'; known providers: {KNOWN}" in result.output


def test_providers_check_runs_the_health_check(tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setenv("CORRAL_STATE_DIR", str(tmp_path))
    result = runner.invoke(app, ["providers", "check", "local"])
    assert result.exit_code == 0, result.output
    assert result.output.startswith("local: healthy")
