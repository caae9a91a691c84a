"""``corral flower`` on a running corral: Flower sees the stack's workers, tasks and queues
(under the broker key prefix), and shows ids only, never tokens or dispatch secrets.

The pages are rendered by Debian's headless Chromium (Flower fills its tables by XHR);
the screenshots land in ``test-artifacts/flower/`` at the repository root.
"""

from __future__ import annotations

import json
import re
import shutil
import socket
import subprocess
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from html import unescape
from pathlib import Path
from typing import Any

import pytest
import redis
from celery import Celery
from celery.contrib.testing.mocks import TaskMessage
from sqlalchemy import select

from corral.cli.flower import redact_event
from corral.scheduler.tasks import SUMMARY, DispatchTaskRequest, dispatch, dispatch_summary
from corral.shared.store.db import Database
from corral.shared.store.models import WorkItem
from tests.acceptance.conftest import shell
from tests.acceptance.stack import REPO, Stack
from tests.conftest import require, require_bwrap_path

SECRET = "SECRET_VALUE_abc123"
ORG = "flower-org"  # this module's own org: the session's database is shared
ARTIFACTS = REPO / "test-artifacts" / "flower"
CHROMIUM_FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
WORKERS = ("scheduler", "worker-local", "maintenance")


def secret_message(key: str) -> dict[str, Any]:
    return shell(ORG, "echo hi", env={"API_TOKEN": SECRET}, idempotency_key=key)


def summary_of(key: str) -> str:
    """What Flower should show as the arguments of :func:`secret_message` ``(key)``."""
    return f"org={ORG} project=web profile=default work=shell idempotency_key={key}"


# -- the redaction, piece by piece -----------------------------------------------------------


def test_the_dispatch_summary_names_ids_only() -> None:
    message = {**secret_message("build-4711"), "work": {"kind": "shell", "command": SECRET}}
    assert dispatch_summary([message], {}) == summary_of("build-4711")
    assert dispatch_summary([], message) == dispatch_summary([message], {})
    # A secret in a field meant for an id does not come through unless it looks like an id.
    assert dispatch_summary([{"org": f"{SECRET} x", "project": ["web"]}], {}) == "org=? project=?"
    assert dispatch_summary([SECRET], {}) == "invalid=message type=str"
    assert dispatch_summary([{"a": 1}, {"b": SECRET}], {}) == "invalid=call positional=2 keyword=0"
    assert dispatch_summary([{}], {}) == "invalid=message fields=none"
    for summary in ("org=? project=?", "invalid=call positional=2 keyword=0"):
        assert SUMMARY.fullmatch(summary)


def test_a_received_dispatch_reports_the_summary_in_events_logs_and_inspection() -> None:
    message = secret_message("received-1")
    # What a sender that sets nothing itself puts in the headers: repr, secrets and all.
    headers = {"argsrepr": repr([message]), "kwargsrepr": "{}"}
    request = DispatchTaskRequest(
        TaskMessage("corral.dispatch", args=[message], **headers),
        app=dispatch.app,
        task=dispatch,
    )
    summary = summary_of("received-1")
    assert (request.argsrepr, request.kwargsrepr) == (summary, "{}")  # task-received event
    assert request.request_dict["argsrepr"] == summary  # failure logs, task context
    assert SECRET not in repr(request.info()) + repr(request.info(safe=True))  # inspect
    assert request.args == [message]  # the task itself still gets the message


