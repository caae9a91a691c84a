"""``corral pools``: create, list, update, disable, enable and delete capacity pools.

A pool is named by its name and ``--org`` (or by its id, pool-...)."""

from __future__ import annotations

import json
from typing import Annotated, Any

import typer
from pydantic import ValidationError

from corral.cli.output import (
    FormatOption,
    OutputFormat,
    cell,
    fail,
    fail_fields,
    json_option,
    runtime,
)

pools_app = typer.Typer(help="Capacity pools: which provider runs an org's work.")

PoolName = Annotated[str, typer.Argument(help="The pool's name (with --org), or its id.")]
CEILING_HELP = (
    "The most max_concurrent an org admin key may set (default: max_concurrent; the "
    "deployment's alone to set)."
)
RuntimeProvides = Annotated[
    str | None, typer.Option(help='JSON: {"runtimeKinds": [...], "requirementKinds": [...]}')
]
SandboxConfig = Annotated[
    str | None,
    typer.Option(
        help="JSON: the provider's options for this pool's sandboxes, e.g. "
        '\'{"image": "corral-sandbox:dev"}\' (`corral providers schema NAME` lists them)'
    ),
]
OrgOption = Annotated[str | None, typer.Option(help="The org whose pool it is.")]
LEASE_HELP = (
    'JSON: the default lease policy of its items, e.g. \'{"max_attempts": 3, '
    '"on_heartbeat_lost": "requeue", "backoff_s": 10}\' (docs/operations.md#lease-policies)'
)
WARM_MIN_HELP = "Idle warm sandboxes kept ready (docs/warm-pools.md)."
WARM_IDLE_TTL_HELP = "Seconds a warm sandbox may wait unbound."
PRIORITY_HELP = "Higher first: routing tries the org's pools by priority."
MAX_CONCURRENT_HELP = "Sandboxes of the pool at once (its slots)."
BILLING_HELP = "wall-clock, fixed or active-cpu (default: the provider's)"
RATE_HELP = "Micro-units per second, per session or per CPU second."
WarmSchedule = Annotated[
    str | None, typer.Option(help='JSON: [{"days", "start", "end", "warm_min"}], UTC windows')
]
CAPACITY_HELP = (
    "A shared capacity (by name) the pool draws on, one pool an org; its share is the "
    "re-drive's (`corral capacities`)."
)
ROUTED_TTL_HELP = (
    "Seconds an item may wait routed to the pool's queue while no worker consumes it before "
    "it fails as no_worker; 0: for ever (default: CORRAL_ROUTED_TTL_S)."
)


@pools_app.command("create")
def pools_create(
    *,
    org: Annotated[str, typer.Option(help="The org whose pool it is.")],
    name: Annotated[str, typer.Option(help="Its name, unique in the org.")],
    provider: Annotated[
        str, typer.Option(help="The provider that makes its sandboxes (`corral providers list`).")
    ],
    priority: Annotated[int, typer.Option(help=PRIORITY_HELP)] = 0,
    max_concurrent: Annotated[int, typer.Option(help=MAX_CONCURRENT_HELP)] = 10,
    max_concurrent_ceiling: Annotated[int | None, typer.Option(help=CEILING_HELP)] = None,
    runtime_provides: RuntimeProvides = None,
    capabilities: Annotated[str | None, typer.Option(help="JSON: matrix overrides")] = None,
    sandbox_config: SandboxConfig = None,
    inactive: Annotated[bool, typer.Option(help="Create it switched off.")] = False,
    billing_model: Annotated[str | None, typer.Option(help=BILLING_HELP)] = None,
    rate_micros: Annotated[int, typer.Option(help=RATE_HELP)] = 0,
    lease: Annotated[str | None, typer.Option(help=LEASE_HELP)] = None,
    warm_min: Annotated[int, typer.Option(help=WARM_MIN_HELP)] = 0,
    warm_idle_ttl_s: Annotated[int, typer.Option(help=WARM_IDLE_TTL_HELP)] = 600,
    warm_schedule: WarmSchedule = None,
    routed_ttl_s: Annotated[int | None, typer.Option(help=ROUTED_TTL_HELP)] = None,
    capacity: Annotated[str | None, typer.Option(help=CAPACITY_HELP)] = None,
) -> None:
    """Create a capacity pool for an org."""
    from corral.scheduler.admin.pools import AdminError, PoolCreate, create_pool

    try:
        request = PoolCreate.model_validate(
            {
                "org_id": org,
                "name": name,
                "provider_id": provider,
                "priority": priority,
                "max_concurrent": max_concurrent,
                "max_concurrent_ceiling": max_concurrent_ceiling,
                "active": not inactive,
                "runtime_provides": json_option(runtime_provides, "--runtime-provides"),
                "capabilities": json_option(capabilities, "--capabilities"),
                "sandbox_config": json_option(sandbox_config, "--sandbox-config") or {},
                "billing_model": billing_model,
                "rate_micros": rate_micros,
                "lease": json_option(lease, "--lease"),
                "warm_min": warm_min,
                "warm_idle_ttl_s": warm_idle_ttl_s,
                "warm_schedule": json_option(warm_schedule, "--warm-schedule"),
                "routed_ttl_s": routed_ttl_s,
                "capacity": capacity,
            }
        )
        pool = create_pool(runtime().db, request)
    except ValidationError as exc:
        raise fail_fields(exc, PoolCreate) from exc
    except AdminError as exc:
        raise fail(exc.message) from exc
    typer.echo(json.dumps(pool, indent=2))


