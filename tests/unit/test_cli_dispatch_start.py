"""``corral dispatch`` starts on an app of its own (corral.cli.main.command_app): the whole
app's command, said and refused alike, without the modules its way through the api does not
use, whose imports its start-up would pay for (docs/benchmarks.md)."""

from __future__ import annotations

import subprocess
import sys

import pytest
from typer.testing import CliRunner

from corral.cli.app import app
from corral.cli.main import command_app

runner = CliRunner()

# Loaded by none of the dispatch's own modules: the other commands, the database, Celery,
# the Python client (--wait alone follows with it), the provider contract.
NOT_LOADED = (
    "corral.cli.app",
    "corral.cli.commands",
    "sqlalchemy",
    "celery",
    "kombu",
    "httpx",
    "corral.client",
    "corral.providers.base",
    "corral.providers.registry",
)

PROBE = """
import sys
from corral.cli.main import command_app
from corral.cli.sending import CoreSettings
import corral.cli.api_post

command_app(["dispatch"])
CoreSettings()
print(" ".join(sorted(sys.modules)))
"""


@pytest.mark.parametrize(
    "arguments",
    [
        ["dispatch", "--help"],
        ["dispatch", "--no-such-option"],
        ["dispatch", "--org", "acme", "--cpu", "many"],
        ["dispatch", "--project", "web", "--", "true"],  # no org: refused before sending
    ],
)
def test_dispatch_on_its_own_app_says_and_refuses_what_the_whole_app_does(
    arguments: list[str],
) -> None:
    own = runner.invoke(command_app(arguments), arguments, prog_name="corral")
    whole = runner.invoke(app, arguments, prog_name="corral")
    assert (own.exit_code, own.output) == (whole.exit_code, whole.output)
    assert own.exit_code in (0, 2, 125), own.output  # --help, a usage error, not dispatched


def test_every_other_command_runs_on_the_whole_app() -> None:
    for arguments in (["status"], ["items", "list"], ["--version"], []):
        assert command_app(arguments) is app


def test_the_dispatch_path_loads_no_other_command_database_broker_or_provider_module() -> None:
    done = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, check=True)
    loaded = set(done.stdout.split())
    assert "corral.cli.dispatch" in loaded and "corral.shared.settings" in loaded
    assert not {name for name in loaded if name.startswith(NOT_LOADED)}
