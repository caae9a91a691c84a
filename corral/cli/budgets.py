"""``corral budgets``: spend caps per org or pool and period, and the spend against them."""

from __future__ import annotations

import json
from typing import Annotated

import typer
from pydantic import ValidationError

from corral.cli.output import FormatOption, OutputFormat, fail, fail_fields, runtime

budgets_app = typer.Typer(
    help="Spend caps: routing refuses an org's (or a pool's) new work past them, and a "
    "budget that stops also ends its running sandboxes."
)


@budgets_app.command("set")
def budgets_set(
    *,
    org: Annotated[str, typer.Option(help="The org whose spend it caps.")],
    period: Annotated[str, typer.Option(help="day, week or month (UTC calendar periods)")],
    cap_micros: Annotated[int, typer.Option(help="The cap, in micro-units of the rate cards.")],
    pool: Annotated[
        str | None, typer.Option(help="A pool's name: cap that pool only (default: the org).")
    ] = None,
    on_cap: Annotated[
        str, typer.Option(help="At the cap: refuse new work, or also stop running sandboxes.")
    ] = "refuse",
    threshold: Annotated[
        list[int] | None,
        typer.Option(help="A percentage of the cap to warn of (repeat; default 50, 80, 100)."),
    ] = None,
    set_by: Annotated[
        str, typer.Option(help="Whose budget: deployment (default) or the org's own.")
    ] = "deployment",
) -> None:
    """Set a budget (it replaces the one of the same org or pool, period and owner)."""
    from corral.scheduler.admin.budgets import BudgetSet, set_budget
    from corral.scheduler.admin.pools import AdminError

    fields: dict[str, object] = {
        "org_id": org,
        "pool": pool,
        "period": period,
        "cap_micros": cap_micros,
        "on_cap": on_cap,
        "thresholds": threshold or None,
        "set_by": set_by,
    }
    try:
        request = BudgetSet.model_validate(fields)
        stored = set_budget(runtime().db, request)
    except ValidationError as exc:
        raise fail_fields(exc, BudgetSet) from exc
    except AdminError as exc:
        raise fail(exc.message) from exc
    typer.echo(f"budget {stored['id']}: {_line(stored)}")


@budgets_app.command("list")
def budgets_list(
    org: Annotated[str | None, typer.Option(help="Only this org's budgets.")] = None,
    output_format: FormatOption = OutputFormat.TEXT,
) -> None:
    """Budgets with this period's spend against each cap."""
    from corral.cli.inspect import format_table
    from corral.scheduler.admin.budgets import list_budgets
    from corral.shared.store.ledger import format_micros

    rt = runtime()
    rows = list_budgets(rt.db, org)
    if output_format == OutputFormat.JSON:
        typer.echo(json.dumps(rows, indent=2))
        return
    table = [
        [
            b["org_id"],
            b["pool"] or "(org)",
            b["period"],
            b["set_by"],
            format_micros(b["spent_micros"]),
            format_micros(b["cap_micros"]),
            b["on_cap"],
            "EXHAUSTED" if b["exhausted"] else "ok",
            b["id"],
        ]
        for b in rows
    ]
    unit = rt.settings.cost_unit
    spent, cap = f"spent ({unit})", f"cap ({unit})"
    header = ["org", "pool", "period", "set by", spent, cap, "at cap", "state", "id"]
    typer.echo(format_table(header, table) if table else "no budgets")


@budgets_app.command("delete")
def budgets_delete(budget_id: Annotated[str, typer.Argument(help="The budget's id.")]) -> None:
    """Remove a budget: routing no longer checks it."""
    from corral.scheduler.admin.budgets import delete_budget
    from corral.scheduler.admin.pools import AdminError

    try:
        delete_budget(runtime().db, budget_id)
    except AdminError as exc:
        raise fail(exc.message) from exc
    typer.echo(f"deleted budget {budget_id}")


def _line(budget: dict[str, object]) -> str:
    from corral.shared.store.ledger import format_micros

    whose = (
        f"pool {budget['pool']} of org {budget['org_id']}"
        if budget["pool"]
        else f"org {budget['org_id']}"
    )
    spent, cap = (
        format_micros(int(str(budget["spent_micros"]))),
        format_micros(int(str(budget["cap_micros"]))),
    )
    return (
        f"{whose}, this {budget['period']}: spent {spent} of {cap} "
        f"(set by the {budget['set_by']}; at the cap: {budget['on_cap']})"
    )
