"""The api on real PostgreSQL: dispatch intake, tokens, runner sessions and org isolation."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest
from fastapi.testclient import TestClient
from pydantic import SecretStr
from sqlalchemy import func, select
from sqlalchemy.exc import OperationalError

from corral.providers.base import SandboxState
from corral.scheduler.admin.pools import PoolCreate, ProfileCreate, create_pool, create_profile
from corral.scheduler.api import runner_api
from corral.scheduler.api.app import create_app
from corral.shared import runtime
from corral.shared.broker import celery_app
from corral.shared.settings import CoreSettings
from corral.shared.store.db import Database, make_engine, utcnow
from corral.shared.store.lifecycle import sandbox_transition, transition
from corral.shared.store.models import (
    AuthMode,
    ItemState,
    RegistrationToken,
    RunnerSession,
    Sandbox,
    WorkItem,
)
from corral.shared.store.tokens import mint_registration_token

ADMIN = "admin-token-for-tests"


@pytest.fixture
def client(pg_db: Database, postgres_database_url: str) -> Iterator[TestClient]:
    settings = CoreSettings(
        database_url=postgres_database_url, admin_token=SecretStr(ADMIN), broker_url="memory://"
    )
    celery_app.configure(settings)  # tasks the api sends stay in this process's memory broker
    runtime.install(runtime.Runtime(settings=settings, db=pg_db))
    with TestClient(create_app()) as test_client:
        yield test_client
    runtime.reset()


def admin_headers(**extra: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {ADMIN}", **extra}


def message(org: str, **fields: Any) -> dict[str, Any]:
    return {
        "org": org,
        "project": "web",
        "profile": "default",
        "work": {"kind": "shell", "command": "echo hi"},
        **fields,
    }


def awaiting_item(db: Database, org: str, **fields: Any) -> tuple[str, str]:
    """A work item of ``org`` (its message with ``fields``) whose sandbox waits for its
    runner, and that runner's token."""
    create_profile(db, ProfileCreate(name="default", model="m", auth_mode=AuthMode.BYOK))
    pool = create_pool(
        db, PoolCreate(org_id=org, name=f"p-{uuid.uuid4().hex[:6]}", provider_id="local")
    )
    item_id = f"wi-{uuid.uuid4().hex}"
    with db.session() as session:
        item = WorkItem(
            id=item_id,
            org_id=org,
            project_id="web",
            profile="default",
            payload=message(org, **fields),
            state=ItemState.RECEIVED.value,
            pool_id=pool["id"],
            attempts=1,
        )
        session.add(item)
        session.flush()  # the sandbox row refers to it
        sandbox = Sandbox(
            id=f"sb-{uuid.uuid4().hex}",
            work_item_id=item_id,
            attempt=1,
            org_id=org,
            pool_id=pool["id"],
            provider_id="local",
            status=SandboxState.PROVISIONING.value,
        )
        session.add(sandbox)
        session.flush()
        for state in (ItemState.ROUTED, ItemState.PROVISIONING, ItemState.AWAITING_CLAIM):
            transition(session, item, state, actor="test")
        sandbox_transition(session, sandbox, SandboxState.READY, actor="test")
        token = mint_registration_token(session, sandbox, ttl_s=60)
    return item_id, token


def counts(db: Database) -> tuple[int, int]:
    with db.session() as session:
        sessions = session.scalar(select(func.count()).select_from(RunnerSession)) or 0
        redeemed = (
            session.scalar(
                select(func.count())
                .select_from(RegistrationToken)
                .where(RegistrationToken.redeemed_at.is_not(None))
            )
            or 0
        )
    return sessions, redeemed


def test_dispatch_answers_202_with_the_id_and_repeats_return_the_same_item(
    client: TestClient,
) -> None:
    org = f"org-{uuid.uuid4().hex[:8]}"
    profile = {"name": "default", "model": "m", "auth_mode": "byok"}
    made = client.post("/v1/admin/profiles", json=profile, headers=admin_headers())
    assert made.status_code in (201, 409)  # an earlier test of the session may have made it
    first = client.post(
        "/v1/dispatch", json=message(org), headers=admin_headers(**{"Idempotency-Key": "k1"})
    )
    again = client.post(
        "/v1/dispatch", json=message(org), headers=admin_headers(**{"Idempotency-Key": "k1"})
    )
    other = client.post(
        "/v1/dispatch", json=message(org), headers=admin_headers(**{"Idempotency-Key": "k2"})
    )
    assert first.status_code == 202
    assert again.status_code == 200
    assert again.json() == first.json() | {"created": False}
    assert first.json()["id"] == again.json()["id"]
    assert other.json()["id"] != first.json()["id"]
    view = client.get(f"/v1/work-items/{first.json()['id']}", headers=admin_headers()).json()
    # Accepted and routed in the same transaction before the answer (this org has no pool).
    assert (view["state"], view["error"]["code"]) == ("dispatch_error", "no_eligible_pool")


