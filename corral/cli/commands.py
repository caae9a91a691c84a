"""The process, admin and dispatch commands of ``corral``."""

from __future__ import annotations

import json
import logging
import shutil
from typing import Annotated, Any

import typer
from pydantic import ValidationError

from corral.cli.budgets import budgets_app
from corral.cli.bundles import bundle
from corral.cli.capacities import capacities_app
from corral.cli.dispatch import dispatch
from corral.cli.flower import flower
from corral.cli.items import cancel, items_app, logs
from corral.cli.orgs import orgs_app
from corral.cli.output import (
    FormatOption,
    OutputFormat,
    echo_work_text,
    fail,
    fail_fields,
    runtime,
)
from corral.cli.pools import pools_app
from corral.cli.reports import costs, sandboxes_app
from corral.cli.settings import settings
from corral.cli.status import status
from corral.shared.errors import CorralError

profiles_app = typer.Typer(help="Model profiles: a model and its auth mode.")
db_app = typer.Typer(help="The system-of-record database.")


def register_commands(app: typer.Typer) -> None:
    app.add_typer(pools_app, name="pools")
    app.add_typer(capacities_app, name="capacities")
    app.add_typer(budgets_app, name="budgets")
    app.add_typer(orgs_app, name="orgs")
    app.add_typer(profiles_app, name="profiles")
    app.add_typer(db_app, name="db")
    app.add_typer(sandboxes_app, name="sandboxes")
    app.add_typer(items_app, name="items")
    commands = (dev, api, scheduler, worker, beat, flower, dispatch, show, cancel, logs, status)
    for command in (*commands, costs, settings, bundle):
        app.command(command.__name__)(command)


_runtime = runtime


# -- processes -----------------------------------------------------------------------------


def dev(
    demo: Annotated[bool, typer.Option(help="Dispatch demo items, print a table, exit.")] = False,
    port: Annotated[int, typer.Option(help="api TCP port; 0 picks a free one.")] = 0,
) -> None:
    """Everything in one process: SQLite, in-process broker, local provider, api. One
    `corral dev` per state directory; when it stops (Ctrl-C, SIGTERM) it ends the sandboxes
    it started."""
    from corral.cli.dev import dev_settings, serve_forever
    from corral.cli.dev_lock import StateDirTakenError, holding_state_dir
    from corral.cli.processes import configure_logging

    configure_logging("WARNING")
    # The in-process broker has no host; kombu would warn about that on every connection.
    logging.getLogger("kombu.connection").setLevel(logging.ERROR)
    settings = dev_settings(demo=demo, port=port)
    try:
        with holding_state_dir(settings.state_dir, settings.control_url):
            ok = _demo(settings) if demo else serve_forever(settings)
    except StateDirTakenError as exc:
        raise fail(exc.message, code=1) from exc
    if not ok:
        raise fail("some demo items did not end as expected (see the table)", code=1)


def _demo(settings: Any) -> bool:
    """`corral dev --demo`: whether every demo item ended as expected."""
    from corral.cli.demo import run_demo
    from corral.cli.dev import DEMO_STATE_PREFIX, running_stack
    from corral.providers.local.disk import unmount_below

    try:
        with running_stack(settings) as stack:
            return run_demo(stack.runtime, stack.api_url, stack.admin_token)
    finally:
        if settings.state_dir.name.startswith(DEMO_STATE_PREFIX):
            unmount_below(settings.state_dir)  # the sandboxes' disks: their files go next
            shutil.rmtree(settings.state_dir, ignore_errors=True)


def api(
    *,
    host: Annotated[
        str | None, typer.Option(help="The TCP address to listen on [CORRAL_API_HOST, 127.0.0.1].")
    ] = None,
    port: Annotated[
        int | None, typer.Option(help="The TCP port [CORRAL_API_PORT, 8300].", min=0, max=65535)
    ] = None,
    processes: Annotated[
        int | None,
        typer.Option(
            help="Processes serving the port, one core each [CORRAL_API_PROCESSES, 1].",
            min=1,
            max=64,
        ),
    ] = None,
    unix: Annotated[bool, typer.Option(help="Also listen on the api Unix socket.")] = True,
    metrics_port: Annotated[
        int | None,
        typer.Option(help="Serve Prometheus metrics on this port [CORRAL_API_METRICS_PORT]."),
    ] = None,
    metrics_host: Annotated[
        str | None,
        typer.Option(help="Address of the metrics port [CORRAL_API_METRICS_HOST, 127.0.0.1]."),
    ] = None,
) -> None:
    """Serve the HTTP api (CORRAL_API_HOST/PORT, and CORRAL_API_SOCKET); it logs where."""
    from corral.cli.processes import configure_logging, run_api

    configure_logging()
    given = {
        "api_host": host,
        "api_port": port,
        "api_processes": processes,
        "api_metrics_port": metrics_port,
        "api_metrics_host": metrics_host,
    }
    _guarded(run_api, unix=unix, overrides={k: v for k, v in given.items() if v is not None})