@pools_app.command("list")
def pools_list(
    org: Annotated[str | None, typer.Option(help="Only this org's.")] = None,
    output_format: FormatOption = OutputFormat.TEXT,
) -> None:
    """List pools: name, provider, priority, slots in use of the most, active or not, and
    the shared capacity each draws on."""
    from corral.cli.inspect import format_table
    from corral.scheduler.admin.pools import list_pools

    pools = list_pools(runtime().db, org)
    if output_format == OutputFormat.JSON:
        typer.echo(json.dumps(pools, indent=2))
        return
    rows = [
        [
            p["org_id"],
            p["name"],
            p["provider_id"],
            str(p["priority"]),
            f"{p['slots_in_use']}/{p['max_concurrent']}",
            "active" if p["active"] else "disabled",
            cell(p["billing_model"]),
            cell(p["capacity"]),
            p["id"],
        ]
        for p in pools
    ]
    header = ["org", "pool", "provider", "priority", "slots", "state", "billing", "capacity", "id"]
    typer.echo(format_table(header, rows) if rows else "no pools")


def _pool_id(db: Any, org: str | None, name: str) -> str:
    from corral.scheduler.admin.pools import AdminError, find_pool

    try:
        return str(find_pool(db, org, name)["id"])
    except AdminError as exc:
        raise fail(exc.message) from exc


def _update(
    org: str | None, pool_name: str, /, cleared: tuple[str, ...] = (), **fields: Any
) -> dict[str, Any]:
    """Change the pool's ``fields`` that are given (not None), and set those ``cleared``
    back to null."""
    from corral.scheduler.admin.pools import AdminError, PoolUpdate, update_pool

    db = runtime().db  # one runtime for the command: each call would make (and leave) one
    pool_id = _pool_id(db, org, pool_name)
    try:
        update = PoolUpdate.given(cleared, **fields)
        return update_pool(db, pool_id, update, by_deployment=True)
    except ValidationError as exc:
        raise fail_fields(exc, PoolUpdate) from exc
    except AdminError as exc:
        raise fail(exc.message) from exc


