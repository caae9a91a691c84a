"""``corral credentials``: an org's provider credentials, encrypted at rest. A secret is
read from standard input only, and never printed."""

from __future__ import annotations

import json
import sys
from typing import Annotated

import typer

from corral.cli.output import FormatOption, OutputFormat, fail, runtime
from corral.shared.errors import CorralError

credentials_app = typer.Typer(help="Provider credentials of an org, encrypted at rest.")

Org = Annotated[str, typer.Option(help="Org id.")]
Provider = Annotated[str, typer.Option(help="Provider id, e.g. e2b.")]


@credentials_app.command("set")
def credentials_set(org: Org, provider: Provider) -> None:
    """Store an org's credential for a provider. The secret is read from standard input,
    never from the command line (which other users can see in the process list)."""
    from corral.scheduler.admin.providers import set_credential

    secret = sys.stdin.readline().strip()
    if not secret:
        raise fail("no secret on standard input")
    try:
        set_credential(runtime(), org, provider, secret)
    except CorralError as exc:
        raise fail(exc.message) from exc
    typer.echo(f"stored the {provider} credential of org {org}")


@credentials_app.command("list")
def credentials_list(org: Org, output_format: FormatOption = OutputFormat.TEXT) -> None:
    """The providers an org has a stored credential for, and when each was stored."""
    from corral.cli.inspect import format_table
    from corral.scheduler.admin.providers import list_credentials

    rows = list_credentials(runtime(), org)
    if output_format == OutputFormat.JSON:
        typer.echo(json.dumps(rows, indent=2))
    elif not rows:
        typer.echo(f"org {org} has no stored credentials")
    else:
        table = [[row["provider"], row["updated_at"][:19]] for row in rows]
        typer.echo(format_table(["provider", "stored"], table))


@credentials_app.command("delete")
def credentials_delete(org: Org, provider: Provider) -> None:
    """Forget an org's credential for a provider."""
    from corral.scheduler.admin.providers import delete_credential

    if not delete_credential(runtime(), org, provider):
        raise fail(f"org {org} has no stored {provider} credential")
    typer.echo(f"deleted the {provider} credential of org {org}")
