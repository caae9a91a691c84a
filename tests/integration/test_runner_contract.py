"""The runner (standard library only) against the api's own models of the runner protocol.

The real runner (``corral.runner.main.main``) runs work items against the real api, served by
uvicorn on loopback over PostgreSQL. Its client records each body it sends and each answer
it gets, and every key it reads from an answer. Each body must validate, strictly, against
the route's body model (unknown fields are refused), each answer against the route's
response model, and each key the runner read must be a field of that model, sent in the
answer. A static pass over the runner's source checks the keys it reads on paths the run
does not take.
"""

from __future__ import annotations

import ast
import functools
import io
import json
import socket
import threading
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, get_type_hints

import pytest
import uvicorn
from fastapi.routing import APIRoute
from fastapi.testclient import TestClient
from pydantic import BaseModel, TypeAdapter
from sqlalchemy import select

import corral.runner.main
from corral.providers.base import SandboxHandle
from corral.runner import records
from corral.runner.control import BUNDLE_PATH, ControlClient
from corral.runner.errors import RunnerError
from corral.runner.protocol import Registration
from corral.runner.records import record
from corral.scheduler.api import runner_api, warm_api
from corral.shared.store import warm
from corral.shared.store.bundles import BundleLimits, read_bundle
from corral.shared.store.db import Database
from corral.shared.store.models import Sandbox, WarmSandbox, WorkItem
from tests.integration.api_clients import ClientFactory
from tests.integration.test_api import admin_headers, awaiting_item

RUNNER = Path(corral.runner.main.__file__).parent
# The runner modules that read the control plane's answers.
ANSWER_READERS = ("control.py", "protocol.py", "logs.py")
ROUTES = {r.path: r for r in runner_api.router.routes if isinstance(r, APIRoute)}
REGISTER_PATH, CLAIM_PATH = "/v1/runner/register", "/v1/runner/claim"
# A warm runner's first calls (docs/warm-pools.md), before it registers like any other.
WARM_ROUTES = [r for r in warm_api.router.routes if isinstance(r, APIRoute)]
EVERY_ROUTE = {**ROUTES, **{r.path: r for r in WARM_ROUTES}}


@dataclass
class Call:
    """One call of the runner: what it sent, what it got, and the keys it read."""

    path: str
    body: str
    answer: str | None = None
    error: str | None = None
    reads: set[tuple[str, ...]] = field(default_factory=set)


class Tracked(dict[str, Any]):
    """A JSON object that notes each key read from it and from the objects inside it."""

    def __init__(self, value: dict[str, Any], reads: set[tuple[str, ...]], at: tuple[str, ...]):
        super().__init__(value)
        self.reads = reads
        self.at = at

    def __getitem__(self, key: str) -> Any:
        self.reads.add((*self.at, key))
        return tracked(dict.__getitem__(self, key), self.reads, (*self.at, key))

    def get(self, key: str, default: Any = None) -> Any:  # type: ignore[override]
        self.reads.add((*self.at, key))
        return self[key] if dict.__contains__(self, key) else default

    def __contains__(self, key: object) -> bool:
        self.reads.add((*self.at, str(key)))
        return dict.__contains__(self, key)


def tracked(value: Any, reads: set[tuple[str, ...]], at: tuple[str, ...] = ()) -> Any:
    return Tracked(value, reads, at) if isinstance(value, dict) else value


@record  # a record like the client it extends (corral.runner.records)
class RecordingClient(ControlClient):
    """The runner's client, recording each call into ``calls``."""

    calls: list[Call] = records.field(default_factory=list, repr=False)
    claim_apart: bool = False  # the runner's claim asked for apart, not with its registration

    def register(self, token: str, *, claim: bool = False) -> Registration:
        return super().register(token, claim=claim and not self.claim_apart)

    def post(self, path: str, body: Any, *, retry: bool = False) -> Any:
        call = Call(path, json.dumps(body))
        self.calls.append(call)
        try:
            answer = super().post(path, body, retry=retry)
        except RunnerError as error:
            call.error = str(error)
            raise
        call.answer = json.dumps(answer)
        return tracked(answer, call.reads)

    def upload_bundle(self, archive: str) -> Any:
        # The body is a gzipped tar, checked against the bundle format instead of a model.
        call = Call(BUNDLE_PATH, Path(archive).read_bytes().hex())
        self.calls.append(call)
        answer = super().upload_bundle(archive)
        call.answer = json.dumps(answer)
        return tracked(answer, call.reads)


@dataclass
class ServedApi:
    url: str
    client: TestClient


