"""``corral settings``: every ``CORRAL_*`` setting, its component, default and value here."""

from __future__ import annotations

import json
import re
from typing import Any

import typer
from pydantic import SecretStr

from corral.cli.output import FormatOption, OutputFormat
from corral.shared.settings import (
    COMPONENTS,
    CommonSettings,
    CoreSettings,
    component_name,
    declared_in,
)

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


def setting_rows(settings: CommonSettings) -> list[dict[str, str]]:
    """Name, component, environment variable, default, current value and description of each
    field; the fields of one component together, in the order of :data:`COMPONENTS`."""
    prefix = str(settings.model_config.get("env_prefix", ""))
    fields = type(settings).model_fields
    rank = {component: number for number, component in enumerate(COMPONENTS)}
    rows = []
    for name in sorted(fields, key=lambda name: rank[declared_in(name)]):
        field = fields[name]
        default = field.get_default(call_default_factory=True)
        rows.append(
            {
                "name": name,
                "component": component_name(declared_in(name)),
                "env": f"{prefix}{name}".upper(),
                "default": shown(default),
                "value": shown(getattr(settings, name)),
                "description": field.description or "",
            }
        )
    return rows


def settings(output_format: FormatOption = OutputFormat.TEXT) -> None:
    """Every setting: its component, environment variable, default and value here (secrets
    masked)."""
    from corral.cli.inspect import format_table

    rows = setting_rows(CoreSettings())
    if output_format == OutputFormat.JSON:
        typer.echo(json.dumps(rows, indent=2))
        return
    table = [[r["component"], r["name"], r["env"], r["default"], r["value"]] for r in rows]
    headers = ["component", "setting", "environment variable", "default", "value"]
    typer.echo(format_table(headers, table))
    typer.echo("\nWhat each one does: `corral settings --format json`, or shared/settings.py.")
