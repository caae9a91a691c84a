"""``corral status``: the deployment on one screen. Processes (Celery inspect, short
timeout), the api, queues and their lengths, the queues items wait on that no worker
consumes, pools with their slots and substrate, the shared capacities with each org's
weight and share, work items by state, and recent failures by error code."""

from __future__ import annotations

import json
from datetime import timedelta
from typing import Annotated, Any

import typer

from corral.cli.output import FormatOption, OutputFormat, cell, runtime

INSPECT_TIMEOUT_S = 1.0


def in_process_broker(broker_url: str) -> bool:
    """memory:// lives inside one process: another process can neither see nor reach it."""
    return broker_url.startswith("memory://")


def consumers(timeout_s: float = INSPECT_TIMEOUT_S) -> dict[str, list[str]]:
    """Each process that answered Celery's ``inspect active_queues`` within ``timeout_s``,
    and the queues it consumes. Raises whatever the broker connection raises."""
    from corral.shared.broker.celery_app import app

    replies = app.control.inspect(timeout=timeout_s).active_queues() or {}
    return {node: sorted(q["name"] for q in queues or []) for node, queues in replies.items()}


def queue_lengths(names: list[str]) -> dict[str, int | None]:
    """Messages waiting on each queue (None: it could not be read)."""
    from corral.shared.broker.celery_app import app

    lengths: dict[str, int | None] = {}
    with app.connection_for_read() as connection:
        connection.ensure_connection(max_retries=1, timeout=2)
        for name in names:
            try:
                with connection.channel() as channel:
                    lengths[name] = _length(channel, name)
            except Exception:  # no such queue yet, or the broker refused the question
                lengths[name] = None
    return lengths


def _length(channel: Any, name: str) -> int:
    # kombu's virtual transports (Redis) count a queue's keys with _size, priorities and key
    # prefix included; their passive queue_declare misses a prefixed queue. AMQP brokers
    # answer a passive declare with the count.
    size = getattr(channel, "_size", None)
    if size is not None:
        return int(size(name))
    return int(channel.queue_declare(queue=name, passive=True).message_count)


def _processes(rt: Any) -> dict[str, Any]:
    if in_process_broker(rt.settings.broker_url):
        return {"note": "the broker is in-process (memory://): only `corral dev` sees it"}
    try:
        found = consumers()
    except Exception as exc:  # the broker cannot be reached
        return {"error": _unanswered(rt, exc)}
    return {"nodes": found}


def _queues(rt: Any, providers: set[str]) -> dict[str, Any]:
    from corral.shared.broker.queues import DISPATCH_QUEUE, MAINTENANCE_QUEUE, provider_queues

    if in_process_broker(rt.settings.broker_url):
        return {"note": "in-process broker: its queues live inside `corral dev`"}
    names = [DISPATCH_QUEUE, MAINTENANCE_QUEUE]
    for provider_id in sorted(providers):
        names += provider_queues(provider_id)
    try:
        return {"lengths": queue_lengths(names)}
    except Exception as exc:  # the broker cannot be reached
        return {"error": _unanswered(rt, exc)}


def _unanswered(rt: Any, exc: BaseException) -> str:
    from kombu.utils.url import sanitize_url

    return (
        f"the broker at {sanitize_url(rt.settings.broker_url)} (CORRAL_BROKER_URL) did not "
        f"answer ({type(exc).__name__})"
    )


def gather(rt: Any, since: timedelta) -> dict[str, Any]:
    """Everything ``corral status`` shows, as one JSON-able document."""
    from corral.cli.api_target import api_answers, api_target
    from corral.scheduler.admin.capacities import list_capacities
    from corral.scheduler.admin.overview import (
        failures_by_code,
        items_by_state,
        pool_rows,
        unserved_queues,
    )

    target = api_target(rt.settings)
    pools = pool_rows(rt.db)
    return {
        "processes": _processes(rt),
        "api": {"url": target.url, "from": target.url_from, "answered": api_answers(target)},
        "queues": _queues(rt, {pool["provider"] for pool in pools}),
        "unserved": unserved_queues(rt.db),
        "pools": pools,
        "capacities": [
            {k: v for k, v in capacity.items() if k not in ("created_at", "updated_at")}
            for capacity in list_capacities(rt.db)
        ],
        "items": items_by_state(rt.db),
        "failures": {"since_hours": since.total_seconds() / 3600, **failures_by_code(rt.db, since)},
    }


