"""The runner protocol's limits on real PostgreSQL: the per-item log budget and the rate
limits (per session, per address, registration)."""

from __future__ import annotations

import time
import uuid

from fastapi.testclient import TestClient

from corral.scheduler.api.throttle import TokenBuckets
from corral.shared.store.completion import MAX_RESULT_BYTES
from corral.shared.store.db import Database
from tests.integration.api_clients import ClientFactory, runner_headers
from tests.integration.test_api import admin_headers, awaiting_item


def org() -> str:
    return f"org-{uuid.uuid4().hex[:8]}"


def post_lines(client: TestClient, headers: dict[str, str], *lines: str) -> dict[str, int]:
    batch = {"lines": [{"stream": "stdout", "line": line} for line in lines]}
    answer = client.post("/v1/runner/logs", json=batch, headers=headers)
    assert answer.status_code == 200, answer.text
    counts: dict[str, int] = answer.json()
    return counts


def test_lines_past_the_log_budget_are_dropped_counted_and_reported(
    make_client: ClientFactory, pg_db: Database
) -> None:
    client = make_client(log_budget_lines=5, log_budget_bytes=1000)
    item_id, headers = runner_headers(client, pg_db, org())
    assert post_lines(client, headers, "a", "b", "c") == {"accepted": 3, "dropped": 0}
    assert post_lines(client, headers, "d", "e", "f", "g") == {"accepted": 2, "dropped": 2}
    assert post_lines(client, headers, "h") == {"accepted": 0, "dropped": 1}

    logs = client.get(f"/v1/work-items/{item_id}/logs", headers=admin_headers()).json()
    assert [line["line"] for line in logs["lines"]] == ["a", "b", "c", "d", "e"]
    assert logs["dropped_lines"] == 3
    view = client.get(f"/v1/work-items/{item_id}", headers=admin_headers()).json()
    assert view["logs"] == {"lines": 5, "bytes": 5, "dropped_lines": 3}


def test_the_byte_budget_keeps_the_beginning_of_the_log(
    make_client: ClientFactory, pg_db: Database
) -> None:
    client = make_client(log_budget_lines=1000, log_budget_bytes=10)
    item_id, headers = runner_headers(client, pg_db, org())
    # "é" is two bytes: 8 + 4 > 10, and the short line after it is not kept either.
    assert post_lines(client, headers, "12345678", "éé", "x") == {"accepted": 1, "dropped": 2}
    view = client.get(f"/v1/work-items/{item_id}", headers=admin_headers()).json()
    assert view["logs"] == {"lines": 1, "bytes": 8, "dropped_lines": 2}


def test_a_session_over_its_rate_gets_429_with_retry_after_and_then_goes_on(
    make_client: ClientFactory, pg_db: Database
) -> None:
    client = make_client(runner_rate_per_s=1, runner_rate_burst=3)
    _, headers = runner_headers(client, pg_db, org())  # claim: the burst's first token
    statuses = [
        client.post("/v1/runner/heartbeat", json={}, headers=headers).status_code for _ in range(4)
    ]
    assert statuses[:2] == [200, 200] and 429 in statuses
    refused = client.post("/v1/runner/heartbeat", json={}, headers=headers)
    assert refused.status_code == 429
    assert refused.headers["Retry-After"] == "1"
    assert refused.json() == {
        "error": "rate_limited",
        "detail": [{"field": "(request)", "message": "too many calls; retry after 1 s"}],
    }
    deadline = time.monotonic() + 10  # a token comes back within a second
    while client.post("/v1/runner/heartbeat", json={}, headers=headers).status_code == 429:
        assert time.monotonic() < deadline
        time.sleep(0.05)


def test_a_session_over_its_rate_does_not_use_up_its_addresss_bucket(
    make_client: ClientFactory, pg_db: Database
) -> None:
    client = make_client(
        runner_rate_per_s=0.01,
        runner_rate_burst=2,
        runner_address_rate_per_s=0.01,
        runner_address_burst=8,
    )
    _, flooding = runner_headers(client, pg_db, org())  # register, claim: 2 address tokens
    statuses = [
        client.post("/v1/runner/heartbeat", json={}, headers=flooding).status_code
        for _ in range(20)
    ]
    assert statuses == [200] + [429] * 19  # the session's second token, then its own 429s
    # The refused calls took nothing from the address's 8 tokens: 3 were used, 5 are left.
    _, other = runner_headers(client, pg_db, org())
    assert client.post("/v1/runner/heartbeat", json={}, headers=other).status_code == 200


def test_registration_is_limited_per_address(make_client: ClientFactory, pg_db: Database) -> None:
    client = make_client(register_rate_per_s=0.01, register_burst=2)
    _, token = awaiting_item(pg_db, org())
    answers = [
        client.post("/v1/runner/register", json={"token": "crt_" + "x" * 43}) for _ in range(2)
    ]
    assert [a.status_code for a in answers] == [401, 401]
    refused = client.post("/v1/runner/register", json={"token": token})
    assert refused.status_code == 429
    assert 90 <= int(refused.headers["Retry-After"]) <= 100  # a token every 100 s


def test_token_buckets_refill_at_their_rate_and_forget_the_least_recently_used() -> None:
    now = [0.0]
    buckets = TokenBuckets(max_keys=2, clock=lambda: now[0])
    assert [buckets.take("a", rate=2, burst=2) for _ in range(3)] == [0, 0, 0.5]
    now[0] = 0.25
    assert buckets.take("a", rate=2, burst=2) == 0.25  # half a token back: half the wait
    now[0] = 0.5
    assert buckets.take("a", rate=2, burst=2) == 0  # a whole token
    assert buckets.take("b", rate=2, burst=2) == 0
    assert buckets.take("c", rate=2, burst=2) == 0
    assert len(buckets) == 2  # "a" forgotten: a fresh, full bucket next time
    assert buckets.take("a", rate=2, burst=2) == 0
    assert buckets.take("z", rate=0, burst=1) == 0  # rate 0: no limit


def test_a_result_over_the_limit_fails_the_item_result_too_large_whoever_measured_it(
    make_client: ClientFactory, pg_db: Database
) -> None:
    client = make_client()
    # The claim tells the runner the limit.
    item_id, token = awaiting_item(pg_db, org())
    registered = client.post("/v1/runner/register", json={"token": token}).json()
    headers = {"Authorization": f"Bearer {registered['session_token']}"}
    claimed = client.post("/v1/runner/claim", json={}, headers=headers).json()
    assert claimed["max_result_bytes"] == MAX_RESULT_BYTES
    # An older runner that sends the result anyway (within the body limit): not stored.
    big = "x" * (MAX_RESULT_BYTES + 10)
    done = client.post("/v1/runner/complete", json={"exit_code": 0, "result": big}, headers=headers)
    assert done.status_code == 200, done.text[:200]
    assert done.json() == {"state": "failed"}
    view = client.get(f"/v1/work-items/{item_id}", headers=admin_headers()).json()
    assert view["error"]["code"] == "result_too_large"
    assert f"limit of {MAX_RESULT_BYTES} bytes" in view["error"]["message"]
    assert view["result"] is None
    # A runner that kept its result back says so.
    other_id, other = runner_headers(client, pg_db, org())
    body = {"exit_code": 0, "result": None, "error_code": "result_too_large", "error": "kept"}
    assert client.post("/v1/runner/complete", json=body, headers=other).json() == {
        "state": "failed"
    }
    other_view = client.get(f"/v1/work-items/{other_id}", headers=admin_headers()).json()
    assert other_view["error"]["code"] == "result_too_large"
