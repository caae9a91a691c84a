"""``corral show``: a work item as text or JSON."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from corral.scheduler.admin.views import load_item_view, load_log_lines
from corral.shared.store import estimates, secrets
from corral.shared.store.bundle_records import bundle_events
from corral.shared.store.db import Database


def item_view(db: Database, item_id: str, *, max_attempts: int) -> dict[str, Any]:
    """The api's view of the item plus its log lines (``max_attempts``: the deployment's)."""
    view = load_item_view(db, item_id, max_attempts=max_attempts)
    with db.session() as session:
        if view["bundle"] is not None:
            view["bundle"]["events"] = bundle_events(session, item_id)
        view["secret_uses"] = secrets.uses_of(session, item_id)  # names, never values
    view["logs"] = [f"[{line['stream']}] {line['line']}" for line in load_log_lines(db, item_id)]
    return view


def render_text(view: dict[str, Any]) -> str:
    sandbox = view["sandbox"] or {}
    lines = [
        f"work item  {view['id']}  ({view['org']}/{view['project']})",
        f"state      {view['state']}",
        f"pool       {_pool(view)}   queue {view['queue'] or '-'}",
        f"sandbox    {sandbox.get('id', '-')}  {sandbox.get('provider_id', '')} "
        f"{sandbox.get('status', '')}",
        f"exit code  {view['exit_code'] if view['exit_code'] is not None else '-'}"
        f"   duration {view['duration_s'] if view['duration_s'] is not None else '-'}",
    ]
    if view["result"] is not None:
        lines.append(f"result     {json.dumps(view['result'])}")
    if view["error"]:
        lines.append(f"error      {view['error']['code']}: {view['error']['message']}")
    if (waiting := view.get("waiting")) and waiting.get("until"):  # its provider's pace
        lines.append(
            f"waiting    {waiting['reason']} ({', '.join(waiting['pools'])}) until "
            f"{waiting['until'][:23]}; {waiting['ahead']} of its pool's paced items before it"
        )
    elif waiting:
        pools = ", ".join(waiting["pools"]) or "any of its org's"
        lines.append(
            f"waiting    {waiting['reason']} ({pools}); {waiting['ahead']} of its org's items "
            f"ahead of it, priority {waiting['priority']}"
        )
    if waiting:
        lines.append(f"starts     {estimates.said(waiting)}")
    for use in view.get("secret_uses", []):
        lines.append(
            f"secret     {use['name']} ({use['scope']}) -> {use['used_in']} {use['target']} "
            f"at {use['at'][:19]}"
        )
    if sandbox.get("end_log"):
        lines.append("end log    the last lines of its provider's log of the sandbox")
        lines += [f"  {line}" for line in sandbox["end_log"].split("\n")]
    if view.get("bundle"):
        lines += _bundle_lines(view["bundle"])
    if view["logs"]:
        lines.append("log")
        lines += [f"  {line}" for line in view["logs"]]
    return "\n".join(lines)


def _pool(view: dict[str, Any]) -> str:
    """The pool's name and id, as the console shows it (``-`` before routing)."""
    if not view["pool_id"]:
        return "-"
    return f"{view['pool']} ({view['pool_id']})" if view["pool"] else view["pool_id"]


def _bundle_lines(bundle: dict[str, Any]) -> list[str]:
    lines = [
        f"bundle     {bundle['changes']} changes, {bundle['content_bytes']} bytes, "
        f"{bundle['refused']} refused; review {bundle['review']} (corral bundle ITEM)"
    ]
    for event in bundle.get("events", []):
        lines.append(
            f"  {event['at']}  {event['from'] or '-'} -> {event['to']}  by {event['actor']}"
        )
    return lines


def format_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """Columns padded to their widest cell, two spaces apart, no trailing blanks."""
    lines = [list(header), *(list(row) for row in rows)]
    widths = [max(len(cell) for cell in column) for column in zip(*lines, strict=True)]
    return "\n".join(
        "  ".join(cell.ljust(width) for cell, width in zip(line, widths, strict=True)).rstrip()
        for line in lines
    )
