"""Work items from the command line: ``corral items list``, ``cancel``, ``logs [-f]``."""

from __future__ import annotations

import json
import time
from typing import Annotated

import typer

from corral.cli.output import (
    FormatOption,
    OutputFormat,
    RawOption,
    cell,
    echo_work_text,
    fail,
    runtime,
)

items_app = typer.Typer(help="Work items: list them; `corral show ID` for one.")

POLL_S = 0.3


@items_app.command("list")
def items_list(
    org: Annotated[str | None, typer.Option(help="Only this org's.")] = None,
    state: Annotated[
        list[str] | None,
        typer.Option(
            help="Only items in this state (received, routed, running, succeeded, failed...); "
            "repeatable."
        ),
    ] = None,
    since: Annotated[
        str | None, typer.Option(help="Created since: 24h, 7d, 30m, or an ISO 8601 time.")
    ] = None,
    limit: Annotated[int, typer.Option(min=1, max=1000, help="At most this many.")] = 50,
    output_format: FormatOption = OutputFormat.TEXT,
) -> None:
    """Work items, newest first, with their pool's name and error code."""
    from corral.cli.inspect import format_table
    from corral.scheduler.admin.views import list_items
    from corral.shared.store.ledger import parse_since
    from corral.shared.store.models import ItemState

    try:
        start = parse_since(since) if since else None
    except ValueError as exc:  # "since must be ...": name the option
        raise fail(f"--{exc}") from exc
    try:
        states = [ItemState(name) for name in state] if state else None
    except ValueError:
        raise fail(f"--state is one of {', '.join(ItemState)}") from None
    rows = list_items(runtime().db, org_id=org, states=states, since=start, limit=limit)
    if output_format == OutputFormat.JSON:
        typer.echo(json.dumps(rows, indent=2))
        return
    header = ["id", "org", "project", "state", "pool", "queue", "exit", "error", "created"]
    table = [
        [
            row["id"],
            row["org"],
            row["project"],
            row["state"],
            cell(row["pool"]),
            cell(row["queue"]),
            cell(row["exit_code"]),
            cell(row["error_code"]),
            row["created_at"][:19],
        ]
        for row in rows
    ]
    typer.echo(format_table(header, table) if table else "no work items")


def cancel(item_id: Annotated[str, typer.Argument(help="The work item id (wi-...).")]) -> None:
    """Cancel a work item that has not finished; its sandbox is ended."""
    from corral.scheduler.admin.cancellation import cancel_item

    try:
        state, cancelled = cancel_item(runtime().db, item_id, actor="cli")
    except LookupError as exc:
        raise fail(str(exc)) from exc
    if cancelled:
        typer.echo(f"{item_id} cancelled")
    else:
        typer.echo(f"{item_id} had already ended: {state.value}")


def logs(
    item_id: Annotated[str, typer.Argument(help="The work item id (wi-...).")],
    follow: Annotated[
        bool, typer.Option("--follow", "-f", help="Keep printing new lines until the item ends.")
    ] = False,
    raw: RawOption = False,
) -> None:
    """The log lines the item's runner sent: stdout on standard output, the others on
    standard error. On a terminal their control characters are shown escaped (ESC as
    \\x1b), unless --raw."""
    from corral.scheduler.admin.views import load_item_view, load_log_lines
    from corral.shared.store.models import ItemState

    rt = runtime()
    db, max_attempts = rt.db, rt.settings.max_attempts
    try:
        load_item_view(db, item_id, max_attempts=max_attempts)
    except LookupError as exc:
        raise fail(str(exc)) from exc
    after = 0
    while True:
        # Whether it had ended is read before the lines: the lines of an ended item are all in.
        ended = ItemState(load_item_view(db, item_id, max_attempts=max_attempts)["state"]).is_final
        lines = load_log_lines(db, item_id, after=after)
        for line in lines:
            echo_work_text(line["line"], err=line["stream"] != "stdout", raw=raw)
            after = line["id"]
        if lines:
            continue  # more may be waiting past this page
        if not follow or ended:
            return
        time.sleep(POLL_S)
