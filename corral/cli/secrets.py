"""``corral secrets``: named secrets, an org's (``--org``) or the deployment's, sealed at
rest. A value is read from standard input only, and never printed."""

from __future__ import annotations

import json
import re
import sys
from typing import Annotated

import typer

from corral.cli.output import FormatOption, OutputFormat, fail, runtime
from corral.shared.errors import CorralError
from corral.shared.text import IDENTIFIER

secrets_app = typer.Typer(
    help="Named secrets that dispatch messages refer to by name (secret_env, a binding's "
    "secret): an org's, or the deployment's for every org. Values are sealed at rest and "
    "never shown."
)

Name = Annotated[str, typer.Argument(help="The secret's name (letters, digits, '.', '_', '-').")]


def _org_id(org: str | None) -> str | None:
    # Never the deployment's row ('*') nor one no item's org can be.
    if org is not None and re.fullmatch(IDENTIFIER, org) is None:
        raise typer.BadParameter(
            "an org id: 1-63 letters, digits, '.', '_', '-', starting with a letter or digit"
        )
    return org


Org = Annotated[
    str | None,
    typer.Option(
        help="Org id; without it, the deployment's secret (for every org's items).",
        callback=_org_id,
    ),
]


def _whose(org: str | None) -> str:
    return f"org {org}" if org else "the deployment"


@secrets_app.command("set")
def secrets_set(name: Name, org: Org = None) -> None:
    """Create or replace a named secret. Its value is read from standard input (all of it,
    less one final newline), never from the command line (which other users can see in
    the process list)."""
    from corral.shared.store import secrets

    value = sys.stdin.read()
    value = value.removesuffix("\n").removesuffix("\r")
    if not value:
        raise fail("no value on standard input")
    try:
        created = secrets.set_secret(runtime().db, org, name, value)
    except CorralError as exc:
        raise fail(exc.message) from exc
    typer.echo(f"{'stored' if created else 'replaced'} the secret {name} of {_whose(org)}")


@secrets_app.command("list")
def secrets_list(org: Org = None, output_format: FormatOption = OutputFormat.TEXT) -> None:
    """The named secrets of an org (or the deployment's): names and times, never values."""
    from corral.cli.inspect import format_table
    from corral.shared.store import secrets

    rows = [info.as_json() for info in secrets.list_secrets(runtime().db, org)]
    if output_format == OutputFormat.JSON:
        typer.echo(json.dumps(rows, indent=2))
    elif not rows:
        typer.echo(f"{_whose(org)} has no named secrets")
    else:
        table = [[r["name"], r["scope"], r["created_at"][:19], r["updated_at"][:19]] for r in rows]
        typer.echo(format_table(["name", "scope", "created", "updated"], table))


@secrets_app.command("delete")
def secrets_delete(name: Name, org: Org = None) -> None:
    """Forget a named secret. Items that refer to it and have not read it yet fail with
    unknown_secret."""
    from corral.shared.store import secrets

    if not secrets.delete_secret(runtime().db, org, name):
        raise fail(f"{_whose(org)} has no secret named {name}")
    typer.echo(f"deleted the secret {name} of {_whose(org)}")
