"""corral.client's work-item clients against a scripted api (httpx.MockTransport): what they
send, how they retry, how errors read, how pages and logs are followed; sync and async."""

from __future__ import annotations

import asyncio
import hashlib
import json
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from corral.client import (
    ApiError,
    ApiUnreachableError,
    AsyncClient,
    BundleDigestError,
    Client,
    ConflictError,
    DispatchRequest,
    InvalidRequestError,
    NotFoundError,
    Retry,
    UnauthorizedError,
    UnavailableError,
    UnexpectedAnswerError,
    WaitTimeoutError,
)

TOKEN = "cok_secret-token-never-shown"
NO_PAUSE = Retry(attempts=3, backoff_s=0.0)
Handler = Callable[[httpx.Request], httpx.Response]


def view(item_id: str = "wi-1", state: str = "running") -> dict[str, Any]:
    """A ``GET /v1/work-items/{id}`` answer."""
    lease = {
        "max_attempts": 3,
        "retry_on_work_failed": False,
        "on_heartbeat_lost": "fail",
        "backoff_s": 0.0,
        "backoff_factor": 2.0,
        "backoff_max_s": 300.0,
    }
    stamps = dict.fromkeys(
        ("routed_at", "provisioned_at", "claimed_at", "finished_at", "not_before", "expires_at")
    )
    return {
        "id": item_id,
        "org": "acme",
        "project": "web",
        "profile": "default",
        "state": state,
        "pool_id": None,
        "pool": None,
        "queue": None,
        "attempts": 1,
        "lease": lease,
        "exit_code": None,
        "result": None,
        "duration_s": None,
        "error": None,
        "sandbox": None,
        "timestamps": {"created_at": "2026-01-01T00:00:00+00:00", **stamps},
        "logs": {"lines": 0, "bytes": 0, "dropped_lines": 0},
        "bundle": None,
        "waiting": None,
    }


def row(item_id: str) -> dict[str, Any]:
    return {
        "id": item_id,
        "org": "acme",
        "project": "web",
        "idempotency_key": None,
        "task_id": None,
        "state": "succeeded",
        "pool": "local",
        "queue": "provision.local",
        "error_code": None,
        "exit_code": 0,
        "created_at": "2026-01-01T00:00:00+00:00",
        "finished_at": None,
    }


class Api:
    """A scripted api: each request is recorded and answered by ``answer``."""

    def __init__(self, answer: Handler) -> None:
        self.answer = answer
        self.seen: list[httpx.Request] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        request.read()
        self.seen.append(request)
        return self.answer(request)

    def client(self) -> Client:
        return Client(
            "http://corral.test", TOKEN, transport=httpx.MockTransport(self), retry=NO_PAUSE
        )

    def async_client(self) -> AsyncClient:
        transport = httpx.MockTransport(self)
        return AsyncClient("http://corral.test", TOKEN, transport=transport, retry=NO_PAUSE)

    def paths(self) -> list[str]:
        return [f"{r.method} {r.url.path}" for r in self.seen]


def scripted(*answers: httpx.Response | Exception) -> Api:
    """An api that gives these answers in turn (an exception is raised as the transport's)."""
    left = iter(answers)

    def answer(request: httpx.Request) -> httpx.Response:
        got = next(left)
        if isinstance(got, Exception):
            raise got
        return got

    return Api(answer)


MESSAGE = {
    "org": "acme",
    "project": "web",
    "profile": "default",
    "work": {"kind": "shell", "command": "true"},
}
DISPATCHED = {"id": "wi-1", "created": True, "state": "routed", "error": None}


def test_a_dispatch_carries_a_new_idempotency_key_and_answers_it() -> None:
    api = scripted(httpx.Response(202, json=DISPATCHED), httpx.Response(200, json=DISPATCHED))
    with api.client() as corral:
        sent = corral.dispatch(MESSAGE)
        again = corral.dispatch(MESSAGE, idempotency_key=sent.idempotency_key)
    assert (sent.id, sent.created, sent.state) == ("wi-1", True, "routed")
    keys = [r.headers["Idempotency-Key"] for r in api.seen]
    assert len(keys[0]) == 36 and keys == [sent.idempotency_key, again.idempotency_key]
    assert api.seen[0].headers["Authorization"] == f"Bearer {TOKEN}"
    assert json.loads(api.seen[0].content) == MESSAGE