@pytest.fixture
def api(make_client: ClientFactory) -> Iterator[ServedApi]:
    """The api as a runner reaches it, over HTTP on loopback (and in a TestClient)."""
    client = make_client(
        heartbeat_interval_s=0.05,
        runner_rate_per_s=0,
        runner_address_rate_per_s=0,
        register_rate_per_s=0,
    )
    config = uvicorn.Config(client.app, log_level="warning", lifespan="off", log_config=None)
    server = uvicorn.Server(config)
    listener = socket.create_server(("127.0.0.1", 0))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [listener]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the api did not start"
        time.sleep(0.02)
    yield ServedApi(f"http://127.0.0.1:{listener.getsockname()[1]}", client)
    server.should_exit = True
    thread.join(timeout=30)
    listener.close()


def declared(value: Any, path: tuple[str, ...]) -> bool:
    """Whether ``path`` names a field of the validated answer ``value``, one model inside
    another; below a free-form object (env, arguments) any key is the sender's."""
    for key in path:
        if not isinstance(value, BaseModel):
            return isinstance(value, dict)
        fields = {info.alias or name: name for name, info in type(value).model_fields.items()}
        if key not in fields:
            return False
        value = getattr(value, fields[key])
    return True


def sent(answer: Any, path: tuple[str, ...]) -> bool:
    for key in path:
        if not isinstance(answer, dict) or key not in answer:
            return False
        answer = answer[key]
    return True


def check(call: Call) -> None:
    """The call's body and answer against its route's models, and the keys the runner read."""
    route = EVERY_ROUTE[call.path]
    if call.path == BUNDLE_PATH:
        limits = BundleLimits(max_bytes=10**6, max_manifest_bytes=10**5, max_patches=10)
        read_bundle(io.BytesIO(bytes.fromhex(call.body)), limits)
    else:
        body_type = get_type_hints(route.endpoint)["body"]
        TypeAdapter(body_type).validate_json(call.body, strict=True)  # extra fields: refused
    assert call.error is None, f"{call.path}: {call.error}"
    assert call.answer is not None
    model = route.response_model
    assert isinstance(model, type) and issubclass(model, BaseModel)
    answer = model.model_validate_json(call.answer, strict=True)
    for path in call.reads:
        key = ".".join(path)
        assert declared(answer, path), f"{call.path}: the runner reads {key}, not in {model}"
        assert sent(json.loads(call.answer), path), f"{call.path}: {key} was not sent"


WORK = {
    "shell": {
        "work": {"kind": "shell", "command": "sleep 0.3; echo hello"},
        "toolchain": {
            "install_commands": ["true"],
            "post_acquire": ["echo ready"],
            "pre_release": ["echo bye"],
            "env": {"TOOL": "1"},
        },
        "env": {"ITEM": "2"},
        "resources": {"timeout_s": 60},
        "bundle": True,
    },
    "code": {
        "work": {
            "kind": "code",
            # Over one batch of output (200 lines): its first batch is a /logs call of its
            # own, the rest comes with the completion report.
            "code": "import time\ndef main(n):\n    for i in range(250):\n        print(i)\n"
            "    time.sleep(0.3)\n    return {'n': n}",
            "arguments": {"n": 3},
        }
    },
}


# The shell item's runner claims with its registration, the code item's apart: /claim's
# contract is checked too.
@pytest.mark.parametrize("kind", sorted(WORK))
def test_the_runner_sends_and_reads_what_the_api_models_say(
    kind: str,
    api: ServedApi,
    pg_db: Database,
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
) -> None:
    item_id, token = awaiting_item(pg_db, f"org-{uuid.uuid4().hex[:8]}", **WORK[kind])
    calls: list[Call] = []
    monkeypatch.setattr(
        corral.runner.main,
        "ControlClient",
        functools.partial(RecordingClient, calls=calls, claim_apart=kind == "code"),
    )
    monkeypatch.setattr(
        corral.runner.main, "configure_logging", lambda: None
    )  # pytest's, not stderr
    monkeypatch.setenv("CORRAL_CONTROL_URL", api.url)
    monkeypatch.setenv("CORRAL_REGISTRATION_TOKEN", token)
    monkeypatch.chdir(tmp_path)  # the workspace
    with ThreadPoolExecutor(1) as pool:  # not the main thread: no SIGTERM handler for pytest
        exit_code = pool.submit(corral.runner.main.main).result(timeout=120)

    for call in calls:
        check(call)
    # The whole protocol, every route (the bundle only for the item that asks for one).
    expected = set(ROUTES) - ({BUNDLE_PATH} if kind == "code" else {CLAIM_PATH})
    assert {call.path for call in calls} == expected
    # What the runner reads of a claim, whichever call carried it.
    reads = {
        path[1:] if call.path == REGISTER_PATH and path[:1] == ("claim",) else path
        for call in calls
        for path in call.reads
    }
    assert {("session_token",), ("work", "kind"), ("cancel",), ("dropped",)} <= reads
    assert exit_code == corral.runner.main.EXIT_SUCCEEDED
    view = api.client.get(f"/v1/work-items/{item_id}", headers=admin_headers()).json()
    assert view["state"] == "succeeded"
    assert view["result"] == ({"n": 3} if kind == "code" else None)


