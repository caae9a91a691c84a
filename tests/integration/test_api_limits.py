"""Hostile and malformed input against the api on real PostgreSQL: every input that used to
answer 500 is a 4xx, bodies over their route's limit are 413, JSON is read strictly, no
error echoes what the client sent, an unreachable database is 503 and an unexpected error
500 without a traceback."""

from __future__ import annotations

import json
import uuid
from typing import Any

import pytest
from pydantic import SecretStr, ValidationError

from corral.scheduler.admin import views
from corral.scheduler.api.app import create_app
from corral.scheduler.intake import record_invalid
from corral.shared import runtime
from corral.shared.messages import DispatchRequest
from corral.shared.settings import CoreSettings
from corral.shared.store.db import Database, make_engine
from corral.shared.store.models import WorkItem
from tests.integration.api_clients import ClientFactory, runner_headers
from tests.integration.test_api import ADMIN, admin_headers, message

SECRET = "sk-live-0a1b-NEVER-ECHO"
POOL = {"org_id": "acme", "name": "p", "provider_id": "local"}


def nested(depth: int) -> Any:
    value: Any = 1
    for _ in range(depth):
        value = [value]
    return value


FORMER_500S = [
    pytest.param(
        "POST",
        "/v1/dispatch",
        {
            "json": message(
                "acme",
                work={"kind": "code", "code": "def main(a): pass", "arguments": {"a": nested(900)}},
            )
        },
        id="dispatch-900-levels",
    ),
    pytest.param(
        "POST",
        "/v1/dispatch",
        {"content": b'{"org": "acme", "x": ' + b"[" * 200_000 + b"]" * 200_000 + b"}"},
        id="dispatch-200000-levels",
    ),
    pytest.param("GET", "/v1/admin/pools?org=a%00b", {}, id="pools-org-nul"),
    pytest.param("GET", "/v1/sandboxes?org=a%00b", {}, id="sandboxes-org-nul"),
    pytest.param("GET", "/v1/costs?org=a%00b", {}, id="costs-org-nul"),
    pytest.param("GET", "/v1/work-items/wi-%00", {}, id="item-id-nul"),
    pytest.param("GET", "/v1/work-items/wi-%00/logs", {}, id="logs-id-nul"),
    pytest.param("GET", "/v1/work-items/wi-%00/events", {}, id="events-id-nul"),
    pytest.param("POST", "/v1/work-items/wi-%00/cancel", {}, id="cancel-id-nul"),
    pytest.param(
        "POST", "/v1/admin/pools", {"json": {**POOL, "priority": 2**40}}, id="pool-priority-huge"
    ),
    pytest.param(
        "POST",
        "/v1/admin/pools",
        {"json": {**POOL, "priority": -(2**31) - 1}},
        id="pool-priority-below-int32",
    ),
    pytest.param(
        "POST",
        "/v1/admin/pools",
        {"json": {**POOL, "max_concurrent": 2**31}},
        id="pool-max-concurrent-huge",
    ),
    pytest.param(
        "POST", "/v1/admin/pools", {"json": {**POOL, "rate_micros": 2**70}}, id="pool-rate-huge"
    ),
    pytest.param(
        "POST",
        "/v1/admin/profiles",
        {"json": {"name": "p", "model": "a\x00b", "auth_mode": "byok"}},
        id="profile-model-nul",
    ),
    pytest.param("GET", "/v1/costs?since=99999999999999d", {}, id="since-huge"),
    pytest.param("GET", "/v1/costs?since=0001-01-01T00:00:00%2B05:00", {}, id="since-year-1"),
    pytest.param(
        "GET", "/v1/work-items/wi-x/logs?after=99999999999999999999999", {}, id="logs-after-huge"
    ),
    pytest.param(
        "POST",
        "/v1/dispatch",
        {"json": message("acme", idempotency_key="k\x00")},
        id="dispatch-key-nul",
    ),
    pytest.param(
        "POST",
        "/v1/dispatch",
        {"json": message("acme", resources={"timeout_s": 2**80})},
        id="dispatch-timeout-huge",
    ),
    pytest.param(
        "POST",
        "/v1/dispatch",
        {
            "content": json.dumps(
                message(
                    "acme", work={"kind": "code", "code": "x", "arguments": {"a": float("nan")}}
                )
            ).encode()
        },
        id="dispatch-nan",
    ),
    pytest.param(
        "POST",
        "/v1/dispatch",
        {
            "content": json.dumps(message("acme", resources={"cpu": 1}))
            .encode()
            .replace(b'"cpu": 1', b'"cpu": 1e999')
        },
        id="dispatch-cpu-infinite",
    ),
    pytest.param(
        "POST",
        "/v1/dispatch",
        {
            "content": json.dumps(
                message("acme", work={"kind": "code", "code": "x", "arguments": {"a": "\ud800"}})
            ).encode()
        },
        id="dispatch-lone-surrogate",
    ),
]