@pools_app.command("update")
def pools_update(
    name: PoolName,
    *,
    org: OrgOption = None,
    new_name: Annotated[str | None, typer.Option(help="A new name for the pool.")] = None,
    priority: Annotated[int | None, typer.Option(help=PRIORITY_HELP)] = None,
    max_concurrent: Annotated[int | None, typer.Option(help=MAX_CONCURRENT_HELP)] = None,
    max_concurrent_ceiling: Annotated[int | None, typer.Option(help=CEILING_HELP)] = None,
    runtime_provides: Annotated[str | None, typer.Option(help="JSON, as for create")] = None,
    capabilities: Annotated[str | None, typer.Option(help="JSON: matrix overrides")] = None,
    sandbox_config: Annotated[str | None, typer.Option(help="JSON: the provider's options")] = None,
    billing_model: Annotated[str | None, typer.Option(help=BILLING_HELP)] = None,
    rate_micros: Annotated[int | None, typer.Option(help=RATE_HELP)] = None,
    lease: Annotated[
        str | None, typer.Option(help=f"{LEASE_HELP}; replaces the pool's, '{{}}' clears it")
    ] = None,
    warm_min: Annotated[int | None, typer.Option(help=WARM_MIN_HELP)] = None,
    warm_idle_ttl_s: Annotated[int | None, typer.Option(help=WARM_IDLE_TTL_HELP)] = None,
    warm_schedule: WarmSchedule = None,
    routed_ttl_s: Annotated[int | None, typer.Option(help=ROUTED_TTL_HELP)] = None,
    default_routed_ttl: Annotated[
        bool, typer.Option(help="Use CORRAL_ROUTED_TTL_S again (clears --routed-ttl-s).")
    ] = False,
    capacity: Annotated[str | None, typer.Option(help=CAPACITY_HELP)] = None,
    no_capacity: Annotated[
        bool,
        typer.Option(
            "--no-capacity", help="Take the pool off its shared capacity (it keeps no share)."
        ),
    ] = False,
) -> None:
    """Change a pool's settings; those not given keep their value."""
    if default_routed_ttl and routed_ttl_s is not None:
        raise fail("--routed-ttl-s and --default-routed-ttl: give one of them")
    if no_capacity and capacity is not None:
        raise fail("--capacity and --no-capacity: give one of them")
    flags = {"routed_ttl_s": default_routed_ttl, "capacity": no_capacity}
    cleared = tuple(field for field, given in flags.items() if given)
    pool = _update(
        org,
        name,
        cleared,
        name=new_name,
        priority=priority,
        max_concurrent=max_concurrent,
        max_concurrent_ceiling=max_concurrent_ceiling,
        runtime_provides=json_option(runtime_provides, "--runtime-provides"),
        capabilities=json_option(capabilities, "--capabilities"),
        sandbox_config=json_option(sandbox_config, "--sandbox-config"),
        billing_model=billing_model,
        rate_micros=rate_micros,
        lease=json_option(lease, "--lease"),
        warm_min=warm_min,
        warm_idle_ttl_s=warm_idle_ttl_s,
        warm_schedule=json_option(warm_schedule, "--warm-schedule"),
        routed_ttl_s=routed_ttl_s,
        capacity=capacity,
    )
    typer.echo(json.dumps(pool, indent=2))


@pools_app.command("fields")
def pools_fields(output_format: FormatOption = OutputFormat.TEXT) -> None:
    """Who may change each pool field: an org admin key (org) or the deployment alone."""
    from corral.scheduler.admin.pools import field_owners

    owners = field_owners()
    if output_format is OutputFormat.JSON:
        typer.echo(json.dumps(owners, indent=2))
        return
    width = max(map(len, owners))
    for name, owner in owners.items():
        typer.echo(f"{name:<{width}}  {owner}")


@pools_app.command("disable")
def pools_disable(name: PoolName, org: OrgOption = None) -> None:
    """Stop routing work to the pool; its items in flight run to their end."""
    pool = _update(org, name, active=False)
    typer.echo(f"pool {pool['name']} of {pool['org_id']} disabled")


@pools_app.command("enable")
def pools_enable(name: PoolName, org: OrgOption = None) -> None:
    """Route work to the pool again."""
    pool = _update(org, name, active=True)
    typer.echo(f"pool {pool['name']} of {pool['org_id']} enabled")


@pools_app.command("delete")
def pools_delete(name: PoolName, org: OrgOption = None) -> None:
    """Delete a pool; refused while it has work items in flight (disable it first)."""
    from corral.scheduler.admin.pools import AdminError, delete_pool

    db = runtime().db
    pool_id = _pool_id(db, org, name)
    try:
        delete_pool(db, pool_id)
    except AdminError as exc:
        raise fail(exc.message) from exc
    typer.echo(f"pool {name} deleted")