def test_malformed_dispatch_over_http_is_422_with_field_errors(client: TestClient) -> None:
    bad = {
        "org": "acme",
        "project": "web",
        "work": {"kind": "shell"},
        "colour": "blue",
        "env": {"K": 5},
    }
    answer = client.post("/v1/dispatch", json=bad, headers=admin_headers())
    assert answer.status_code == 422
    body = answer.json()
    assert body["error"] == "invalid_message"
    fields = {error["field"] for error in body["detail"]}
    assert {"work.shell.command", "colour", "env.*"} <= fields  # env names hidden
    assert "profile" not in fields  # none named: `default`
    not_json = client.post("/v1/dispatch", content=b"{nope", headers=admin_headers())
    assert not_json.status_code == 422
    # The api keeps serving.
    assert (
        client.post("/v1/dispatch", json=message("acme"), headers=admin_headers()).status_code
        == 202
    )


def test_dispatch_and_reads_need_the_admin_token(client: TestClient) -> None:
    assert client.post("/v1/dispatch", json=message("acme")).status_code == 401
    wrong = {"Authorization": "Bearer not-the-token"}
    assert client.post("/v1/dispatch", json=message("acme"), headers=wrong).status_code == 401
    assert client.get("/v1/admin/pools", headers=wrong).status_code == 401
    assert client.get("/livez").json() == {"status": "ok"}


def test_register_redeems_a_token_once(client: TestClient, pg_db: Database) -> None:
    item_id, token = awaiting_item(pg_db, f"org-{uuid.uuid4().hex[:8]}")
    first = client.post("/v1/runner/register", json={"token": token})
    assert first.status_code == 200
    body = first.json()
    assert body["work_item_id"] == item_id
    assert body["session_token"].startswith("crs_")
    before = counts(pg_db)
    replay = client.post("/v1/runner/register", json={"token": token})
    assert replay.status_code == 401
    assert replay.json() == {"detail": "unauthorized"}
    assert counts(pg_db) == before  # the replay changed nothing


def test_a_registration_asking_to_claim_carries_the_claim_a_repeat_of_it_answers_the_same(
    client: TestClient, pg_db: Database
) -> None:
    item_id, token = awaiting_item(pg_db, f"org-{uuid.uuid4().hex[:8]}")
    answer = client.post("/v1/runner/register", json={"token": token, "claim": True})
    assert answer.status_code == 200, answer.text
    body = answer.json()
    assert body["claim"]["work_item_id"] == item_id and body["claim"]["work"]["kind"] == "shell"
    as_runner = {"Authorization": f"Bearer {body['session_token']}"}
    view = client.get(f"/v1/work-items/{item_id}", headers=admin_headers()).json()
    assert view["state"] == "running"
    # A lost answer's retry of the claim (apart) is handed the same work.
    again = client.post("/v1/runner/claim", json={}, headers=as_runner)
    assert again.status_code == 200 and again.json() == body["claim"]
    # Without asking, no claim: the item waits for /claim as before.
    other_id, other = awaiting_item(pg_db, f"org-{uuid.uuid4().hex[:8]}")
    plain = client.post("/v1/runner/register", json={"token": other}).json()
    assert plain["claim"] is None
    view = client.get(f"/v1/work-items/{other_id}", headers=admin_headers()).json()
    assert view["state"] == "awaiting_claim"


