"""The ``corral`` command's entry point: the app of the command asked for, run.

``corral dispatch`` runs on an app of that one command: importing the other commands, and
typer reading their signatures, would cost it about 65 ms of CPU, a quarter of what it spends
before its item is sent, which the walkthrough promises routed within a second of its start
(docs/benchmarks.md). Every other command runs on the whole app (:mod:`corral.cli.app`).
"""

from __future__ import annotations

import sys
from typing import Annotated

import typer
from pydantic import ValidationError


def root_app() -> typer.Typer:
    """The ``corral`` command without its commands: its help and ``--version``."""
    app = typer.Typer(
        help="corral: dispatch AI-agent and CI work to execution sandboxes. Every CORRAL_* "
        "setting, its default and its value: `corral settings`.",
        no_args_is_help=True,
        pretty_exceptions_enable=False,
    )
    app.callback()(_options)
    return app


def command_app(arguments: list[str]) -> typer.Typer:
    """The app that runs ``corral ARGUMENTS``: ``dispatch``'s alone, else the whole one."""
    if arguments[:1] == ["dispatch"]:
        from corral.cli.dispatch import dispatch

        app = root_app()
        app.command("dispatch")(dispatch)
        return app
    from corral.cli.app import app as whole

    return whole


def corral_version() -> str:
    """The installed distribution's version."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("corral")
    except PackageNotFoundError:  # run from a checkout that was never installed
        return "unknown"


def _print_version(value: bool) -> None:
    if value:
        typer.echo(f"corral {corral_version()}")
        raise typer.Exit


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


def main() -> None:
    try:
        command_app(sys.argv[1:])()
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