def answer_keys_read() -> set[str]:
    """Every key the runner's answer-reading modules read by name: ``x["k"]``, ``x.get("k")``,
    and a literal passed as a helper's ``key`` parameter (``_string(body, "k")``)."""
    keys: set[str] = set()
    for name in ANSWER_READERS:
        tree = ast.parse((RUNNER / name).read_text())
        helpers = {
            node.name: [arg.arg for arg in node.args.args].index("key")
            for node in ast.walk(tree)
            if isinstance(node, ast.FunctionDef) and "key" in [a.arg for a in node.args.args]
        }
        for node in ast.walk(tree):
            literal: ast.expr | None = None
            if isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load):
                literal = node.slice
            elif isinstance(node, ast.Call) and node.args:
                func = node.func
                if isinstance(func, ast.Attribute) and func.attr == "get":
                    literal = node.args[0]
                elif isinstance(func, ast.Name) and func.id in helpers:
                    at = helpers[func.id]
                    literal = node.args[at] if at < len(node.args) else None
            if isinstance(literal, ast.Constant) and isinstance(literal.value, str):
                keys.add(literal.value)
    return keys


def model_fields(model: type[BaseModel]) -> set[str]:
    """The names of ``model``'s fields and of the fields of the models inside it."""
    names: set[str] = set()
    stack = [model.model_json_schema(mode="serialization")]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            names.update(node.get("properties", {}))
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)
    return names


def test_every_key_the_runner_reads_is_a_field_of_a_runner_answer() -> None:
    keys = answer_keys_read()
    assert {"session_token", "work", "command", "arguments", "cancel", "dropped"} <= keys
    fields: set[str] = set()
    for route in [*ROUTES.values(), *WARM_ROUTES]:
        assert isinstance(route.response_model, type)
        fields |= model_fields(route.response_model)
    assert keys <= fields, f"the runner reads keys no runner answer has: {keys - fields}"


def _warm_sandbox_of(db: Database, item_id: str) -> tuple[str, str, str]:
    """A made warm sandbox of the item's pool: (its id, its enrolment credential, the item's
    sandbox row's id)."""
    with db.session() as session:
        item = session.get(WorkItem, item_id)
        assert item is not None and item.pool_id is not None
        sandbox_id = session.scalars(
            select(Sandbox.id).where(Sandbox.work_item_id == item_id)
        ).one()
        warm_id = warm.new_warm_id()
        session.add(
            WarmSandbox(
                id=warm_id,
                pool_id=item.pool_id,
                org_id=item.org_id,
                provider_id="local",
                state="booting",
            )
        )
    taken = warm.take_for_provision(db, warm_id)
    assert taken is not None
    handle = SandboxHandle(provider_id="local", external_id=warm_id, metadata={"org_id": "o"})
    assert warm.record_made(db, warm_id, handle)
    return warm_id, taken[2], sandbox_id


def test_a_warm_runner_enrols_waits_and_then_runs_as_a_cold_one(
    api: ServedApi, pg_db: Database, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    item_id, _ = awaiting_item(pg_db, f"org-{uuid.uuid4().hex[:8]}", **WORK["code"])
    warm_id, credential, sandbox_id = _warm_sandbox_of(pg_db, item_id)
    calls: list[Call] = []
    monkeypatch.setattr(
        corral.runner.main,
        "ControlClient",
        functools.partial(RecordingClient, calls=calls),
    )
    monkeypatch.setattr(corral.runner.main, "configure_logging", lambda: None)
    monkeypatch.setenv("CORRAL_CONTROL_URL", api.url)
    monkeypatch.setenv("CORRAL_REGISTRATION_TOKEN", credential)
    monkeypatch.chdir(tmp_path)
    with ThreadPoolExecutor(1) as pool:
        running = pool.submit(corral.runner.main.main)
        deadline = time.monotonic() + 30
        while not any(c.path == "/v1/runner/warm/wait" for c in calls):  # enrolled, waiting
            assert time.monotonic() < deadline and not running.done(), calls
            time.sleep(0.02)
        with pg_db.session() as session:
            pool_id = session.scalars(select(WarmSandbox.pool_id).where(WarmSandbox.id == warm_id))
            bound = warm.bind(
                pg_db,
                pool_id.one(),
                item_id,
                sandbox_id,
                revoke_hash="0" * 64,
                seen_within_s=60,
            )
        assert bound is not None and bound.warm_id == warm_id
        exit_code = running.result(timeout=120)

    for call in calls:
        check(call)
    warm_paths = {"/v1/runner/enrol", "/v1/runner/warm/wait"}
    assert {call.path for call in calls} == (set(ROUTES) - {BUNDLE_PATH, CLAIM_PATH}) | warm_paths
    assert exit_code == corral.runner.main.EXIT_SUCCEEDED
    view = api.client.get(f"/v1/work-items/{item_id}", headers=admin_headers()).json()
    assert (view["state"], view["result"]) == ("succeeded", {"n": 3})