def test_a_dispatch_request_sends_only_the_fields_set_and_its_own_key() -> None:
    api = scripted(httpx.Response(202, json=DISPATCHED))
    message = DispatchRequest.model_validate({**MESSAGE, "idempotency_key": "build-1"})
    with api.client() as corral:
        assert corral.dispatch(message).idempotency_key == "build-1"
    assert json.loads(api.seen[0].content) == {**MESSAGE, "idempotency_key": "build-1"}
    assert api.seen[0].headers["Idempotency-Key"] == "build-1"


def test_a_503_and_a_lost_connection_are_retried_with_the_same_key() -> None:
    busy = httpx.Response(503, json={"error": "database_unavailable", "detail": []})
    api = scripted(busy, httpx.ConnectError("refused"), httpx.Response(202, json=DISPATCHED))
    with api.client() as corral:
        assert corral.dispatch(MESSAGE).id == "wi-1"
    assert len({r.headers["Idempotency-Key"] for r in api.seen}) == 1
    assert len(api.seen) == 3


def test_retries_end_in_a_typed_error() -> None:
    api = scripted(*[httpx.ConnectError("refused")] * 3)
    with api.client() as corral, pytest.raises(ApiUnreachableError, match="GET /v1/work"):
        corral.get("wi-1")
    busy = httpx.Response(503, json={"error": "database_unavailable", "detail": []})
    api = scripted(busy, busy, busy)
    with api.client() as corral, pytest.raises(UnavailableError) as raised:
        corral.get("wi-1")
    assert raised.value.error == "database_unavailable" and len(api.seen) == 3


def test_the_back_off_doubles_and_heeds_retry_after() -> None:
    retry = Retry(attempts=5, backoff_s=0.5, max_backoff_s=3.0)
    assert [retry.pause(sent, None) for sent in (1, 2, 3, 4)] == [0.5, 1.0, 2.0, 3.0]
    assert retry.pause(1, "2") == 2.0 and retry.pause(1, "60") == 3.0


@pytest.mark.parametrize(
    ("status", "body", "kind", "code"),
    [
        (401, {"detail": "unauthorized"}, UnauthorizedError, "unauthorized"),
        (404, {"detail": "work item not found"}, NotFoundError, "not_found"),
        (
            409,
            {"error": "bundle_changed", "detail": [{"field": "sha256", "message": "again"}]},
            ConflictError,
            "bundle_changed",
        ),
        (
            422,
            {"error": "invalid_message", "detail": [{"field": "work", "message": "required"}]},
            InvalidRequestError,
            "invalid_message",
        ),
    ],
)
def test_an_answer_refused_is_a_typed_error_with_the_apis_code(
    status: int, body: dict[str, Any], kind: type[ApiError], code: str
) -> None:
    api = scripted(httpx.Response(status, json=body))
    with api.client() as corral, pytest.raises(kind) as raised:
        corral.cancel("wi-1")
    assert (raised.value.status, raised.value.error) == (status, code)
    assert TOKEN not in str(raised.value) and TOKEN not in repr(corral)
    assert len(api.seen) == 1  # not retried


def test_an_answer_not_of_the_api_is_an_api_error_with_its_text() -> None:
    api = scripted(httpx.Response(502, text="<html>bad gateway</html>"))
    with api.client() as corral, pytest.raises(ApiError, match="HTTP 502 http_502: <html>"):
        corral.get("wi-1")


def test_an_answer_the_client_cannot_read_is_a_typed_error() -> None:
    api = scripted(httpx.Response(200, json={**view(), "added_later": 1}))
    with api.client() as corral, pytest.raises(UnexpectedAnswerError, match="WorkItemView"):
        corral.get("wi-1")


