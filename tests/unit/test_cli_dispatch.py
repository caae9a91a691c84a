"""The admin and dispatch commands against the embedded SQLite database."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from typer.testing import CliRunner

from corral.cli.app import app
from corral.providers.descriptors import BUILTIN
from corral.shared import runtime
from corral.shared.store.db import Database, make_engine
from tests.seeding import received_item

KNOWN = ", ".join(sorted(BUILTIN))  # the providers corral has, by id

runner = CliRunner()


@pytest.fixture(autouse=True)
def embedded(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setenv("CORRAL_STATE_DIR", str(tmp_path))
    monkeypatch.delenv("CORRAL_DATABASE_URL", raising=False)
    monkeypatch.setenv("CORRAL_BROKER_URL", "memory://")
    yield
    runtime.reset()  # the commands installed a runtime on this temporary database


def invoke(*args: str) -> str:
    result = runner.invoke(app, list(args))
    assert result.exit_code == 0, result.output
    return result.output


def test_profiles_and_pools_are_created_and_listed() -> None:
    invoke("profiles", "create", "--name", "default", "--model", "m", "--auth-mode", "byok")
    assert json.loads(invoke("profiles", "list")) == [
        {"name": "default", "model": "m", "auth_mode": "byok"}
    ]
    created = json.loads(
        invoke(
            "pools",
            "create",
            "--org",
            "acme",
            "--name",
            "big",
            "--provider",
            "local",
            "--priority",
            "5",
            "--runtime-provides",
            '{"runtimeKinds": ["native"]}',
        )
    )
    assert created["runtime_provides"] == {"runtimeKinds": ["native"]}
    [listed] = json.loads(invoke("pools", "list", "--org", "acme", "--format", "json"))
    assert listed["id"] == created["id"]


def test_bad_admin_input_is_a_clear_error() -> None:
    result = runner.invoke(
        app, ["profiles", "create", "--name", "p", "--model", "m", "--auth-mode", "magic"]
    )
    assert result.exit_code == 2
    assert "auth_mode: Input should be 'local', 'host-session', 'byok'" in result.output
    bad_override = '{"gpus": 1}'
    pool = ["--org", "acme", "--name", "x", "--provider", "local"]
    result = runner.invoke(app, ["pools", "create", *pool, "--runtime-provides", bad_override])
    assert result.exit_code == 2
    assert "runtime_provides override: gpus: Extra inputs are not permitted" in result.output


def test_show_reads_an_item(tmp_path: Path) -> None:
    invoke("profiles", "list")  # the schema, as every command makes it
    database = Database(make_engine(f"sqlite:///{tmp_path / 'corral.db'}"))
    item_id = received_item(database)
    database.dispose()
    view = json.loads(invoke("show", item_id, "--format", "json"))
    assert view["state"] == "received"
    assert view["org"] == "acme"
    text = invoke("show", item_id)
    assert f"work item  {item_id}" in text


def test_dispatch_without_a_command_is_refused() -> None:
    result = runner.invoke(app, ["dispatch", "--org", "acme", "--project", "web"])
    assert result.exit_code == 125
    assert "give a command after --, or --code-file, or a message with work" in result.output


def test_worker_needs_exactly_one_role() -> None:
    result = runner.invoke(app, ["worker"])
    assert result.exit_code == 2
    assert "exactly one of --provider NAME or --maintenance" in result.output


def test_a_pool_of_an_unknown_provider_is_refused() -> None:
    result = runner.invoke(
        app, ["pools", "create", "--org", "acme", "--name", "x", "--provider", "dokcer"]
    )
    assert result.exit_code == 2
    assert f"unknown provider; known providers: {KNOWN}" in result.output


def test_a_pool_of_a_provider_corral_does_not_have_is_refused() -> None:
    # A column of the reference matrix is not an implementation.
    result = runner.invoke(
        app, ["pools", "create", "--org", "acme", "--name", "x", "--provider", "nosuch"]
    )
    assert result.exit_code == 2
    assert f"known providers: {KNOWN}" in result.output


def test_a_pools_sandbox_config_is_checked_against_the_providers_options() -> None:
    config = '{"imag": "corral-sandbox:dev", "command": "not-a-list"}'
    args = ["pools", "create", "--org", "acme", "--name", "x", "--provider", "docker"]
    result = runner.invoke(app, [*args, "--sandbox-config", config])
    assert result.exit_code == 2
    assert "invalid sandbox_config for this provider" in result.output
    assert "its keys: command, image" in result.output
    assert "corral-sandbox:dev" not in result.output  # values are not repeated


def test_a_worker_for_a_provider_corral_does_not_have_does_not_start() -> None:
    result = runner.invoke(app, ["worker", "--provider", "modal-typo"])
    assert result.exit_code == 2
    assert f"known providers: {KNOWN}" in result.output


def stdout(*args: str) -> str:
    """What the command wrote to stdout alone (a logging error on stderr left out)."""
    result = runner.invoke(app, list(args))
    assert result.exit_code == 0, result.output
    return result.stdout


def test_a_pools_warm_settings_are_set_and_checked() -> None:
    args = ["pools", "create", "--org", "acme", "--name", "w", "--provider", "local"]
    created = json.loads(stdout(*args, "--warm-min", "3", "--warm-idle-ttl-s", "60"))
    assert (created["warm_min"], created["warm_idle_ttl_s"]) == (3, 60)
    updated = json.loads(stdout("pools", "update", "w", "--org", "acme", "--warm-min", "0"))
    assert updated["warm_min"] == 0
    window = '[{"days": ["sat", "sun"], "start": "22:00", "end": "06:00", "warm_min": 2}]'
    scheduled = json.loads(
        stdout("pools", "update", "w", "--org", "acme", "--warm-schedule", window)
    )
    assert scheduled["warm_schedule"] == [json.loads(window)[0]]
    bad = '[{"start": "25:00", "end": "06:00", "warm_min": 2}]'
    refused = runner.invoke(app, ["pools", "update", "w", "--org", "acme", "--warm-schedule", bad])
    assert refused.exit_code == 2 and "warm_schedule.0.start" in refused.output
    too_many = runner.invoke(app, ["pools", "update", "w", "--org", "acme", "--warm-min", "11"])
    assert too_many.exit_code == 2
    assert "warm_min: more warm sandboxes than the pool's max_concurrent" in too_many.output
    interpreter = ["pools", "create", "--org", "acme", "--name", "v", "--provider", "agentrun"]
    refused = runner.invoke(app, [*interpreter, "--warm-min", "1"])
    assert refused.exit_code == 2
    assert "warm_min: this provider runs code itself" in refused.output
    big = ["pools", "create", "--org", "acme", "--name", "x", "--provider", "local"]
    over = runner.invoke(app, [*big, "--max-concurrent", "500", "--warm-min", "101"])
    assert over.exit_code == 2
    assert "warm_min" in over.output and "less than or equal to 100" in over.output
