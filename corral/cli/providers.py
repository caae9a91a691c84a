"""``corral providers ...``: list, describe and check sandbox providers."""

from __future__ import annotations

import json
import sys
from typing import Annotated

import typer

from corral.cli.output import fail, json_option, runtime
from corral.providers.capabilities import ProviderCapabilities
from corral.providers.errors import ProviderError
from corral.providers.registry import ProviderInfo, default_registry
from corral.shared.errors import CorralError

app = typer.Typer(help="Sandbox providers: what is installed, how to configure it, health.")
config_app = typer.Typer(
    help="The deployment's configuration of a provider, stored in the database."
)
app.add_typer(config_app, name="config")


def _capability_summary(capabilities: ProviderCapabilities | None) -> str:
    if capabilities is None:
        return "-"
    flags = [
        name
        for name, on in (
            ("gpu", capabilities.supports_gpu),
            ("pause", capabilities.supports_pause_resume),
            ("snapshot", capabilities.supports_fs_snapshot),
            ("capacity", capabilities.supports_capacity_query),
            ("allowed-hosts", capabilities.enforces_allowed_hosts),
            ("secret-bindings", capabilities.enforces_secret_bindings),
        )
        if on
    ]
    return f"{capabilities.billing_model}; {','.join(flags) or 'no extras'}"


def _row(info: ProviderInfo) -> dict[str, object]:
    return {
        "id": info.provider_id,
        "display_name": info.display_name,
        "source": info.source,
        "sdk_installed": info.sdk_installed,
        "capabilities": info.capabilities.model_dump(mode="json") if info.capabilities else None,
        "problem": info.problem,
    }


@app.command("list")
def list_providers(
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
) -> None:
    """Every known provider: id, name, capabilities, and whether its SDK is installed."""
    rows = default_registry.describe()
    if as_json:
        typer.echo(json.dumps([_row(info) for info in rows], indent=2))
        return
    typer.echo(f"{'ID':<12} {'NAME':<22} {'SOURCE':<12} {'SDK':<5} CAPABILITIES")
    for info in rows:
        sdk = "yes" if info.sdk_installed else "no"
        line = f"{info.provider_id:<12} {info.display_name or '-':<22} {info.source:<12} {sdk:<5} "
        typer.echo(
            line
            + (_capability_summary(info.capabilities) if info.sdk_installed else info.problem or "")
        )


@app.command("schema")
def schema(name: Annotated[str, typer.Argument(help="Provider id, e.g. local.")]) -> None:
    """The JSON schema of a provider's configuration and of its per-sandbox options."""
    try:
        # The descriptor's models: a built-in provider's render without its SDK installed.
        descriptor = default_registry.descriptor(name)
        document = {
            "provider": name,
            "display_name": descriptor.display_name,
            "config": descriptor.config_model.model_json_schema(),
            "options": descriptor.options_model.model_json_schema(),
        }
    except ProviderError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from exc
    typer.echo(json.dumps(document, indent=2))


@app.command("check")
def check(
    name: Annotated[str, typer.Argument(help="Provider id, e.g. local.")],
    org: Annotated[
        str | None, typer.Option(help="Check with this org's credential (stored, else env).")
    ] = None,
) -> None:
    """Build the provider as a worker of this deployment would (the stored configuration,
    else its ``CORRAL_PROVIDER_CONFIG`` entry; the stored credentials) and make one
    authenticated, read-only call; exit 1 when it is unhealthy (a configuration the
    provider refuses, or no credential where one is needed)."""
    from corral.scheduler.admin.providers import check_provider

    try:
        health = check_provider(runtime(), name, org)
    except CorralError as exc:
        raise fail(exc.message) from exc
    typer.echo(f"{name}: {'healthy' if health.healthy else 'UNHEALTHY'}: {health.message}")
    if not health.healthy:
        raise typer.Exit(1)


@config_app.command("show")
def config_show(name: Annotated[str, typer.Argument(help="Provider id, e.g. docker.")]) -> None:
    """The provider's configuration as this deployment's workers use it (secrets masked)
    and where it comes from: stored, CORRAL_PROVIDER_CONFIG, or the defaults."""
    from corral.scheduler.admin.providers import config_document

    try:
        typer.echo(json.dumps(config_document(runtime(), name), indent=2))
    except CorralError as exc:
        raise fail(exc.message) from exc


@config_app.command("set")
def config_set(
    name: Annotated[str, typer.Argument(help="Provider id, e.g. docker.")],
    config: Annotated[
        str | None,
        typer.Argument(help="The configuration as JSON; read from standard input when left out."),
    ] = None,
) -> None:
    """Store the provider's configuration, checked against its schema first (`corral
    providers schema NAME`). It replaces CORRAL_PROVIDER_CONFIG's entry; every process uses
    it from its next provision after CORRAL_PROVIDER_CONFIG_REFRESH_S, without a restart.
    Give a configuration with secrets on standard input."""
    from corral.scheduler.admin.providers import set_config

    document = json_option(config if config is not None else sys.stdin.read(), "the config")
    if not isinstance(document, dict):
        raise fail("the configuration must be a JSON object, e.g. '{\"max_concurrent\": 8}'")
    try:
        typer.echo(json.dumps(set_config(runtime(), name, document), indent=2))
    except CorralError as exc:
        raise fail(exc.message) from exc


@config_app.command("unset")
def config_unset(name: Annotated[str, typer.Argument(help="Provider id, e.g. docker.")]) -> None:
    """Forget the stored configuration: CORRAL_PROVIDER_CONFIG's entry (or the defaults)
    applies again."""
    from corral.scheduler.admin.providers import remove_config

    try:
        typer.echo(json.dumps(remove_config(runtime(), name), indent=2))
    except CorralError as exc:
        raise fail(exc.message) from exc


@app.command("demo")
def demo() -> None:
    """Start a few real sandboxes with the local provider and show what happened."""
    from corral.providers.local.demo import run_demo

    if not run_demo(typer.echo):
        raise typer.Exit(1)