def test_a_registration_whose_claim_fails_on_the_database_holds_and_the_claim_apart_works(
    client: TestClient, pg_db: Database, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A failed claim must not cost the runner its registration: its token is spent, so a
    # retried register would be refused.
    item_id, token = awaiting_item(pg_db, f"org-{uuid.uuid4().hex[:8]}")
    take = runner_api._take

    def failing(*args: Any, refuse: bool) -> Any:
        if not refuse:
            raise OperationalError("SELECT 1", {}, Exception("the database went away"))
        return take(*args, refuse=refuse)

    monkeypatch.setattr(runner_api, "_take", failing)
    answer = client.post("/v1/runner/register", json={"token": token, "claim": True})
    assert answer.status_code == 200, answer.text
    assert answer.json()["claim"] is None
    as_runner = {"Authorization": f"Bearer {answer.json()['session_token']}"}
    claimed = client.post("/v1/runner/claim", json={}, headers=as_runner)
    assert claimed.status_code == 200 and claimed.json()["work_item_id"] == item_id


def test_a_registration_asking_to_claim_an_item_that_moved_on_is_registered_without_it(
    client: TestClient, pg_db: Database
) -> None:
    item_id, token = awaiting_item(pg_db, f"org-{uuid.uuid4().hex[:8]}")
    assert client.post(f"/v1/work-items/{item_id}/cancel", headers=admin_headers()).is_success
    answer = client.post("/v1/runner/register", json={"token": token, "claim": True})
    assert answer.status_code == 200, answer.text
    assert answer.json()["claim"] is None
    as_runner = {"Authorization": f"Bearer {answer.json()['session_token']}"}
    refused = client.post("/v1/runner/claim", json={}, headers=as_runner)
    assert (refused.status_code, refused.json()["detail"]) == (409, "work item is cancelled")


@pytest.mark.parametrize("kind", ["expired", "made-up", "wrong-prefix", "empty"])
def test_every_bad_token_gets_the_same_401_and_changes_nothing(
    client: TestClient, pg_db: Database, kind: str
) -> None:
    _, token = awaiting_item(pg_db, f"org-{uuid.uuid4().hex[:8]}")
    if kind == "expired":
        with pg_db.session() as session:
            for row in session.scalars(select(RegistrationToken)):
                row.expires_at = utcnow() - timedelta(seconds=1)
    else:
        token = {"made-up": "crt_" + "A" * 43, "wrong-prefix": "xyz_" + token[4:], "empty": ""}[
            kind
        ]
    before = counts(pg_db)
    answer = client.post("/v1/runner/register", json={"token": token})
    assert answer.status_code == 401
    assert answer.json() == {"detail": "unauthorized"}
    assert counts(pg_db) == before


def test_a_runner_session_only_reaches_its_own_item(client: TestClient, pg_db: Database) -> None:
    item_a, token_a = awaiting_item(pg_db, f"orga-{uuid.uuid4().hex[:8]}")
    item_b, token_b = awaiting_item(pg_db, f"orgb-{uuid.uuid4().hex[:8]}")
    session_a = client.post("/v1/runner/register", json={"token": token_a}).json()["session_token"]
    session_b = client.post("/v1/runner/register", json={"token": token_b}).json()["session_token"]
    as_a = {"Authorization": f"Bearer {session_a}"}

    assert client.get(f"/v1/work-items/{item_b}", headers=as_a).status_code == 404
    assert client.get(f"/v1/work-items/{item_b}/logs", headers=as_a).status_code == 404
    assert (
        client.post("/v1/runner/claim", json={"work_item_id": item_b}, headers=as_a).status_code
        == 404
    )
    done = {"work_item_id": item_b, "exit_code": 0}
    assert client.post("/v1/runner/complete", json=done, headers=as_a).status_code == 404
    assert (
        client.get(f"/v1/work-items/{item_b}", headers=admin_headers()).json()["state"]
        == "awaiting_claim"
    )

    claimed = client.post("/v1/runner/claim", json={}, headers=as_a)
    assert claimed.status_code == 200
    assert claimed.json()["work_item_id"] == item_a
    assert client.get(f"/v1/work-items/{item_a}", headers=as_a).json()["state"] == "running"
    finished = client.post(
        "/v1/runner/complete", json={"exit_code": 0, "result": [1]}, headers=as_a
    )
    assert finished.json() == {"state": "succeeded"}
    # B's own session still works for B.
    as_b = {"Authorization": f"Bearer {session_b}"}
    assert client.post("/v1/runner/claim", json={}, headers=as_b).json()["work_item_id"] == item_b


def test_heartbeat_tells_the_runner_to_stop_a_cancelled_item(
    client: TestClient, pg_db: Database
) -> None:
    item_id, token = awaiting_item(pg_db, f"org-{uuid.uuid4().hex[:8]}")
    session_token = client.post("/v1/runner/register", json={"token": token}).json()[
        "session_token"
    ]
    as_runner = {"Authorization": f"Bearer {session_token}"}
    client.post("/v1/runner/claim", json={}, headers=as_runner)
    assert client.post("/v1/runner/heartbeat", json={}, headers=as_runner).json() == {
        "cancel": False
    }
    assert (
        client.post(f"/v1/work-items/{item_id}/cancel", headers=admin_headers()).status_code == 200
    )
    assert client.post("/v1/runner/heartbeat", json={}, headers=as_runner).json() == {
        "cancel": True
    }
    events = client.get(f"/v1/work-items/{item_id}/events", headers=admin_headers()).json()[
        "events"
    ]
    assert [e["to"] for e in events if e["entity"] == "work_item"][-2:] == ["running", "cancelled"]


def _claimed(client: TestClient, pg_db: Database) -> tuple[str, dict[str, str]]:
    item_id, token = awaiting_item(pg_db, f"org-{uuid.uuid4().hex[:8]}")
    registered = client.post("/v1/runner/register", json={"token": token}).json()
    as_runner = {"Authorization": f"Bearer {registered['session_token']}"}
    assert client.post("/v1/runner/claim", json={}, headers=as_runner).status_code == 200
    return item_id, as_runner


def _log_lines(client: TestClient, item_id: str) -> list[str]:
    answer = client.get(f"/v1/work-items/{item_id}/logs", headers=admin_headers())
    return [line["line"] for line in answer.json()["lines"]]


def test_a_report_keeps_the_last_log_lines_it_carries_once(
    client: TestClient, pg_db: Database
) -> None:
    item_id, as_runner = _claimed(client, pg_db)
    lines = [{"stream": "stdout", "line": "last"}, {"stream": "system", "line": "exit 0"}]
    report = {"exit_code": 0, "lines": lines}

    first = client.post("/v1/runner/complete", json=report, headers=as_runner)
    repeated = client.post("/v1/runner/complete", json=report, headers=as_runner)  # a retry

    assert first.json() == repeated.json() == {"state": "succeeded"}
    assert _log_lines(client, item_id) == ["last", "exit 0"]


def test_a_report_of_an_item_cancelled_from_outside_still_keeps_its_lines(
    client: TestClient, pg_db: Database
) -> None:
    item_id, as_runner = _claimed(client, pg_db)
    assert (
        client.post(f"/v1/work-items/{item_id}/cancel", headers=admin_headers()).status_code == 200
    )
    report = {"exit_code": 143, "cancelled": True, "lines": [{"line": "stopped"}]}

    answer = client.post("/v1/runner/complete", json=report, headers=as_runner)

    assert answer.json() == {"state": "cancelled"}
    assert _log_lines(client, item_id) == ["stopped"]


def test_a_session_ends_with_its_sandbox(client: TestClient, pg_db: Database) -> None:
    item_id, token = awaiting_item(pg_db, f"org-{uuid.uuid4().hex[:8]}")
    session_token = client.post("/v1/runner/register", json={"token": token}).json()[
        "session_token"
    ]
    as_runner = {"Authorization": f"Bearer {session_token}"}
    assert client.post("/v1/runner/claim", json={}, headers=as_runner).status_code == 200
    with pg_db.session() as session:
        sandbox = session.scalars(select(Sandbox).where(Sandbox.work_item_id == item_id)).one()
        sandbox.terminated_at = utcnow()
    assert client.post("/v1/runner/heartbeat", json={}, headers=as_runner).status_code == 401
    line = {"lines": [{"line": "late"}]}
    assert client.post("/v1/runner/logs", json=line, headers=as_runner).status_code == 401


def test_livez_answers_while_readyz_names_what_is_down(
    client: TestClient, pg_db: Database, postgres_database_url: str
) -> None:
    assert client.get("/livez").json() == {"status": "ok"}
    ready = {"status": "ok", "database": "ok", "broker": "ok"}
    assert client.get("/readyz").json() == ready
    assert client.get("/healthz").json() == ready

    down = CoreSettings(
        database_url=postgres_database_url, broker_url="redis://127.0.0.1:1/0", broker_key_prefix=""
    )
    celery_app.configure(down)  # a broker nobody listens on
    try:
        answer = client.get("/readyz")
        assert answer.status_code == 503
        assert answer.json() == {"status": "unavailable", "database": "ok", "broker": "unreachable"}
        assert "127.0.0.1:1" not in answer.text
        assert client.get("/livez").status_code == 200  # alive: no restart for a broker blip
    finally:
        celery_app.configure(CoreSettings(broker_url="memory://"))

    gone = Database(make_engine("postgresql+psycopg://nobody@127.0.0.1:1/none"))
    runtime.install(runtime.Runtime(settings=runtime.current().settings, db=gone))
    try:
        answer = client.get("/readyz")
        assert answer.status_code == 503
        assert answer.json()["database"] == "unreachable"
        assert client.get("/livez").status_code == 200
    finally:
        gone.dispose()