@pytest.mark.parametrize(("method", "path", "request_args"), FORMER_500S)
def test_what_answered_500_is_refused_with_422(
    make_client: ClientFactory, method: str, path: str, request_args: dict[str, Any]
) -> None:
    client = make_client()
    answer = client.request(method, path, headers=admin_headers(), **request_args)
    assert answer.status_code == 422, answer.text
    body = answer.json()
    assert body["error"] in ("invalid_request", "invalid_message")
    assert body["detail"] and {"field", "message"} == set(body["detail"][0])
    assert client.get("/healthz").status_code == 200  # and the api keeps serving


def test_runner_bodies_are_read_strictly_and_stored_text_holds_no_nul(
    make_client: ClientFactory, pg_db: Database
) -> None:
    client = make_client()
    item_id, headers = runner_headers(client, pg_db, f"org-{uuid.uuid4().hex[:8]}")
    deep = {"exit_code": 0, "result": nested(64)}
    answer = client.post("/v1/runner/complete", json=deep, headers=headers)
    assert answer.status_code == 422 and answer.json()["detail"][0]["field"] == "(body)"
    not_finite = b'{"exit_code": 0, "result": [NaN]}'
    answer = client.post("/v1/runner/complete", content=not_finite, headers=headers)
    assert answer.status_code == 422
    huge_exit = {"exit_code": 2**40}
    assert client.post("/v1/runner/complete", json=huge_exit, headers=headers).status_code == 422
    lines = {"lines": [{"line": "a\x00b"}]}
    assert client.post("/v1/runner/logs", json=lines, headers=headers).status_code == 200
    logged = client.get(f"/v1/work-items/{item_id}/logs", headers=admin_headers()).json()
    assert [line["line"] for line in logged["lines"]] == ["a\ufffdb"]
    failed = {"exit_code": 1, "error": "bad\x00news", "result": nested(62)}
    assert client.post("/v1/runner/complete", json=failed, headers=headers).json() == {
        "state": "failed"
    }
    view = client.get(f"/v1/work-items/{item_id}", headers=admin_headers()).json()
    assert view["error"]["message"] == "bad\ufffdnews"


def test_the_nesting_limit_is_the_setting(make_client: ClientFactory) -> None:
    client = make_client(api_json_max_depth=5)
    work = {"kind": "code", "code": "def main(a): pass"}
    ok = message("acme", work={**work, "arguments": {"a": nested(2)}})  # 4 levels in all
    assert client.post("/v1/dispatch", json=ok, headers=admin_headers()).status_code == 202
    deep = message("acme", work={**work, "arguments": {"a": nested(3)}})
    answer = client.post("/v1/dispatch", json=deep, headers=admin_headers())
    assert answer.status_code == 422
    assert answer.json()["detail"] == [
        {"field": "(body)", "message": "the body is nested more than 5 levels deep"}
    ]


@pytest.mark.parametrize(
    ("path", "limit_setting", "chunked"),
    [
        ("/v1/dispatch", "api_body_limit_dispatch", False),
        ("/v1/dispatch", "api_body_limit_dispatch", True),
        ("/v1/runner/logs", "api_body_limit_logs", False),
        ("/v1/runner/complete", "api_body_limit_complete", True),
        ("/v1/admin/pools", "api_body_limit_default", False),
        ("/v1/runner/register", "api_body_limit_default", True),
    ],
)
def test_a_body_over_its_routes_limit_is_413_naming_the_limit(
    make_client: ClientFactory, path: str, limit_setting: str, chunked: bool
) -> None:
    limits = {
        "api_body_limit_dispatch": 3000,
        "api_body_limit_logs": 2000,
        "api_body_limit_complete": 4000,
        "api_body_limit_default": 1000,
    }
    client = make_client(**limits)
    limit = limits[limit_setting]
    body = json.dumps({"padding": "x" * limit}).encode()
    content: Any = iter([body[:100], body[100:]]) if chunked else body  # chunked: no length
    answer = client.post(path, content=content, headers=admin_headers())
    assert answer.status_code == 413
    assert answer.json() == {
        "error": "body_too_large",
        "detail": [
            {
                "field": "(body)",
                "message": f"the request body is larger than this route's limit of {limit} bytes",
            }
        ],
        "limit_bytes": limit,
    }
    # Just under the limit, the body is read (and refused for what it is, not its size).
    small = json.dumps({"padding": "x" * (limit - 100)}).encode()
    assert client.post(path, content=small, headers=admin_headers()).status_code != 413


