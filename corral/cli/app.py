"""The whole ``corral`` command: every group and command, each package's own."""

from __future__ import annotations

from corral.cli.commands import register_commands
from corral.cli.credentials import credentials_app
from corral.cli.main import root_app
from corral.cli.providers import app as providers_app
from corral.cli.secret_key import secret_key_app
from corral.cli.secrets import secrets_app

app = root_app()
app.add_typer(providers_app, name="providers")
app.add_typer(credentials_app, name="credentials")
app.add_typer(secret_key_app, name="secret-key")
app.add_typer(secrets_app, name="secrets")
register_commands(app)
