"""``corral capacities``: shared capacities (created, listed, shown, changed, deleted), the
slots several orgs' pools draw on, divided among the orgs by weight. A pool is put on one
with ``corral pools update NAME --org ORG --capacity CAPACITY``, an org's weight set with
``corral orgs weight``. Works on the database directly, like ``corral pools``."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Annotated, Any

import typer
from pydantic import BaseModel, ValidationError

from corral.cli.output import FormatOption, OutputFormat, cell, fail, fail_fields, runtime

capacities_app = typer.Typer(
    help="Shared capacities: slots several orgs' pools draw on, divided among the orgs by "
    "weight (`corral orgs weight`)."
)

CapacityName = Annotated[str, typer.Argument(help="The capacity's name (or its id, cap-...).")]
Slots = Annotated[int, typer.Option(help="Sandboxes at once across every pool on it.")]
MEMBER_HEADER = ["org", "pool", "weight", "held", "share", "waiting", "state"]


def member_rows(capacity: dict[str, Any]) -> list[list[str]]:
    """A row per pool on ``capacity``: its org, name, weight, slots held, share, items
    waiting for it (``N+``: counted up to a cap) and whether it is active."""
    return [
        [
            member["org_id"],
            member["pool"],
            str(member["weight"]),
            str(member["slots_in_use"]),
            cell(member["share_limit"]),
            f"{member['waiting']}{'' if member['waiting_counted_all'] else '+'}",
            "active" if member["active"] else "disabled",
        ]
        for member in capacity["pools"]
    ]


def _shown(capacity: dict[str, Any], output_format: OutputFormat) -> None:
    from corral.cli.inspect import format_table

    if output_format is OutputFormat.JSON:
        typer.echo(json.dumps(capacity, indent=2, default=str))
        return
    typer.echo(
        f"capacity {capacity['name']} ({capacity['id']}): {capacity['slots']} slots, "
        f"{capacity['slots_in_use']} in use"
    )
    rows = member_rows(capacity)
    lines = format_table(MEMBER_HEADER, rows).splitlines() if rows else ["no pools draw on it"]
    typer.echo("\n".join(f"  {line}" for line in lines))


def _stored(
    model: type[BaseModel], fields: dict[str, Any], store: Callable[[Any, Any], dict[str, Any]]
) -> None:
    """Store ``fields``, checked as ``model``, with ``store(db, request)``; show the
    capacity it answers."""
    from corral.scheduler.admin.pools import AdminError

    try:
        capacity = store(runtime().db, model.model_validate(fields))
    except ValidationError as exc:
        raise fail_fields(exc, model) from exc
    except AdminError as exc:
        raise fail(exc.message) from exc
    _shown(capacity, OutputFormat.TEXT)


@capacities_app.command("create")
def capacities_create(name: Annotated[str, typer.Argument(help="Its name.")], slots: Slots) -> None:
    """Create a shared capacity; put pools on it with `corral pools update --capacity`."""
    from corral.scheduler.admin.capacities import CapacityCreate, create_capacity

    _stored(CapacityCreate, {"name": name, "slots": slots}, create_capacity)


@capacities_app.command("list")
def capacities_list(output_format: FormatOption = OutputFormat.TEXT) -> None:
    """Every capacity: its slots, those in use and the pools on it."""
    from corral.cli.inspect import format_table
    from corral.scheduler.admin.capacities import list_capacities

    found = list_capacities(runtime().db)
    if output_format is OutputFormat.JSON:
        typer.echo(json.dumps(found, indent=2, default=str))
        return
    rows = [
        [
            c["name"],
            f"{c['slots_in_use']}/{c['slots']}",
            ", ".join(f"{m['org_id']}/{m['pool']}" for m in c["pools"]) or "-",
            c["id"],
        ]
        for c in found
    ]
    header = ["capacity", "slots", "pools", "id"]
    typer.echo(format_table(header, rows) if rows else "no capacities")


@capacities_app.command("show")
def capacities_show(name: CapacityName, output_format: FormatOption = OutputFormat.TEXT) -> None:
    """A capacity and each pool on it: org, weight, slots held, share, items waiting."""
    from corral.scheduler.admin.capacities import find_capacity
    from corral.scheduler.admin.pools import AdminError

    try:
        capacity = find_capacity(runtime().db, name)
    except AdminError as exc:
        raise fail(exc.message) from exc
    _shown(capacity, output_format)


@capacities_app.command("set")
def capacities_set(name: CapacityName, slots: Slots) -> None:
    """Change a capacity's slots; the next re-drive divides them again."""
    from corral.scheduler.admin.capacities import CapacityUpdate, update_capacity

    _stored(CapacityUpdate, {"slots": slots}, lambda db, change: update_capacity(db, name, change))


@capacities_app.command("delete")
def capacities_delete(name: CapacityName) -> None:
    """Delete a capacity; refused while pools draw on it (it names them)."""
    from corral.scheduler.admin.capacities import delete_capacity
    from corral.scheduler.admin.pools import AdminError

    try:
        delete_capacity(runtime().db, name)
    except AdminError as exc:
        raise fail(exc.message) from exc
    typer.echo(f"capacity {name} deleted")
