"""``corral costs`` and ``corral sandboxes list``: the ledger and the sandboxes, read from the
database (the same views as ``GET /v1/costs`` and ``GET /v1/sandboxes``)."""

from __future__ import annotations

import json
from typing import Annotated, Any

import typer

from corral.cli.output import FormatOption, OutputFormat, fail, runtime

sandboxes_app = typer.Typer(help="Sandboxes: where each attempt ran and why it ended.")


def _runtime() -> Any:
    return runtime()


def costs(
    org: Annotated[str | None, typer.Option(help="Only this org.")] = None,
    since: Annotated[str | None, typer.Option(help="24h, 7d, 30m, or an ISO 8601 time.")] = None,
    by: Annotated[str, typer.Option(help="pool, provider, project or org")] = "provider",
    output_format: FormatOption = OutputFormat.TEXT,
) -> None:
    """Cost totals from the ledger: one cost event per sandbox, grouped (pools by org/name,
    a deleted one by its id)."""
    from corral.cli.inspect import format_table
    from corral.scheduler.admin.views import cost_view
    from corral.shared.store.ledger import CostGrouping, parse_since

    try:
        grouping = CostGrouping(by)
    except ValueError:
        raise fail(f"--by must be one of {', '.join(g.value for g in CostGrouping)}") from None
    try:
        start = parse_since(since) if since else None
    except ValueError as exc:
        raise fail(str(exc)) from exc
    rt = _runtime()
    db = rt.db
    view = cost_view(db, by=grouping, org_id=org, since=start)
    if grouping is CostGrouping.POOL:
        names = pool_names(db, org)
        for row in view["rows"]:
            row["pool_name"] = names.get(row["pool"])
    if output_format == "json":
        typer.echo(json.dumps(view, indent=2))
        return
    rows = [
        [
            row.get("pool_name") or row[grouping.value],
            str(row["events"]),
            f"{row['seconds']:.1f}",
            row["amount"],
            str(row["cpu_estimated_events"]),
        ]
        for row in view["rows"]
    ]
    total = view["total"]
    rows.append(["total", str(total["events"]), f"{total['seconds']:.1f}", total["amount"], ""])
    amount = f"amount ({rt.settings.cost_unit})"  # CORRAL_COST_UNIT, as the console says
    typer.echo(format_table([grouping.value, "events", "seconds", amount, "cpu estimated"], rows))


def pool_names(db: Any, org: str | None) -> dict[str, str]:
    """``org/name`` of each pool by its id, as the console shows them; a deleted pool has
    none (it is shown by its id)."""
    from corral.scheduler.admin.pools import list_pools

    return {pool["id"]: f"{pool['org_id']}/{pool['name']}" for pool in list_pools(db, org)}


@sandboxes_app.command("list")
def sandboxes_list(
    status: Annotated[
        list[str] | None,
        typer.Option(help="provisioning, ready, running, terminated or failed; repeatable."),
    ] = None,
    org: Annotated[str | None, typer.Option(help="Only this org's.")] = None,
    limit: Annotated[int, typer.Option(min=1, max=1000, help="At most this many.")] = 50,
    output_format: FormatOption = OutputFormat.TEXT,
) -> None:
    """Sandboxes, newest first."""
    from corral.cli.inspect import format_table
    from corral.providers.base import SandboxState
    from corral.scheduler.admin.views import list_sandboxes

    known = {s.value for s in SandboxState}
    unknown = sorted(set(status or []) - known)
    if unknown:
        raise fail(f"unknown status {', '.join(unknown)}; known: {', '.join(sorted(known))}")
    found = list_sandboxes(_runtime().db, statuses=status, org_id=org, limit=limit)
    if output_format == "json":
        typer.echo(json.dumps(found, indent=2))
        return
    rows = [
        [
            s["id"],
            s["work_item_id"],
            s["provider_id"],
            s["status"],
            s["started_at"] or "-",
            s["terminated_at"] or "-",
            s["termination_reason"] or "-",
        ]
        for s in found
    ]
    typer.echo(
        format_table(
            ["sandbox", "work item", "provider", "status", "started", "ended", "reason"], rows
        )
    )
