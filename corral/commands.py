"""The process, admin and dispatch commands of ``corral``."""

from __future__ import annotations

import json
import logging
import shutil
import time
from pathlib import Path
from typing import Annotated, Any

import typer
from pydantic import ValidationError

from corral.bundles import bundle
from corral.flower import flower
from corral.reports import costs, sandboxes_app
from corral.shared.errors import CorralError
from corral.shared.messages import DispatchRequest, describe_field_errors, field_errors

pools_app = typer.Typer(help="Capacity pools: which provider runs an org's work.")
profiles_app = typer.Typer(help="Model profiles: a model and its auth mode.")
db_app = typer.Typer(help="The system-of-record database.")


def fail(message: str, code: int = 2) -> typer.Exit:
    typer.echo(f"error: {message}", err=True)
    return typer.Exit(code)


def register_commands(app: typer.Typer) -> None:
    app.add_typer(pools_app, name="pools")
    app.add_typer(profiles_app, name="profiles")
    app.add_typer(db_app, name="db")
    app.add_typer(sandboxes_app, name="sandboxes")
    for command in (dev, api, scheduler, worker, beat, flower, dispatch, show, costs, bundle):
        app.command(command.__name__)(command)


def _runtime() -> Any:
    from corral.processes import prepare

    try:
        return prepare()
    except CorralError as exc:
        raise fail(exc.message) from exc


# -- processes -----------------------------------------------------------------------------


def dev(
    demo: Annotated[bool, typer.Option(help="Dispatch demo items, print a table, exit.")] = False,
    port: Annotated[int, typer.Option(help="api TCP port; 0 picks a free one.")] = 0,
) -> None:
    """Everything in one process: SQLite, in-process broker, local provider, api."""
    from corral.demo import run_demo
    from corral.dev import DEMO_STATE_PREFIX, dev_settings, running_stack, serve_forever
    from corral.processes import configure_logging

    configure_logging("WARNING")
    # The in-process broker has no host; kombu would warn about that on every connection.
    logging.getLogger("kombu.connection").setLevel(logging.ERROR)
    settings = dev_settings(demo=demo, port=port)
    if not demo:
        serve_forever(settings)
        return
    try:
        with running_stack(settings) as stack:
            ok = run_demo(stack.runtime, stack.api_url, stack.admin_token)
    finally:
        if settings.state_dir.name.startswith(DEMO_STATE_PREFIX):
            shutil.rmtree(settings.state_dir, ignore_errors=True)
    if not ok:
        raise fail("some demo items did not end as expected (see the table)", code=1)


