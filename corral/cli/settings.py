"""``corral settings``: every ``CORRAL_*`` setting, its default and its value here."""

from __future__ import annotations

import json
import re
from typing import Any

import typer
from pydantic import SecretStr
from pydantic_settings import BaseSettings

from corral.cli.output import FormatOption, OutputFormat
from corral.shared.settings import CoreSettings

MASK = "**********"
# user:password@ in a URL: the password is masked.
_URL_PASSWORD = re.compile(r"(?P<head>[a-z0-9+.-]+://[^:/@\s]*:)[^@\s]*@", re.IGNORECASE)


def shown(value: Any) -> str:
    """A setting's value as it may be printed: secrets and URL passwords masked, provider
    configurations (which may hold secrets) as their provider ids only."""
    if value is None:
        return "-"
    if value == "":
        return '""'
    if isinstance(value, SecretStr):
        return MASK
    if isinstance(value, dict):
        return f"{{{', '.join(sorted(value))}}}" if value else "{}"
    return _URL_PASSWORD.sub(rf"\g<head>{MASK}@", str(value))


def setting_rows(settings: BaseSettings) -> list[dict[str, str]]:
    """Name, environment variable, default, current value and description of each field."""
    prefix = str(settings.model_config.get("env_prefix", ""))
    rows = []
    for name, field in type(settings).model_fields.items():
        default = field.get_default(call_default_factory=True)
        rows.append(
            {
                "name": name,
                "env": f"{prefix}{name}".upper(),
                "default": shown(default),
                "value": shown(getattr(settings, name)),
                "description": field.description or "",
            }
        )
    return rows


def settings(output_format: FormatOption = OutputFormat.TEXT) -> None:
    """Every setting: its environment variable, default and value here (secrets masked)."""
    from corral.cli.inspect import format_table

    rows = setting_rows(CoreSettings())
    if output_format == OutputFormat.JSON:
        typer.echo(json.dumps(rows, indent=2))
        return
    table = [[r["name"], r["env"], r["default"], r["value"]] for r in rows]
    typer.echo(format_table(["setting", "environment variable", "default", "value"], table))
    typer.echo("\nWhat each one does: `corral settings --format json`, or shared/settings.py.")