def scheduler(
    concurrency: Annotated[int, typer.Option(help="Intake loops in this process.")] = 4,
    metrics_port: Annotated[
        int | None, typer.Option(help="Serve Prometheus metrics on this port.")
    ] = None,
    metrics_host: Annotated[str, typer.Option(help="Address of the metrics port.")] = "127.0.0.1",
    name: Annotated[
        str,
        typer.Option(
            help="Node name (<name>@<host>) in Flower and `celery inspect`; give each "
            "scheduler on one host its own."
        ),
    ] = "scheduler",
) -> None:
    """Consume the dispatch queue in batches: validate, persist, route."""
    from corral.cli.processes import configure_logging, run_scheduler

    if not name or "@" in name or not name.isprintable():
        raise typer.BadParameter("a node name without '@', e.g. scheduler-2", param_hint="--name")

    configure_logging()
    _serve_metrics(metrics_port, metrics_host)
    _guarded(run_scheduler, concurrency=concurrency, name=name)


def worker(
    provider: Annotated[str | None, typer.Option(help="Provision for this provider.")] = None,
    maintenance: Annotated[bool, typer.Option(help="Consume the maintenance queue.")] = False,
    concurrency: Annotated[int, typer.Option(help="Provisions in flight per process.")] = 32,
    metrics_port: Annotated[
        int | None, typer.Option(help="Serve Prometheus metrics on this port.")
    ] = None,
    metrics_host: Annotated[str, typer.Option(help="Address of the metrics port.")] = "127.0.0.1",
) -> None:
    """A provider worker (`--provider local`) or the maintenance worker (`--maintenance`)."""
    from corral.cli.processes import configure_logging, run_maintenance_worker, run_provider_worker

    if (provider is None) == (not maintenance):
        raise fail("give exactly one of --provider NAME or --maintenance")
    configure_logging()
    _serve_metrics(metrics_port, metrics_host)
    if provider is not None:
        _guarded(run_provider_worker, provider, concurrency=concurrency)
    else:
        _guarded(run_maintenance_worker, concurrency=min(concurrency, 8))


def beat() -> None:
    """Schedule the periodic tasks (one replica only)."""
    from corral.cli.processes import configure_logging, run_beat

    configure_logging()
    _guarded(run_beat)


def _serve_metrics(port: int | None, host: str) -> None:
    """This process's Prometheus metrics on ``host:port``, when a port is given."""
    if port is not None:
        from prometheus_client import start_http_server

        start_http_server(port, addr=host)


def _guarded(function: Any, *args: Any, **kwargs: Any) -> None:
    try:
        function(*args, **kwargs)
    except CorralError as exc:
        raise fail(exc.message) from exc


@db_app.command("upgrade")
def db_upgrade() -> None:
    """Apply the schema migrations to CORRAL_DATABASE_URL."""
    from corral.shared.store.db import make_engine
    from corral.shared.store.migrate import upgrade

    engine = make_engine()
    upgrade(engine)
    typer.echo(f"database at the newest schema: {engine.url.render_as_string()}")
    engine.dispose()


# -- admin ---------------------------------------------------------------------------------


@profiles_app.command("create")
def profiles_create(
    name: Annotated[str, typer.Option(help="Its name, which a dispatch's profile names.")],
    model: Annotated[str, typer.Option(help="The model it stands for, e.g. claude-sonnet.")],
    auth_mode: Annotated[str, typer.Option(help="local, host-session, byok, metered, shared")],
) -> None:
    """Create or update a model profile."""
    from corral.scheduler.admin.pools import ProfileCreate, create_profile

    try:
        request = ProfileCreate.model_validate(
            {"name": name, "model": model, "auth_mode": auth_mode}
        )
    except ValidationError as exc:
        raise fail_fields(exc, ProfileCreate) from exc
    typer.echo(json.dumps(create_profile(_runtime().db, request)))


@profiles_app.command("list")
def profiles_list() -> None:
    """List model profiles."""
    from corral.scheduler.admin.pools import list_profiles

    typer.echo(json.dumps(list_profiles(_runtime().db), indent=2))


# -- work ----------------------------------------------------------------------------------


def show(
    item_id: Annotated[str, typer.Argument(help="The work item id (wi-...).")],
    output_format: FormatOption = OutputFormat.TEXT,
) -> None:
    """Show a work item: state, pool, queue, sandbox, result or error, and its log."""
    from corral.cli.inspect import item_view, render_text

    try:
        rt = _runtime()
        view = item_view(rt.db, item_id, max_attempts=rt.settings.max_attempts)
    except LookupError as exc:
        raise fail(str(exc)) from exc
    if output_format == "json":
        typer.echo(json.dumps(view, indent=2))  # JSON escapes every control character
    else:
        echo_work_text(render_text(view))  # the work's log and error, escaped on a terminal
