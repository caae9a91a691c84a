"""``corral flower``: Flower, Celery's web monitor, on corral's broker and queues.

Flower runs on corral's own Celery app, configured from the settings like every other
process, so it reads the same broker, the same key prefix (``CORRAL_BROKER_KEY_PREFIX``,
which Flower's Redis broker view takes from ``broker_transport_options["global_keyprefix"]``
to count queue lengths) and the same queue table. Flower's own settings that corral does not
set (``FLOWER_BASIC_AUTH``, ``FLOWER_UNAUTHENTICATED_API``, ...) are read from the
environment as usual.

What Flower shows of task arguments: corral's tasks carry ids only, except
``corral.dispatch``, whose one argument is the whole dispatch message (env values may be
secrets). Its workers replace that argument by a summary of ids in every event they send
(:class:`corral.scheduler.tasks.DispatchTaskRequest`); an upstream sender with "task-sent" events
on still sends its own ``repr`` of the message, so Flower drops the arguments of any
``corral.dispatch`` event that are not such a summary before it stores the event.
"""

# Like the other commands, this one imports its subsystem when it runs, so that importing
# the command (for `corral --help`) loads neither Celery nor Flower.

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable, Mapping
from typing import Annotated, Any

import typer

DISPATCH_TASK = "corral.dispatch"
TASK_COLUMNS = "name,uuid,state,args,routing_key,worker,received,runtime"
"""Flower's tasks page columns: its default, plus the arguments (ids only) and the queue."""


def flower(
    port: Annotated[int, typer.Option(help="HTTP port of the Flower UI and API.")] = 5555,
    address: Annotated[
        str, typer.Option(help="Address to listen on (0.0.0.0: every interface).")
    ] = "127.0.0.1",
    read_only: Annotated[
        bool,
        typer.Option(
            help="Refuse Flower's control actions (shut down or resize workers, revoke, send "
            "tasks): with them, whoever reaches Flower could dispatch work past the api."
        ),
    ] = True,
    broker_api: Annotated[
        str | None,
        typer.Option(
            envvar="FLOWER_BROKER_API",
            help="RabbitMQ only: the management API Flower reads queue lengths from, e.g. "
            "http://guest:guest@rabbitmq:15672/api/ (the management plugin). Redis needs none.",
        ),
    ] = None,
) -> None:
    """Flower, the Celery monitor: workers, tasks and queue lengths of this deployment."""
    from corral.cli.processes import configure_logging
    from corral.shared.broker import celery_app
    from corral.shared.settings import CoreSettings

    configure_logging()
    app = celery_app.configure(CoreSettings())
    install_event_redaction()
    app.start(flower_arguments(port, address, read_only=read_only, broker_api=broker_api))


def flower_arguments(
    port: int, address: str, *, read_only: bool, broker_api: str | None
) -> list[str]:
    """Flower's command line for ``corral flower``'s options."""
    arguments = [
        "flower",
        f"--port={port}",
        f"--address={address}",
        f"--read_only={read_only}",
        "--persistent=False",
        f"--tasks_columns={TASK_COLUMNS}",
    ]
    if broker_api:
        if not broker_api.startswith(("http://", "https://")):
            raise typer.BadParameter(
                "give the RabbitMQ management API's URL, e.g. "
                "http://user:password@rabbitmq:15672/api/",
                param_hint="--broker-api",
            )
        arguments.append(f"--broker_api={broker_api}")
    return arguments


def install_event_redaction() -> None:
    """Make Flower redact ``corral.dispatch`` arguments in each event before storing it.

    Flower keeps its task table in ``flower.events.EventsState``, fed one event at a time
    through ``EventsState.event``; every page and API answer (``/api/tasks``,
    ``/api/task/info``, the tasks table) reads that table, so this is the one place to
    filter. Installing twice wraps once.
    """
    events = importlib.import_module("flower.events")  # flower ships no type information
    state_class = events.EventsState
    if getattr(state_class.event, "corral_redacting", False):
        return
    original: Callable[[Any, dict[str, Any]], None] = state_class.event

    @functools.wraps(original)
    def event(self: Any, event: dict[str, Any]) -> None:
        redact_event(event, self.tasks)
        original(self, event)

    event.corral_redacting = True  # type: ignore[attr-defined]
    state_class.event = event


def redact_event(event: dict[str, Any], known_tasks: Mapping[str, Any]) -> None:
    """Drop the arguments of a ``corral.dispatch`` task event unless they are the summary.

    Dropped, not replaced: Flower merges a task's events into one record, so the summary
    the worker sends in "task-received" stays whether the sender's "task-sent" event
    arrives before it or after. A task whose name is not known yet is treated as a
    dispatch.
    """
    from corral.scheduler.tasks import KWARGSREPR, SUMMARY

    if not str(event.get("type", "")).startswith("task-"):
        return
    if "args" not in event and "kwargs" not in event:
        return
    name = event.get("name")
    if name is None:
        known = known_tasks.get(event.get("uuid", ""))
        name = getattr(known, "name", None)
    if name is not None and name != DISPATCH_TASK:
        return
    args, kwargs = event.get("args"), event.get("kwargs")
    if not (isinstance(args, str) and SUMMARY.fullmatch(args) and kwargs == KWARGSREPR):
        event.pop("args", None)
        event.pop("kwargs", None)