def api(
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
    """Serve the HTTP api (CORRAL_API_HOST/PORT, and CORRAL_API_SOCKET)."""
    from corral.processes import configure_logging, run_api

    configure_logging()
    _guarded(run_api, unix=unix, metrics_port=metrics_port, metrics_host=metrics_host)


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
    from corral.processes import configure_logging, run_scheduler

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
    from corral.processes import configure_logging, run_maintenance_worker, run_provider_worker

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
    from corral.processes import configure_logging, run_beat

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
    from corral.shared.db import make_engine
    from corral.shared.migrate import upgrade

    engine = make_engine()
    upgrade(engine)
    typer.echo(f"database at the newest schema: {engine.url.render_as_string()}")
    engine.dispose()


# -- admin ---------------------------------------------------------------------------------


def _json_option(value: str | None, name: str) -> Any:
    if value is None:
        return None
    try:
        return json.loads(value)
    except json.JSONDecodeError as exc:
        raise fail(f"{name} is not valid JSON: {exc.msg}") from exc


@pools_app.command("create")
def pools_create(
    *,
    org: Annotated[str, typer.Option()],
    name: Annotated[str, typer.Option()],
    provider: Annotated[str, typer.Option()],
    priority: Annotated[int, typer.Option()] = 0,
    max_concurrent: Annotated[int, typer.Option()] = 10,
    runtime_provides: Annotated[
        str | None, typer.Option(help='JSON: {"runtimeKinds": [...], "requirementKinds": [...]}')
    ] = None,
    capabilities: Annotated[str | None, typer.Option(help="JSON: matrix overrides")] = None,
    sandbox_config: Annotated[
        str | None,
        typer.Option(
            help="JSON: the provider's options for this pool's sandboxes, e.g. "
            '\'{"image": "corral-sandbox:dev"}\' (`corral providers schema NAME` lists them)'
        ),
    ] = None,
    inactive: Annotated[bool, typer.Option(help="Create it switched off.")] = False,
    billing_model: Annotated[
        str | None, typer.Option(help="wall-clock, fixed or active-cpu (default: the provider's)")
    ] = None,
    rate_micros: Annotated[
        int, typer.Option(help="Micro-units per second, per session or per CPU second.")
    ] = 0,
) -> None:
    """Create a capacity pool for an org."""
    from corral.scheduler.admin import AdminError, PoolCreate, create_pool

    try:
        request = PoolCreate.model_validate(
            {
                "org_id": org,
                "name": name,
                "provider_id": provider,
                "priority": priority,
                "max_concurrent": max_concurrent,
                "active": not inactive,
                "runtime_provides": _json_option(runtime_provides, "--runtime-provides"),
                "capabilities": _json_option(capabilities, "--capabilities"),
                "sandbox_config": _json_option(sandbox_config, "--sandbox-config") or {},
                "billing_model": billing_model,
                "rate_micros": rate_micros,
            }
        )
        pool = create_pool(_runtime().db, request)
    except ValidationError as exc:
        raise fail(describe_field_errors(field_errors(exc, PoolCreate))) from exc
    except AdminError as exc:
        raise fail(exc.message) from exc
    typer.echo(json.dumps(pool, indent=2))


@pools_app.command("list")
def pools_list(org: Annotated[str | None, typer.Option()] = None) -> None:
    """List pools."""
    from corral.scheduler.admin import list_pools

    typer.echo(json.dumps(list_pools(_runtime().db, org), indent=2))


@profiles_app.command("create")
def profiles_create(
    name: Annotated[str, typer.Option()],
    model: Annotated[str, typer.Option()],
    auth_mode: Annotated[str, typer.Option(help="local, host-session, byok, metered, shared")],
) -> None:
    """Create or update a model profile."""
    from corral.scheduler.admin import ProfileCreate, create_profile

    try:
        request = ProfileCreate.model_validate(
            {"name": name, "model": model, "auth_mode": auth_mode}
        )
    except ValidationError as exc:
        raise fail(describe_field_errors(field_errors(exc, ProfileCreate))) from exc
    typer.echo(json.dumps(create_profile(_runtime().db, request)))


@profiles_app.command("list")
def profiles_list() -> None:
    """List model profiles."""
    from corral.scheduler.admin import list_profiles

    typer.echo(json.dumps(list_profiles(_runtime().db), indent=2))


# -- work ----------------------------------------------------------------------------------


def dispatch(
    command: Annotated[
        list[str] | None, typer.Argument(help="The shell command, after --.")
    ] = None,
    *,
    org: Annotated[str, typer.Option()] = "",
    project: Annotated[str, typer.Option()] = "",
    profile: Annotated[str, typer.Option()] = "default",
    code_file: Annotated[Path | None, typer.Option(help="Python file defining main().")] = None,
    arg: Annotated[list[str] | None, typer.Option(help="key=JSON argument for main()")] = None,
    install: Annotated[list[str] | None, typer.Option(help="An install command.")] = None,
    requires: Annotated[list[str] | None, typer.Option(help="A requirement kind.")] = None,
    network: Annotated[bool, typer.Option(help="Give the sandbox network.")] = False,
    provider: Annotated[str | None, typer.Option(help="Only pools of this provider.")] = None,
    idempotency_key: Annotated[str | None, typer.Option()] = None,
    wait: Annotated[bool, typer.Option(help="Follow the item to its end.")] = False,
    timeout: Annotated[float, typer.Option(help="With --wait: give up after this long.")] = 600,
) -> None:
    """Dispatch one item, e.g. `corral dispatch --org acme --project web -- echo hi`."""
    from corral.scheduler.intake import accept
    from corral.shared.celery_app import app as celery_app

    message: dict[str, Any] = {
        "org": org,
        "project": project,
        "profile": profile,
        "work": _work(command, code_file, arg),
        "egress": {"allow_network": network},
        "toolchain": {"install_commands": install or []},
        "agent_card": {"requires": [{"kind": kind} for kind in requires or []]},
        "provider": provider,
        "idempotency_key": idempotency_key,
    }
    try:
        request = DispatchRequest.model_validate(message)
    except ValidationError as exc:
        raise fail(f"invalid dispatch: {describe_field_errors(field_errors(exc))}") from exc
    rt = _runtime()
    accepted = accept(rt.db, request, actor="cli")
    if accepted.created:
        celery_app.send_task("corral.route", args=[accepted.item_id])
    typer.echo(accepted.item_id)
    if wait:
        view = _follow(rt, accepted.item_id, timeout)
        typer.echo(json.dumps(view, indent=2))
        if view["state"] != "succeeded":
            raise typer.Exit(1)


def _work(command: list[str] | None, code_file: Path | None, args: list[str] | None) -> Any:
    if code_file is not None:
        arguments = {}
        for pair in args or []:
            key, _, raw = pair.partition("=")
            arguments[key] = _json_option(raw, f"--arg {key}")
        return {"kind": "code", "code": code_file.read_text(), "arguments": arguments}
    if not command:
        raise fail("give a command after --, or --code-file")
    return {"kind": "shell", "command": " ".join(command)}


def _follow(rt: Any, item_id: str, timeout: float) -> dict[str, Any]:
    from corral.inspect import item_view
    from corral.shared.models import ItemState

    deadline = time.monotonic() + timeout
    while True:
        view = item_view(rt.db, item_id)
        if ItemState(view["state"]).is_final:
            return view
        if time.monotonic() > deadline:
            raise fail(f"{item_id} is still {view['state']} after {timeout:.0f}s", code=1)
        time.sleep(0.3)


def show(
    item_id: str,
    output_format: Annotated[str, typer.Option("--format", help="text or json")] = "text",
) -> None:
    """Show a work item: state, pool, queue, sandbox, result or error, and its log."""
    from corral.inspect import item_view, render_text

    try:
        view = item_view(_runtime().db, item_id)
    except LookupError as exc:
        raise fail(str(exc)) from exc
    typer.echo(json.dumps(view, indent=2) if output_format == "json" else render_text(view))