def test_no_error_answer_echoes_what_the_client_sent(
    make_client: ClientFactory, pg_db: Database
) -> None:
    client = make_client()
    headers = admin_headers()
    answers = [
        client.post("/v1/dispatch", json=message("acme", env={SECRET: 5}), headers=headers),
        client.post("/v1/dispatch", json=message("acme", env={"K": [SECRET]}), headers=headers),
        client.post("/v1/dispatch", json={**message("acme"), SECRET: 1}, headers=headers),
        client.post("/v1/dispatch", json={**message("acme"), "x": {SECRET: 1}}, headers=headers),
        client.post(
            "/v1/dispatch",
            json=message(
                "acme", agent_card={"runtimes": [{"kind": SECRET}], "requires": [{"kind": SECRET}]}
            ),
            headers=headers,
        ),
        client.post("/v1/dispatch", json=message("acme", work={"kind": SECRET}), headers=headers),
        client.post("/v1/dispatch", json=message(SECRET + "!"), headers=headers),
        client.get(f"/v1/costs?since={SECRET}", headers=headers),
        client.get(f"/v1/costs?org={SECRET}!&by={SECRET}", headers=headers),
        client.get(f"/v1/sandboxes?status={SECRET}", headers=headers),
        client.post(
            "/v1/admin/pools",
            json={**POOL, "provider_id": "nowhere-" + SECRET[:20]},
            headers=headers,
        ),
        client.post(
            "/v1/admin/pools",
            json={**POOL, "runtime_provides": {"runtimeKinds": [SECRET], SECRET: 1}},
            headers=headers,
        ),
        client.post("/v1/admin/pools", json={**POOL, "capabilities": {SECRET: 1}}, headers=headers),
        client.post(
            "/v1/admin/profiles", json={"name": "p", "model": "m", SECRET: 1}, headers=headers
        ),
    ]
    for answer in answers:
        assert answer.status_code in (409, 422), (answers.index(answer), answer.text)
        assert SECRET not in answer.text and SECRET[:20] not in answer.text
    # A pool name taken twice: 409, naming neither the org nor the name.
    pool = {**POOL, "org_id": f"org-{uuid.uuid4().hex[:8]}", "name": f"n-{uuid.uuid4().hex[:8]}"}
    assert client.post("/v1/admin/pools", json=pool, headers=headers).status_code == 201
    again = client.post("/v1/admin/pools", json=pool, headers=headers)
    assert again.status_code == 409
    assert pool["org_id"] not in again.text and pool["name"] not in again.text

    # A malformed message from the broker is stored as a dispatch error, without its values.
    raw = {**message("acme"), "env": {SECRET: 1}, "colour": SECRET}
    with pytest.raises(ValidationError) as raised:
        DispatchRequest.model_validate(raw)
    item_id = record_invalid(pg_db, raw, raised.value, actor="test")
    with pg_db.session() as session:
        item = session.get(WorkItem, item_id)
        assert item is not None and item.error_message is not None
        assert SECRET not in item.error_message
        assert "env.*" in item.error_message and "colour" in item.error_message


@pytest.fixture
def unreachable_database() -> Any:
    url = "postgresql+psycopg://nobody@127.0.0.1:1/none"  # nothing listens on port 1
    db = Database(make_engine(url))
    settings = CoreSettings(database_url=url, admin_token=SecretStr(ADMIN))
    runtime.install(runtime.Runtime(settings=settings, db=db))
    yield
    runtime.reset()
    db.dispose()


@pytest.mark.usefixtures("unreachable_database")
def test_an_unreachable_database_is_503_with_retry_after() -> None:
    from fastapi.testclient import TestClient

    runner = {"Authorization": "Bearer crs_" + "a" * 43}
    with TestClient(create_app()) as client:
        answers = [
            client.get("/v1/work-items/wi-1", headers=admin_headers()),
            client.get("/v1/admin/pools", headers=admin_headers()),
            client.post("/v1/dispatch", json=message("acme"), headers=admin_headers()),
            client.post("/v1/runner/heartbeat", json={}, headers=runner),
            client.post("/v1/runner/register", json={"token": "crt_x"}),
        ]
    for answer in answers:
        assert answer.status_code == 503, answer.text
        assert answer.headers["Retry-After"] == "5"
        assert answer.json()["error"] == "database_unavailable"
        assert "Traceback" not in answer.text and "psycopg" not in answer.text


def test_an_unexpected_error_is_500_without_a_traceback(
    make_client: ClientFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(f"something broke near {SECRET}")

    monkeypatch.setattr(views, "list_sandboxes", broken)
    client = make_client(raise_server_exceptions=False)
    answer = client.get("/v1/sandboxes", headers=admin_headers())
    assert answer.status_code == 500
    assert answer.json() == {
        "error": "internal_error",
        "detail": [{"field": "(service)", "message": "the api failed; the error is logged"}],
    }
    assert SECRET not in answer.text and "Traceback" not in answer.text