def test_corral_sends_and_retries_a_dispatch_with_the_summary_in_its_headers(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    captured: dict[str, Any] = {}

    def send_task(name: str, args: Any = None, kwargs: Any = None, **options: Any) -> None:
        captured.update(options)

    # Task.apply_async hands over to app.send_task; DispatchTask.apply_async is also what
    # Task.retry (autoretry_for) sends the retry through.
    monkeypatch.setattr(dispatch.app, "send_task", send_task)
    dispatch.apply_async(args=[secret_message("sent-1")])
    assert captured["argsrepr"] == summary_of("sent-1")
    assert captured["kwargsrepr"] == "{}"


def test_flower_drops_dispatch_arguments_that_are_not_the_summary() -> None:
    sent = {"type": "task-sent", "uuid": "t1", "name": "corral.dispatch", "routing_key": "dispatch"}
    raw = {**sent, "args": repr([secret_message("k")]), "kwargs": "{}"}
    redact_event(raw, {})
    assert raw == sent
    summary = {
        "type": "task-received",
        "uuid": "t1",
        "name": "corral.dispatch",
        "args": "org=acme project=web",
        "kwargs": "{}",
    }
    redact_event(summary, {})
    assert summary["args"] == "org=acme project=web"
    shaped = {
        "type": "task-sent",
        "uuid": "t4",
        "name": "corral.dispatch",
        "args": "api_key=sk-ant-abcdefgh12345678",
        "kwargs": "{}",
    }
    redact_event(shaped, {})
    assert "args" not in shaped  # summary-shaped, but not a field a summary has
    unnamed = {"type": "task-received", "uuid": "t2", "args": f"['{SECRET}']", "kwargs": "{}"}
    redact_event(unnamed, {})
    assert "args" not in unnamed  # not known to be another task: treated as a dispatch
    provision = {
        "type": "task-sent",
        "uuid": "t3",
        "name": "corral.provision",
        "args": "['wi-1']",
        "kwargs": "{}",
    }
    redact_event(provision, {})
    assert provision["args"] == "['wi-1']"  # ids only: shown as they are


# -- a running stack with Flower ---------------------------------------------------------------


@pytest.fixture(scope="module")
def stack(postgres_database_url: str, redis_url: str) -> Iterator[Stack]:
    """The whole stack plus ``corral flower``; Flower's API open without auth (as Flower 2
    requires for an API without a login), on 127.0.0.1 only."""
    require_bwrap_path()
    running = Stack(
        database_url=postgres_database_url,
        broker_url=redis_url,
        extra_env={"FLOWER_UNAUTHENTICATED_API": "true"},
    )
    try:
        running.start_only(["api", "scheduler", "worker-local", "maintenance", "beat", "flower"])
        yield running
    finally:
        running.stop()


@pytest.fixture(scope="module")
def setup_org(stack: Stack) -> str:
    """Org flower-org with one local pool."""
    return stack.make_org(ORG)


def fetch(stack: Stack, path: str) -> str:
    try:
        with urllib.request.urlopen(stack.flower_url + path, timeout=10) as answer:
            return answer.read().decode()
    except urllib.error.HTTPError as error:
        with error:
            raise AssertionError(f"{path}: {error.code} {error.read()[:500]!r}") from error


def fetch_json(stack: Stack, path: str) -> Any:
    return json.loads(fetch(stack, path))


def flower_task(stack: Stack, task_id: str) -> dict[str, Any] | None:
    """Flower's record of a task, or None while Flower has had no event of it."""
    try:
        url = f"{stack.flower_url}/api/task/info/{task_id}"
        with urllib.request.urlopen(url, timeout=10) as answer:
            record: dict[str, Any] = json.loads(answer.read())
            return record
    except urllib.error.HTTPError as error:
        with error:
            if error.code == 404:
                return None
            raise


@dataclass
class Dispatched:
    api_items: list[str]
    celery_task_ids: list[str]
    queued: dict[str, int]  # Flower's queue lengths while the scheduler was paused
    broker_page: str  # and its broker page
    upstream_sent: dict[str, Any]  # and its record of the upstream's task, sent, not received


def _wait(condition: Any, what: str, stack: Stack, timeout_s: float = 30) -> Any:
    return stack.until(condition, what, timeout_s)


def upstream_send(stack: Stack, message: dict[str, Any]) -> str:
    """Send ``message`` as an upstream service would: a Celery app of its own, knowing only
    the task's name and queue, setting no ``argsrepr`` (so Celery writes the message's
    ``repr`` into the headers), with "task-sent" events on (so that ``repr`` reaches
    Flower too, unless Flower drops it)."""
    upstream = Celery("upstream-service", broker=stack.broker_url, set_as_current=False)
    upstream.conf.update(
        broker_transport_options={"global_keyprefix": stack.key_prefix},
        task_send_sent_event=True,
    )
    try:
        return str(upstream.send_task("corral.dispatch", args=[message], queue="dispatch").id)
    finally:
        upstream.close()


def _await_flower_listing_the_workers(stack: Stack) -> str:
    """The scheduler's worker name, once Flower lists every worker of the stack."""
    # Flower learns the queues the workers consume (its first inspection, at its start, may
    # have gone out before the workers listened).
    host = socket.gethostname()
    names = {f"{worker}@{host}" for worker in WORKERS}
    _wait(
        lambda: set(fetch_json(stack, "/api/workers?refresh=1")) >= names,
        "Flower does not list the workers",
        stack,
    )
    return f"scheduler@{host}"


def _await_the_waiting_dispatches(stack: Stack) -> tuple[dict[str, int], str]:
    """Flower's queue lengths and broker page once the two dispatch messages wait on the
    queue and Flower counts them."""
    client = redis.Redis.from_url(stack.broker_url)
    try:  # what Flower should count: the list under the key prefix
        _wait(
            lambda: client.llen(f"{stack.key_prefix}dispatch") == 2,
            "the dispatch messages did not wait on the queue",
            stack,
        )
    finally:
        client.close()

    def lengths() -> dict[str, int] | None:
        answer = fetch_json(stack, "/api/queues/length")["active_queues"]
        found = {q["name"]: q["messages"] for q in answer}
        return found if found.get("dispatch") == 2 else None

    queued = _wait(lengths, "Flower did not count the waiting dispatch messages", stack)
    return queued, fetch(stack, "/broker")


def _celery_items(db: Database, keys: list[str]) -> list[str] | None:
    """The items of the two dispatch messages, or None until both are written."""
    with db.session() as session:
        found = list(session.scalars(select(WorkItem.id).where(WorkItem.idempotency_key.in_(keys))))
    return found if len(found) == 2 else None


def _flower_saw_all(stack: Stack, task_ids: list[str]) -> bool:
    tasks = fetch_json(stack, "/api/tasks")
    provisions = [t for t in tasks.values() if t["name"] == "corral.provision"]
    done = [t for t in provisions if t["state"] == "SUCCESS"]
    return len(done) >= 5 and all(tasks.get(i, {}).get("state") == "SUCCESS" for i in task_ids)


@pytest.fixture(scope="module")
def dispatched(stack: Stack, setup_org: str, sender: Celery, db: Database) -> Dispatched:
    """Three shell items through the api, two dispatch messages with a secret env value
    through Celery (one as an upstream sender would, one as corral's own code does), sent
    while the scheduler does not consume, so Flower counts them on the queue; all run."""
    api_items = []
    for number in range(3):
        status, body = stack.request("POST", "/v1/dispatch", shell(setup_org, f"echo {number}"))
        assert status == 202, body
        api_items.append(body["id"])

    scheduler = _await_flower_listing_the_workers(stack)
    assert sender.control.cancel_consumer("dispatch", destination=[scheduler], reply=True)
    keys = ["flower-secret-upstream", "flower-secret-corral"]
    task_ids = [
        upstream_send(stack, secret_message(keys[0])),
        dispatch.apply_async(args=[secret_message(keys[1])]).id,  # as corral's code sends
    ]
    queued, broker_page = _await_the_waiting_dispatches(stack)
    upstream_sent = _wait(
        lambda: flower_task(stack, task_ids[0]),
        "Flower did not get the upstream's task-sent event",
        stack,
    )
    assert sender.control.add_consumer("dispatch", destination=[scheduler], reply=True)

    celery_items = _wait(lambda: _celery_items(db, keys), "no dispatch items", stack)
    views = stack.wait_final(api_items + celery_items)
    assert [v["state"] for v in views] == ["succeeded"] * 5, [v["error"] for v in views]

    _wait(lambda: _flower_saw_all(stack, task_ids), "Flower did not see every task succeed", stack)
    return Dispatched(api_items, task_ids, queued, broker_page, upstream_sent)


def test_flower_counts_the_queues_the_workers_consume_under_the_key_prefix(
    stack: Stack, dispatched: Dispatched
) -> None:
    # Every queue a worker consumes is counted under its prefixed key. The maintenance
    # queue may hold a beat tick its worker has not taken yet (beat sends every few
    # seconds), so only its presence is asserted.
    assert set(dispatched.queued) == {
        "dispatch",
        "maintenance",
        "provision.local",
        "provision.local.gpu",
    }
    assert dispatched.queued["dispatch"] == 2
    assert dispatched.queued["provision.local"] == dispatched.queued["provision.local.gpu"] == 0
    row = re.search(
        r'<tr id="dispatch">\s*<td>dispatch</td>\s*<td[^>]*>(\d+)</td>', dispatched.broker_page
    )
    assert row is not None and row.group(1) == "2"
    assert SECRET not in dispatched.broker_page


def test_flower_drops_the_message_an_upstream_task_sent_event_carries(
    dispatched: Dispatched,
) -> None:
    # Before any worker received it, all Flower had of the upstream's task was the
    # "task-sent" event, whose arguments were the message's repr: dropped, not stored.
    sent = dispatched.upstream_sent
    assert (sent["name"], sent["state"], sent["routing_key"]) == (
        "corral.dispatch",
        "PENDING",
        "dispatch",
    )
    assert sent["args"] is None and sent["kwargs"] is None
    assert SECRET not in json.dumps(sent)


def test_flower_shows_ids_only_never_tokens_or_dispatch_secrets(
    stack: Stack, dispatched: Dispatched
) -> None:
    tasks = fetch_json(stack, "/api/tasks")
    upstream, corral_sent = (tasks[i] for i in dispatched.celery_task_ids)
    # The upstream's message came without argsrepr, and its "task-sent" event (which Flower
    # received: it is where the queue comes from) with the message's repr as the arguments:
    # the summary is the worker's own, and Flower dropped the repr.
    assert upstream["args"] == summary_of("flower-secret-upstream")
    assert upstream["routing_key"] == "dispatch" and upstream["sent"] is not None
    assert corral_sent["args"] == summary_of("flower-secret-corral")
    provisions = [t for t in tasks.values() if t["name"] == "corral.provision"]
    assert {t["routing_key"] for t in provisions} == {"provision.local"}
    assert {f"['{i}']" for i in dispatched.api_items} <= {t["args"] for t in provisions}

    workers = fetch_json(stack, "/api/workers?refresh=1")
    assert {name.split("@")[0] for name in workers} == set(WORKERS)
    pages = {
        path: fetch(stack, path)
        for path in (
            "/",
            "/workers",
            "/tasks",
            "/broker",
            "/api/tasks",
            "/api/task/types",
            "/api/queues/length",
            "/metrics",
            "/workers?json=1",
        )
    }
    pages["/api/workers"] = json.dumps(workers)
    for name in workers:
        quoted = urllib.parse.quote(name)
        pages[f"/worker/{name}"] = fetch(stack, f"/worker/{quoted}")
        pages[f"/api/workers?workername={name}"] = fetch(
            stack, f"/api/workers?refresh=1&workername={quoted}"
        )
    for task_id in tasks:
        pages[f"/api/task/info/{task_id}"] = fetch(stack, f"/api/task/info/{task_id}")
    for task_id in dispatched.celery_task_ids:
        pages[f"/task/{task_id}"] = fetch(stack, f"/task/{task_id}")
        assert "idempotency_key=flower-secret-" in unescape(pages[f"/task/{task_id}"])
    pages["flower log"] = stack.log_path("flower").read_text(errors="replace")
    pages["scheduler log"] = stack.log_path("scheduler").read_text(errors="replace")
    for where, text in pages.items():
        for needle in (SECRET, "crt_", "crs_", stack.admin_token):
            assert needle not in text, f"{needle[:4]}… in {where}"


def chromium(page_url: str, screenshot: Path, profile: Path) -> str:
    """The DOM of ``page_url`` after its scripts ran (Flower fills its tables by XHR; the
    virtual time budget lets them finish), and a screenshot of it."""
    result = subprocess.run(
        [
            "chromium",
            *CHROMIUM_FLAGS,
            f"--user-data-dir={profile}",
            "--virtual-time-budget=10000",
            "--window-size=1400,900",
            f"--screenshot={screenshot}",
            "--dump-dom",
            page_url,
        ],
        capture_output=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stderr.decode(errors="replace")[-2000:]
    assert screenshot.stat().st_size > 0
    return result.stdout.decode()


def table_rows(dom: str) -> list[list[str]]:
    """Each task row of Flower's tasks table (``<tr id="<task uuid>">``), as cell texts."""
    rows = re.findall(r'<tr id="[0-9a-f-]{36}"[^>]*>(.*?)</tr>', dom, flags=re.S)
    return [
        [
            unescape(re.sub(r"<[^>]+>", "", cell)).strip()
            for cell in re.findall(r"<td[^>]*>(.*?)</td>", row, flags=re.S)
        ]
        for row in rows
    ]


def test_flower_pages_in_a_browser_list_the_workers_and_the_tasks_on_their_queues(
    stack: Stack, dispatched: Dispatched, tmp_path: Path
) -> None:
    require(shutil.which("chromium") is not None, "Debian's chromium")
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    print(f"Flower screenshots: {ARTIFACTS}")
    doms = {
        name: chromium(stack.flower_url + path, ARTIFACTS / f"{name}.png", tmp_path / name)
        for name, path in {
            "workers": "/workers",
            "tasks-provision": "/tasks?name=corral.provision",
            "tasks-dispatch": "/tasks?name=corral.dispatch",
            "broker": "/broker",
        }.items()
    }

    workers_text = re.sub(r"<[^>]+>", "", doms["workers"])
    for worker in WORKERS:
        assert f"{worker}@{socket.gethostname()}" in workers_text

    provisions = table_rows(doms["tasks-provision"])
    assert provisions, doms["tasks-provision"][-3000:]
    assert all("corral.provision" in row and "provision.local" in row for row in provisions)
    assert {f"['{i}']" for i in dispatched.api_items} <= {cell for r in provisions for cell in r}

    dispatches = table_rows(doms["tasks-dispatch"])
    assert len(dispatches) == 2, dispatches
    for key in ("flower-secret-upstream", "flower-secret-corral"):
        [row] = [row for row in dispatches if summary_of(key) in row]
        assert "corral.dispatch" in row and "scheduler@" in " ".join(row), row

    for name, dom in doms.items():
        for needle in (SECRET, "crt_", "crs_", stack.admin_token):
            assert needle not in dom, f"{needle[:4]}… in the {name} page"