def test_invalid_fields_are_named() -> None:
    refused = {"error": "invalid_message", "detail": [{"field": "work", "message": "required"}]}
    api = scripted(httpx.Response(422, json=refused))
    with api.client() as corral, pytest.raises(InvalidRequestError) as raised:
        corral.dispatch({"org": "acme"})
    assert [(p.field, p.message) for p in raised.value.problems] == [("work", "required")]


def _pages(request: httpx.Request) -> httpx.Response:
    cursor = request.url.params.get("cursor")
    if cursor is None:
        return httpx.Response(200, json={"items": [row("wi-3"), row("wi-2")], "next_cursor": "c2"})
    return httpx.Response(200, json={"items": [row("wi-1")], "next_cursor": None})


def test_list_follows_the_cursor_and_sends_the_filters() -> None:
    api = Api(_pages)
    with api.client() as corral:
        rows = corral.list(project="web", state=["failed", "cancelled"], limit=2)
        assert [r.id for r in rows] == ["wi-3", "wi-2", "wi-1"]
    first, second = (r.url.params for r in api.seen)
    assert first.get_list("state") == ["failed", "cancelled"] and first["limit"] == "2"
    assert second["cursor"] == "c2" and second["project"] == "web"


def _until_final(states: list[str]) -> Handler:
    left = iter(states)
    return lambda request: httpx.Response(200, json=view(state=next(left)))


def test_wait_asks_again_until_the_item_is_final() -> None:
    api = Api(_until_final(["running", "succeeded"]))
    with api.client() as corral:
        assert corral.wait("wi-1", timeout_s=30).state == "succeeded"
    waits = [float(r.url.params["wait"]) for r in api.seen]
    assert len(waits) == 2 and 29 < waits[0] <= 30


def test_wait_asks_at_most_a_minute_a_request() -> None:
    api = Api(_until_final(["succeeded"]))
    with api.client() as corral:
        corral.wait("wi-1")
    assert api.seen[0].url.params["wait"] == "60.000"


def test_wait_raises_a_timeout_naming_the_item() -> None:
    api = Api(lambda request: httpx.Response(200, json=view(state="running")))
    with api.client() as corral, pytest.raises(WaitTimeoutError) as raised:
        corral.wait("wi-1", timeout_s=0.2)
    assert isinstance(raised.value, TimeoutError)
    assert raised.value.item_id == "wi-1" and "wi-1" in str(raised.value)


def _logged_api() -> Api:
    """An item running with two lines, then final with a third."""
    state = {"final": False}

    def answer(request: httpx.Request) -> httpx.Response:
        if request.url.path.endswith("/logs"):
            after = int(request.url.params["after"])
            lines = [(1, "one"), (2, "two")] + ([(3, "three")] if state["final"] else [])
            shown = [{"id": i, "stream": "stdout", "line": t} for i, t in lines if i > after]
            return httpx.Response(200, json={"lines": shown, "dropped_lines": 0})
        if "wait" in request.url.params:
            state["final"] = True
        return httpx.Response(200, json=view(state="succeeded" if state["final"] else "running"))

    return Api(answer)


def test_following_logs_reads_until_the_item_is_final_and_drained() -> None:
    api = _logged_api()
    with api.client() as corral:
        lines = [line.line for line in corral.logs("wi-1", follow=True, poll_interval_s=0.01)]
    assert lines == ["one", "two", "three"]
    assert api.paths()[-2:] == ["GET /v1/work-items/wi-1/logs"] * 2


def test_logs_without_follow_read_what_is_stored() -> None:
    api = _logged_api()
    with api.client() as corral:
        assert [line.id for line in corral.logs("wi-1")] == [1, 2]
    assert all(r.url.path.endswith("/logs") for r in api.seen)


def _bundle_api(stated: str | None, body: bytes = b"tar bytes") -> Api:
    def answer(request: httpx.Request) -> httpx.Response:
        headers = {"X-Corral-Bundle-Sha256": stated} if stated else {}
        return httpx.Response(200, content=body, headers=headers)

    return Api(answer)


def test_a_bundle_is_streamed_to_a_file_and_its_digest_answered(tmp_path: Path) -> None:
    digest = hashlib.sha256(b"tar bytes").hexdigest()
    with _bundle_api(digest).client() as corral:
        assert corral.bundle("wi-1", tmp_path / "b.tar.gz") == digest
    assert (tmp_path / "b.tar.gz").read_bytes() == b"tar bytes"


