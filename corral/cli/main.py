"""The ``corral`` command. Each package contributes its own command group."""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version
from typing import Annotated

import typer
from pydantic import ValidationError

from corral.cli.commands import register_commands
from corral.cli.credentials import credentials_app
from corral.cli.providers import app as providers_app
from corral.cli.secret_key import secret_key_app
from corral.cli.secrets import secrets_app

app = typer.Typer(
    help="corral: dispatch AI-agent and CI work to execution sandboxes. Every CORRAL_* "
    "setting, its default and its value: `corral settings`.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
)
app.add_typer(providers_app, name="providers")
app.add_typer(credentials_app, name="credentials")
app.add_typer(secret_key_app, name="secret-key")
app.add_typer(secrets_app, name="secrets")


def corral_version() -> str:
    """The installed distribution's version."""
    try:
        return version("corral")
    except PackageNotFoundError:  # run from a checkout that was never installed
        return "unknown"


def _print_version(value: bool) -> None:
    if value:
        typer.echo(f"corral {corral_version()}")
        raise typer.Exit


@app.callback()
def _options(
    show_version: Annotated[
        bool,
        typer.Option(
            "--version",
            callback=_print_version,
            is_eager=True,
            help="Print corral's version and exit.",
        ),
    ] = False,
) -> None:
    pass


register_commands(app)


def main() -> None:
    try:
        app()
    except ValidationError as exc:  # CORRAL_* settings read as a command starts
        if not is_settings_error(exc):
            raise
        for line in settings_errors(exc):
            typer.echo(f"error: {line}", err=True)
        raise SystemExit(2) from None
    except Exception as exc:  # a database or broker out of reach: one line, not a traceback
        from corral.cli.failures import EXIT_UNREACHABLE, explain

        said = explain(exc)
        if said is None:
            raise
        typer.echo(f"error: {said}", err=True)
        raise SystemExit(EXIT_UNREACHABLE) from None


def is_settings_error(error: ValidationError) -> bool:
    """Whether ``error`` is the ``CORRAL_*`` settings' (of any component's class)."""
    from corral.shared.settings import COMPONENTS, CoreSettings

    return error.title in {CoreSettings.__name__, *(c.__name__ for c in COMPONENTS)}


def settings_errors(error: ValidationError) -> list[str]:
    """Each invalid setting by its environment variable, without the value given."""
    lines = []
    for entry in error.errors(include_url=False, include_input=False):
        name = ".".join(str(part) for part in entry["loc"])
        variable = f"CORRAL_{name.upper()}" if name else "CORRAL_* settings"
        lines.append(f"{variable}: {str(entry['msg']).removeprefix('Value error, ')}")
    return lines