def status(
    hours: Annotated[
        float, typer.Option(help="Count failures of the last this many hours.", min=0)
    ] = 24,
    output_format: FormatOption = OutputFormat.TEXT,
) -> None:
    """The deployment on one screen: processes, api, queues, pools, items, failures."""
    from corral.cli.failures import EXIT_UNREACHABLE

    document = gather(runtime(), timedelta(hours=hours))
    if output_format == OutputFormat.JSON:
        typer.echo(json.dumps(document, indent=2))
    else:
        typer.echo("\n".join(render(document)))
    if "error" in document["processes"]:  # all the rest is shown; a script learns it too
        raise SystemExit(EXIT_UNREACHABLE)


def render(document: dict[str, Any]) -> list[str]:
    from corral.cli.inspect import format_table

    lines = [f"processes (Celery inspect, {INSPECT_TIMEOUT_S:.0f} s)"]
    lines += _indent(_render_processes(document["processes"]))
    api = document["api"]
    answered = "answers" if api["answered"] else "does not answer"
    lines += ["", f"api  {api['url']} {answered} (from {api['from']})", "", "queues"]
    queues = document["queues"]
    if "lengths" in queues:
        rows = [[name, cell(length)] for name, length in queues["lengths"].items()]
        lines += _indent(format_table(["queue", "waiting"], rows).splitlines())
    else:
        lines += _indent([queues.get("note") or queues["error"]])
    lines += _render_unserved(document["unserved"])
    lines += ["", "pools"]
    rows = [
        [
            p["org"],
            p["name"],
            p["provider"],
            "active" if p["active"] else "disabled",
            f"{p['slots_in_use']}/{p['slot_limit']}",
            p["waiting"],
            p.get("breaker", "closed"),
            "invalid runtime_provides" if p.get("problem") else _kinds(p["runtime_kinds"]),
            _kinds(p["requirement_kinds"]),
        ]
        for p in document["pools"]
    ]
    header = [
        "org",
        "pool",
        "provider",
        "state",
        "slots",
        "waiting",
        "breaker",
        "runtime kinds",
        "requirement kinds",
    ]
    lines += _indent(format_table(header, rows).splitlines() if rows else ["no pools"])
    lines += _render_capacities(document["capacities"])
    items = document["items"]
    lines += ["", "work items by state"]
    lines += _indent([", ".join(f"{s} {n}" for s, n in items.items()) or "none"])
    failures = document["failures"]
    lines += ["", f"failures in the last {failures['since_hours']:g} h, by code"]
    lines += _indent([", ".join(f"{c} {n}" for c, n in failures["codes"].items()) or "none"])
    return lines


def _render_capacities(capacities: list[dict[str, Any]]) -> list[str]:
    """The shared capacities, each pool on one with its org's weight and share (none: no
    lines)."""
    from corral.cli.capacities import MEMBER_HEADER, member_rows
    from corral.cli.inspect import format_table

    if not capacities:
        return []
    rows = [
        [f"{c['name']} ({c['slots_in_use']}/{c['slots']})", *row]
        for c in capacities
        for row in member_rows(c) or [["-"] * len(MEMBER_HEADER)]
    ]
    table = format_table(["capacity (held/slots)", *MEMBER_HEADER], rows)
    return ["", "shared capacities", *_indent(table.splitlines())]


def _render_unserved(unserved: list[dict[str, Any]]) -> list[str]:
    """A line per queue items wait on that no worker consumes (none: no lines)."""
    lines = []
    for queue in unserved:
        provider = queue["queue"].removeprefix("provision.").removesuffix(".gpu")
        lines.append(
            f"  UNSERVED {queue['queue']}: {queue['items']} item(s) routed, the oldest at "
            f"{queue['oldest_routed_at'] or '?'}, and no worker consumes it: start "
            f"`corral worker --provider {provider}` (they fail as no_worker after the pool's "
            "routed TTL)"
        )
    return lines


def _render_processes(processes: dict[str, Any]) -> list[str]:
    if "nodes" not in processes:
        return [processes.get("note") or processes["error"]]
    nodes = processes["nodes"]
    if not nodes:
        return ["none answered: start `corral scheduler` and `corral worker ...` (or `corral dev`)"]
    return [f"{node}  {', '.join(queues) or '-'}" for node, queues in sorted(nodes.items())]


def _kinds(kinds: list[str], shown: int = 4) -> str:
    """The first few kinds and how many more (`--format json` lists them all)."""
    more = f" +{len(kinds) - shown}" if len(kinds) > shown else ""
    return ",".join(kinds[:shown]) + more if kinds else "-"


def _indent(lines: list[str]) -> list[str]:
    return [f"  {line}" for line in lines]