def test_a_bundle_not_the_one_stated_leaves_no_file(tmp_path: Path) -> None:
    with _bundle_api("0" * 64).client() as corral, pytest.raises(BundleDigestError):
        corral.bundle("wi-1", tmp_path / "b.tar.gz")
    assert list(tmp_path.iterdir()) == []


class _BrokenStream(httpx.SyncByteStream):
    """A body that breaks off after its first bytes."""

    def __iter__(self) -> Iterator[bytes]:
        yield b"tar "
        raise httpx.ReadError("connection reset")


def test_a_bundle_broken_off_is_downloaded_again_from_the_start(tmp_path: Path) -> None:
    whole = hashlib.sha256(b"tar bytes").hexdigest()
    api = scripted(
        httpx.Response(200, stream=_BrokenStream()),
        httpx.Response(200, content=b"tar bytes", headers={"X-Corral-Bundle-Sha256": whole}),
    )
    with api.client() as corral:
        assert corral.bundle("wi-1", tmp_path / "b.tar.gz") == whole
    assert (tmp_path / "b.tar.gz").read_bytes() == b"tar bytes"
    assert [p.name for p in tmp_path.iterdir()] == ["b.tar.gz"]


def test_a_missing_bundle_is_not_found_and_leaves_no_file(tmp_path: Path) -> None:
    api = scripted(httpx.Response(404, json={"detail": "no bundle"}))
    with api.client() as corral, pytest.raises(NotFoundError):
        corral.bundle("wi-1", tmp_path / "b.tar.gz")
    assert list(tmp_path.iterdir()) == []


def test_a_decision_names_the_digest() -> None:
    api = scripted(httpx.Response(200, json={"id": "wi-1", "review": "accepted"}))
    with api.client() as corral:
        assert corral.accept_bundle("wi-1", "a" * 64).review == "accepted"
    assert json.loads(api.seen[0].content) == {"sha256": "a" * 64}
    assert api.paths() == ["POST /v1/work-items/wi-1/bundle/accept"]


def test_an_item_id_cannot_leave_its_path() -> None:
    api = scripted(httpx.Response(404, json={"detail": "work item not found"}))
    with api.client() as corral, pytest.raises(NotFoundError):
        corral.get("../admin/pools")
    assert api.seen[0].url.raw_path == b"/v1/work-items/..%2Fadmin%2Fpools"


def test_the_async_client_makes_the_same_calls(tmp_path: Path) -> None:
    busy = httpx.Response(503, json={"error": "database_unavailable", "detail": []})
    dispatch = scripted(busy, httpx.Response(202, json=DISPATCHED))

    async def calls() -> tuple[Any, ...]:
        async with dispatch.async_client() as corral:
            sent = await corral.dispatch(MESSAGE)
        async with _logged_api().async_client() as corral:
            lines = [line.line async for line in corral.logs("wi-1", follow=True)]
            final = await corral.wait("wi-1", timeout_s=5)
        async with Api(_pages).async_client() as corral:
            rows = [r.id async for r in corral.list()]
        async with _bundle_api(None).async_client() as corral:
            digest = await corral.bundle("wi-1", tmp_path / "b")
        return sent.id, lines, final.state, rows, digest

    assert asyncio.run(calls()) == (
        "wi-1",
        ["one", "two", "three"],
        "succeeded",
        ["wi-3", "wi-2", "wi-1"],
        hashlib.sha256(b"tar bytes").hexdigest(),
    )
    assert len({r.headers["Idempotency-Key"] for r in dispatch.seen}) == 1


def test_an_iteration_left_early_sends_nothing_more() -> None:
    api = Api(_pages)
    with api.client() as corral:
        rows: Iterator[Any] = corral.list()
        assert next(rows).id == "wi-3"
    assert len(api.seen) == 1


def test_importing_the_client_loads_no_web_framework() -> None:
    probe = "import sys, corral.client; print(sorted({'fastapi', 'starlette'} & set(sys.modules)))"
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]"
