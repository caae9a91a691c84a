"""Where ``corral dispatch`` sends its message, and what it does once it is sent.

Through the api when one is known: ``CORRAL_API_URL``, else the api-url file ``corral dev``
leaves in its state directory, else an api answering at ``CORRAL_API_HOST:CORRAL_API_PORT``
with a token to call it (``CORRAL_API_KEY`` or ``CORRAL_ADMIN_TOKEN``). The api's answer
decides: 202 (or 200: an earlier dispatch with the same key) means stored and routed in the
same transaction; without an answer nothing is reported as dispatched, and sending it again
with its idempotency key cannot make a second item.

Only a stack without an api gets the message through its broker, as an upstream sender's:
the ``corral.dispatch`` task, which the scheduler's intake writes. So a publish that fails
leaves nothing anywhere to run later, and the database is opened before the publish (a
command that cannot read it fails before anything is sent). On an in-process broker
(``memory://``, ``corral dev``'s) nothing but that ``corral dev`` would read the message, so
without its api the command refuses.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass
from typing import Any

import typer

from corral.cli.api_target import (
    API_URL_FILE,
    FROM_HOST_PORT,
    ApiTarget,
    api_answers,
    api_target,
)
from corral.cli.dev_lock import holder
from corral.cli.output import (
    EXIT_NOT_DISPATCHED,
    EXIT_WAIT_TIMEOUT,
    OutputFormat,
    fail,
    progress,
)
from corral.shared.errors import CorralError
from corral.shared.settings import CoreSettings

DEV_START_S = 60.0  # how long a `corral dev` that holds the state directory may take to start
FOUND_WITHIN_S = 10.0  # how long a dispatch over the broker looks for its item, unless --wait
LOOK_S = 0.1


class NotDispatchedError(CorralError):
    """nothing was dispatched"""

    code = "not_dispatched"


@dataclass(frozen=True)
class ApiRoute:
    target: ApiTarget


@dataclass(frozen=True)
class BrokerRoute:
    why: str  # why not an api, for the line that says so


@dataclass(frozen=True)
class Waiting:
    """What ``--wait`` and ``--format`` ask of the command, and its settings."""

    wait: bool
    timeout_s: float
    output_format: OutputFormat
    settings: CoreSettings


def choose_route(settings: CoreSettings) -> ApiRoute | BrokerRoute:
    """The api when one is known, else the broker.

    Raises:
        NotDispatchedError: no api, and the broker is in-process: nothing would read it.
    """
    target = api_target(settings)
    if target.url_from == FROM_HOST_PORT and (dev := holder(settings.state_dir)):
        target = _started(settings, *dev)
    if target.url_from != FROM_HOST_PORT:  # CORRAL_API_URL, or corral dev's file
        return ApiRoute(target)
    if target.token is not None and api_answers(target):
        return ApiRoute(target)
    unset = f"CORRAL_API_URL is unset, no `corral dev` left {settings.state_dir / API_URL_FILE}"
    if target.token is None:
        why = f"{unset}, and no token (CORRAL_API_KEY, CORRAL_ADMIN_TOKEN) for {target.url}"
    else:
        why = f"{unset}, and no api answers at {target.url} (CORRAL_API_HOST/PORT)"
    if settings.broker_url.startswith("memory://"):
        raise NotDispatchedError(
            f"no api to dispatch through: {why}; and the broker is in-process (memory://), so "
            "nothing would run the item. Start `corral dev` (with this CORRAL_STATE_DIR), or "
            "set CORRAL_API_URL, or CORRAL_BROKER_URL and CORRAL_DATABASE_URL for your stack"
        )
    return BrokerRoute(why)


def _started(settings: CoreSettings, pid: int, url: str) -> ApiTarget:
    """The api of the ``corral dev`` starting on this state directory, once it has said where
    it is (its api-url file), within :data:`DEV_START_S`."""
    progress(f"waiting for the `corral dev` starting in {settings.state_dir} (pid {pid}, {url})")
    deadline = time.monotonic() + DEV_START_S
    while (target := api_target(settings)).url_from == FROM_HOST_PORT:
        if time.monotonic() > deadline or holder(settings.state_dir) is None:
            break
        time.sleep(LOOK_S)
    return target


def send_and_follow(
    message: dict[str, Any], *, wait: bool, timeout_s: float, output_format: OutputFormat
) -> None:
    """Send ``message`` (checked, with its idempotency key) and, with ``wait``, follow it.

    Raises:
        typer.Exit: with the status of docs/operations.md's table (corral.cli.dispatch).
    """
    settings = CoreSettings()
    key = message["idempotency_key"]
    progress(f"idempotency key: {key}")
    asked = Waiting(wait, timeout_s, output_format, settings)
    try:
        route = choose_route(settings)
        if isinstance(route, ApiRoute):
            _over_api(route.target, message, asked)
        else:
            from kombu.utils.url import sanitize_url

            broker = f"{sanitize_url(settings.broker_url)} (CORRAL_BROKER_URL)"
            progress(f"no api known ({route.why}): sending through the broker at {broker}")
            _over_broker(message, asked)
    except NotDispatchedError as exc:
        raise fail(
            f"{exc.message}. Nothing was dispatched; again with --idempotency-key {key}, it "
            "runs once",
            code=EXIT_NOT_DISPATCHED,
        ) from None


def _over_api(target: ApiTarget, message: dict[str, Any], asked: Waiting) -> None:
    where = f"the api at {target.url} (from {target.url_from})"
    if target.url_from.endswith(API_URL_FILE) and holder(asked.settings.state_dir) is None:
        where += ", left by a `corral dev` that no longer runs: start it again"
    if target.token is None:
        raise NotDispatchedError(
            f"no token to call {where}: set CORRAL_API_KEY (an org key) or CORRAL_ADMIN_TOKEN "
            "(`corral dev` leaves its own in its state directory)"
        )
    if target.url.startswith("https://"):
        answer = _post_with_client(target, target.token, message, where)
    else:
        answer = _post(target.url, target.token, message, where)
    _say_sent(answer, asked)
    if asked.wait:
        _follow_over_api(target, target.token, answer["id"], asked, where)


def _post(url: str, token: str, message: dict[str, Any], where: str) -> dict[str, Any]:
    """The api's answer to the dispatch, sent with the standard library (:mod:`.api_post`).

    Raises:
        NotDispatchedError: no answer, or the api refused it.
    """
    from corral.cli.api_post import NoAnswerError, post_dispatch, refusal

    key = message["idempotency_key"]
    try:
        answer = post_dispatch(url, token, message, key)
    except ValueError as exc:
        raise NotDispatchedError(f"{where}: {exc}") from None
    except NoAnswerError as exc:
        if exc.reached:  # sent, but its answer was lost: it may have been stored
            raise fail(
                f"{where} did not answer ({exc}): the dispatch may have been stored. Dispatch "
                f"again with --idempotency-key {key}: that answers its item, or makes it once",
                code=EXIT_NOT_DISPATCHED,
            ) from None
        raise NotDispatchedError(f"{where} did not answer: {exc}") from None
    if answer.status not in (200, 202) or not isinstance(answer.body, dict):
        raise NotDispatchedError(f"{where} refused it: {refusal(answer)}")
    return {**answer.body, "idempotency_key": key}


def _post_with_client(
    target: ApiTarget, token: str, message: dict[str, Any], where: str
) -> dict[str, Any]:
    """:func:`_post` through :class:`corral.client.Client` (an ``https://`` api)."""
    from corral.client import Client, Retry
    from corral.client.errors import ApiError, ClientError

    try:
        with Client(target.url, token, retry=Retry(attempts=3)) as client:
            sent = client.dispatch(message, idempotency_key=message["idempotency_key"])
    except ApiError as exc:
        raise NotDispatchedError(f"{where} refused it: {exc.message}") from None
    except ClientError as exc:
        raise NotDispatchedError(f"{where} did not answer: {exc.message}") from None
    answer: dict[str, Any] = sent.model_dump(mode="json")
    return answer


def _follow_over_api(
    target: ApiTarget, token: str, item_id: str, asked: Waiting, where: str
) -> None:
    from corral.cli.follow import ApiSource
    from corral.client import Client
    from corral.client.errors import ClientError

    with Client(target.url, token) as client:
        try:
            in_process = asked.settings.broker_url.startswith("memory://")
            _follow(ApiSource(client, item_id), asked, in_process=in_process)
        except ClientError as exc:
            raise fail(
                f"{where} stopped answering while {item_id} ran: {exc.message}; it goes on",
                code=EXIT_WAIT_TIMEOUT,
            ) from None


def _over_broker(message: dict[str, Any], asked: Waiting) -> None:
    from corral.cli.dispatch import MessageError, validate
    from corral.cli.failures import explain
    from corral.cli.follow import DatabaseSource, warn_if_nothing_consumes
    from corral.cli.output import runtime
    from corral.shared.broker import celery_app
    from corral.shared.broker.queues import DISPATCH_QUEUE

    try:
        validate(message)
    except MessageError as exc:
        raise NotDispatchedError(str(exc)) from None
    try:
        rt = runtime()  # the database first: once sent, the item may run
    except Exception as exc:
        if (said := explain(exc)) is None:
            raise
        raise NotDispatchedError(said) from None
    task_id = str(uuid.uuid4())
    try:
        celery_app.app.send_task(
            "corral.dispatch", args=[message], queue=DISPATCH_QUEUE, task_id=task_id
        )
    except Exception as exc:
        if (said := explain(exc)) is None:
            raise
        raise NotDispatchedError(said) from None
    scheduler = warn_if_nothing_consumes(rt)
    within = asked.timeout_s if asked.wait else (FOUND_WITHIN_S if scheduler else 0.0)
    item_id = _await_item(rt, message["org"], message["idempotency_key"], within)
    if item_id is None:
        _not_written_yet(message, task_id, asked)
        return
    source = DatabaseSource(rt, item_id)
    answer = {**_answer(source.view(), message["idempotency_key"]), "task_id": task_id}
    _say_sent(answer, asked)
    if asked.wait:
        _follow(source, asked, in_process=False)  # an in-process broker never gets here


def _answer(view: dict[str, Any], key: str) -> dict[str, Any]:
    """What the api would have answered of the item (the broker path reads it)."""
    return {
        "id": view["id"],
        "created": True,
        "state": view["state"],
        "error": view["error"],
        "idempotency_key": key,
    }


def _await_item(rt: Any, org: str, key: str, within_s: float) -> str | None:
    """The id of the item ``key`` names in ``org``, once the intake has written it."""
    from sqlalchemy import select

    from corral.shared.store.models import WorkItem

    deadline = time.monotonic() + within_s
    query = select(WorkItem.id).where(WorkItem.org_id == org, WorkItem.idempotency_key == key)
    while True:
        with rt.db.session() as session:
            found: str | None = session.scalar(query)
        if found is not None or time.monotonic() >= deadline:
            return found
        time.sleep(LOOK_S)


def _not_written_yet(message: dict[str, Any], task_id: str, asked: Waiting) -> None:
    said = (
        f"sent as task {task_id}, but no scheduler has written it yet: it runs once one takes "
        f"the dispatch queue (`corral items list --org {message['org']}` shows it then)"
    )
    if asked.wait:
        raise fail(f"{said}; waited {asked.timeout_s:g} s", code=EXIT_WAIT_TIMEOUT)
    progress(said)
    if asked.output_format == OutputFormat.JSON:
        answer = {"id": None, "idempotency_key": message["idempotency_key"], "task_id": task_id}
        typer.echo(json.dumps(answer, indent=2))


def _say_sent(answer: dict[str, Any], asked: Waiting) -> None:
    """Print what was dispatched: its id (or, without --wait, the answer as JSON); a
    dispatch error ends the command with its status."""
    if asked.output_format == OutputFormat.TEXT:
        typer.echo(answer["id"])
    elif not asked.wait:
        typer.echo(json.dumps(answer, indent=2))
    if not answer.get("created", True):
        progress(f"an earlier dispatch with this key made {answer['id']}: it is {answer['state']}")
    if answer["state"] == "dispatch_error":
        error = answer["error"] or {}
        raise fail(
            f"{answer['id']} is a dispatch error, {error.get('code')}: {error.get('message')}",
            code=EXIT_NOT_DISPATCHED,
        )


def _follow(source: Any, asked: Waiting, *, in_process: bool) -> None:
    """Follow the item to its end and exit with what it ended as."""
    from corral.cli.follow import WaitEndedError, exit_code_of, follow

    stall_s = max(10.0, 2 * asked.settings.redrive_interval_s + 2)
    text = asked.output_format == OutputFormat.TEXT
    try:
        view, lines = follow(
            source, asked.timeout_s, stall_s=stall_s, in_process=in_process, stream=text
        )
    except WaitEndedError as exc:
        raise fail(str(exc), code=EXIT_WAIT_TIMEOUT) from None
    if not text:
        typer.echo(json.dumps({**view, "logs": lines}, indent=2))
    elif view["result"] is not None:
        typer.echo(json.dumps(view["result"]))
    code = exit_code_of(view)
    if code:
        raise typer.Exit(code)
