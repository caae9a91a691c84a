"""Org api keys on real PostgreSQL: every route of the api, asked by another org's key with
every scope, answers 403 or 404 and never the other org's data; a key acts for its own org
with the scopes it holds; keys are kept as hashes and shown once; a revoked key is refused."""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from typing import Any

import pytest
from fastapi.routing import APIRoute
from fastapi.testclient import TestClient
from sqlalchemy import select, text

from corral.scheduler.admin.budgets import BudgetSet, set_budget
from corral.scheduler.admin.providers import set_credential
from corral.scheduler.api.interactive import SessionCreate, create_session
from corral.shared import runtime
from corral.shared.store import secrets
from corral.shared.store.api_keys import revoke_key
from corral.shared.store.db import Database
from corral.shared.store.models import ApiKey, InteractiveSession, Pool
from tests.conftest import TEST_SECRET_KEY
from tests.integration.api_clients import ClientFactory, api_routes, runner_headers
from tests.integration.test_api import admin_headers, awaiting_item, message

Request = tuple[str, str, dict[str, Any]]


@dataclass(frozen=True)
class Victim:
    """Another org's rows, each with a mark that must never appear in an answer."""

    org: str
    item: str
    pool: str
    pool_name: str
    budget: str
    session: str
    key: str
    marks: tuple[str, ...]


def make_key(client: TestClient, org: str, *scopes: str) -> str:
    answer = client.post(
        f"/v1/admin/orgs/{org}/keys",
        json={"name": "test key", "scopes": list(scopes)},
        headers=admin_headers(),
    )
    assert answer.status_code == 201, answer.text
    key = answer.json()["key"]
    assert key.startswith("cok_")
    return str(key)


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


@pytest.fixture
def client(make_client: ClientFactory) -> TestClient:
    return make_client(secret_key=TEST_SECRET_KEY)


def make_victim(client: TestClient, db: Database) -> Victim:
    org = f"victim-{uuid.uuid4().hex[:8]}"
    command = f"echo secret-work-{uuid.uuid4().hex[:8]}"
    item, _ = awaiting_item(db, org, work={"kind": "shell", "command": command})
    with db.session() as session:
        pool_id, pool_name = session.execute(
            select(Pool.id, Pool.name).where(Pool.org_id == org)
        ).one()
    budget = set_budget(db, BudgetSet(org_id=org, period="month", cap_micros=1000))
    set_credential(runtime.current(), org, "e2b", "victim-credential-value")
    secrets.set_secret(db, org, "victim-secret", "victim-secret-value")
    make_key(client, org, "read")
    key = client.get(f"/v1/admin/orgs/{org}/keys", headers=admin_headers()).json()["keys"][0]
    rt = runtime.current()
    body = SessionCreate(org=org, project="p", profile="default")
    session_id, _ = create_session(db, body, rt.settings, actor="test")
    marks = (org, command, pool_name, "victim-credential-value", "victim-secret-value")
    return Victim(org, item, pool_id, pool_name, budget["id"], session_id, key["id"], marks)


def _item_routes(v: Victim) -> list[Request]:
    item = f"/v1/work-items/{v.item}"
    seen = {"json": {"sha256": "0" * 64}}  # a well-formed digest: the refusal is the caller's
    return [
        ("GET", item, {}),
        ("GET", f"{item}/logs", {}),
        ("GET", f"{item}/events", {}),
        ("GET", f"{item}/secret-uses", {}),
        ("POST", f"{item}/cancel", {}),
        ("GET", f"{item}/bundle", {}),
        ("POST", f"{item}/bundle/accept", seen),
        ("POST", f"{item}/bundle/reject", seen),
    ]


def _session_routes(v: Victim) -> list[Request]:
    session = f"/v1/sessions/{v.session}"
    create = {"org": v.org, "project": "p", "profile": "default"}
    return [
        ("POST", "/v1/sessions", {"json": create}),
        ("GET", session, {}),
        ("DELETE", session, {}),
        ("POST", f"{session}/exec", {"json": {"command": ["echo", "hi"]}}),
        ("PUT", f"{session}/files/a.txt", {"content": b"data"}),
        ("GET", f"{session}/files/a.txt", {}),
    ]


def _org_routes(v: Victim) -> list[Request]:
    orgs = f"/v1/admin/orgs/{v.org}"
    return [
        ("GET", f"/v1/admin/pools?org={v.org}", {}),
        ("PATCH", f"/v1/admin/pools/{v.pool}", {"json": {"active": False}}),
        ("DELETE", f"/v1/admin/pools/{v.pool}", {}),
        ("GET", f"/v1/costs?org={v.org}", {}),
        ("GET", f"/v1/sandboxes?org={v.org}", {}),
        ("GET", f"/v1/admin/budgets?org={v.org}", {}),
        ("PUT", "/v1/admin/budgets", {"json": {"org_id": v.org, "period": "day", "cap_micros": 1}}),
        ("DELETE", f"/v1/admin/budgets/{v.budget}", {}),
        ("POST", f"/v1/admin/providers/local/check?org={v.org}", {}),
        ("GET", f"{orgs}/credentials", {}),
        ("PUT", f"{orgs}/credentials/e2b", {"json": {"secret": "x"}}),
        ("DELETE", f"{orgs}/credentials/e2b", {}),
        ("POST", f"{orgs}/credentials/e2b/test", {}),
        ("GET", f"{orgs}/secrets", {}),
        ("PUT", f"{orgs}/secrets/victim-secret", {"json": {"value": "x"}}),
        ("DELETE", f"{orgs}/secrets/victim-secret", {}),
        ("POST", f"{orgs}/keys", {"json": {"name": "k", "scopes": ["read"]}}),
        ("GET", f"{orgs}/keys", {}),
        ("DELETE", f"{orgs}/keys/{v.key}", {}),
        ("GET", f"{orgs}/limits", {}),
        ("GET", f"{orgs}/weight", {}),
        ("GET", f"{orgs}/policy", {}),
        ("POST", f"{orgs}/webhooks", {"json": {"url": "https://example.com/hook"}}),
        ("GET", f"{orgs}/webhooks", {}),
        ("DELETE", f"{orgs}/webhooks/wh-x", {}),
        ("GET", f"{orgs}/webhooks/wh-x/deliveries", {}),
        ("POST", f"{orgs}/webhooks/events/evt_x/redeliver", {}),
    ]


def _deployment_routes(v: Victim) -> list[Request]:
    profile = {"name": "p2", "model": "m", "auth_mode": "byok"}
    pool = {"org_id": v.org, "name": "mine", "provider_id": "local"}
    return [
        ("POST", "/v1/dispatch", {"json": message(v.org)}),
        ("POST", "/v1/admin/profiles", {"json": profile}),
        ("POST", "/v1/admin/pools", {"json": pool}),
        ("GET", "/v1/admin/providers/local/config", {}),
        ("PUT", "/v1/admin/providers/local/config", {"json": {"config": {}}}),
        ("DELETE", "/v1/admin/providers/local/config", {}),
        ("PUT", f"/v1/admin/orgs/{v.org}/limits", {"json": {"max_concurrent": 1}}),
        ("PUT", f"/v1/admin/orgs/{v.org}/weight", {"json": {"weight": 9}}),
        ("DELETE", f"/v1/admin/orgs/{v.org}/weight", {}),
        ("POST", "/v1/admin/capacities", {"json": {"name": "mine", "slots": 1}}),
        ("GET", "/v1/admin/capacities", {}),
        ("GET", "/v1/admin/capacities/shared", {}),
        ("PATCH", "/v1/admin/capacities/shared", {"json": {"slots": 1}}),
        ("DELETE", "/v1/admin/capacities/shared", {}),
        ("PUT", f"/v1/admin/orgs/{v.org}/policy", {"json": {"item_images": ["*"]}}),
        ("GET", "/v1/admin/secrets", {}),
        ("PUT", "/v1/admin/secrets/shared", {"json": {"value": "x"}}),
        ("DELETE", "/v1/admin/secrets/shared", {}),
    ]


# Routes an org key may call that hold no org's rows, or list only the caller's own.
_OPEN = [
    ("GET", "/v1/admin/profiles", {}),
    ("GET", "/v1/admin/pools", {}),
    ("GET", "/v1/costs?by=org", {}),
    ("GET", "/v1/sandboxes", {}),
    ("GET", "/v1/admin/budgets", {}),
    ("GET", "/v1/admin/providers", {}),
    ("GET", "/v1/admin/providers/local/schema", {}),
    ("GET", "/v1/admin/pools/fields", {}),
    ("GET", "/v1/work-items", {}),
]


def _template(app_routes: list[APIRoute], method: str, path: str) -> str | None:
    bare = path.split("?", maxsplit=1)[0].strip("/").split("/")
    for route in app_routes:
        parts = route.path.strip("/").split("/")
        if method not in route.methods or len(parts) != len(bare):
            continue
        if all(p.startswith("{") or p == b for p, b in zip(parts, bare, strict=True)):
            return f"{method} {route.path}"
    return None


def _called(client: TestClient, key: str, request: Request) -> Any:
    method, path, extra = request
    return client.request(method, path, headers=bearer(key), **extra)


def test_another_orgs_key_gets_403_or_404_and_never_data_on_every_route(
    client: TestClient, pg_db: Database
) -> None:
    victim = make_victim(client, pg_db)
    intruder = make_key(client, f"intruder-{uuid.uuid4().hex[:8]}", "admin")
    refused = (
        _item_routes(victim)
        + _session_routes(victim)
        + _org_routes(victim)
        + _deployment_routes(victim)
    )
    for request in refused:
        answer = _called(client, intruder, request)
        assert answer.status_code in (403, 404), (request, answer.status_code, answer.text)
        assert not any(mark in answer.text for mark in victim.marks), request
    for request in _OPEN:
        answer = _called(client, intruder, request)
        assert answer.status_code == 200, (request, answer.text)
        assert not any(mark in answer.text for mark in victim.marks), request
    # Nothing of the victim's changed: its pool is still active, its key still live.
    with pg_db.session() as session:
        assert session.get_one(Pool, victim.pool).active is True
        assert session.get_one(ApiKey, victim.key).revoked_at is None
        assert session.get_one(InteractiveSession, victim.session).ended_at is None
    assert secrets.resolve_secret(pg_db, victim.org, "victim-secret") == "victim-secret-value"


def test_the_route_table_covers_every_route_of_the_api(client: TestClient) -> None:
    """A new route must say how an org key is scoped on it (added to a list above)."""
    routes = api_routes(client.app.routes)  # type: ignore[attr-defined]
    victim = Victim("o", "wi-x", "pool-x", "p", "budget-x", "ses-x", "key-x", ())
    listed = (
        _item_routes(victim)
        + _session_routes(victim)
        + _org_routes(victim)
        + _deployment_routes(victim)
        + _OPEN
    )
    covered = {_template(routes, method, path) for method, path, _ in listed}
    runner = {
        f"{m} {r.path}" for r in routes if r.path.startswith("/v1/runner/") for m in r.methods
    }
    unscoped = {"GET /livez", "GET /readyz", "GET /healthz"}
    # The console's routes take a console login, not a key: test_console walks each of them.
    everything = {
        f"{m} {r.path}"
        for r in routes
        if not r.path.startswith("/console")
        for m in r.methods
        if m != "HEAD"
    }
    assert sorted(everything - covered - runner - unscoped) == []


def test_a_runner_session_reads_its_own_item_and_nothing_else(
    client: TestClient, pg_db: Database
) -> None:
    """The work in a sandbox holds its runner's session token: with it, every route but its
    own item's reads answers 401, 403 or 404, and never another org's data."""
    victim = make_victim(client, pg_db)
    own, headers = runner_headers(client, pg_db, f"runner-{uuid.uuid4().hex[:8]}")
    token = headers["Authorization"].removeprefix("Bearer ")
    listed = (
        _item_routes(victim)
        + _session_routes(victim)
        + _org_routes(victim)
        + _deployment_routes(victim)
        + _OPEN
    )
    for request in listed:
        answer = _called(client, token, request)
        assert answer.status_code in (401, 403, 404), (request, answer.status_code, answer.text)
        assert not any(mark in answer.text for mark in victim.marks), request
    assert client.get(f"/v1/work-items/{own}", headers=headers).status_code == 200


def test_runner_routes_refuse_org_keys(client: TestClient) -> None:
    key = make_key(client, f"org-{uuid.uuid4().hex[:8]}", "admin")
    for path in ("/v1/runner/claim", "/v1/runner/heartbeat", "/v1/runner/complete"):
        assert client.post(path, json={}, headers=bearer(key)).status_code == 401, path


def test_a_key_acts_for_its_own_org_within_its_scopes(client: TestClient, pg_db: Database) -> None:
    org = f"own-{uuid.uuid4().hex[:8]}"
    item, _ = awaiting_item(pg_db, org)
    reader, dispatcher = make_key(client, org, "read"), make_key(client, org, "dispatch")
    assert client.get(f"/v1/work-items/{item}", headers=bearer(reader)).status_code == 200
    pools = client.get("/v1/admin/pools", headers=bearer(reader)).json()["pools"]
    assert {pool["org_id"] for pool in pools} == {org}
    refused = client.post("/v1/dispatch", json=message(org), headers=bearer(reader))
    assert refused.status_code == 403 and "dispatch scope" in refused.text
    sent = client.post("/v1/dispatch", json=message(org), headers=bearer(dispatcher))
    assert sent.status_code == 202, sent.text
    other = client.post("/v1/dispatch", json=message("someone-else"), headers=bearer(dispatcher))
    assert other.status_code == 403
    cancelled = client.post(f"/v1/work-items/{item}/cancel", headers=bearer(dispatcher))
    assert cancelled.status_code == 200
    no_admin = client.get(f"/v1/admin/orgs/{org}/keys", headers=bearer(dispatcher))
    assert no_admin.status_code == 403 and "admin scope" in no_admin.text


def test_an_org_admin_key_manages_its_org_but_not_the_deployment(client: TestClient) -> None:
    org = f"adm-{uuid.uuid4().hex[:8]}"
    key = make_key(client, org, "admin")
    pool = {"org_id": org, "name": "own", "provider_id": "local"}
    # Pools are the deployment's to make; the org key changes its own pool's org fields.
    refused = client.post("/v1/admin/pools", json=pool, headers=bearer(key))
    assert refused.status_code == 403 and "deployment admin" in refused.text
    made_pool = client.post("/v1/admin/pools", json=pool, headers=admin_headers()).json()
    patch = client.patch(
        f"/v1/admin/pools/{made_pool['id']}", json={"priority": 3}, headers=bearer(key)
    )
    assert patch.status_code == 200 and patch.json()["priority"] == 3
    policy = client.put(
        f"/v1/admin/orgs/{org}/policy", json={"item_images": ["*"]}, headers=bearer(key)
    )
    assert policy.status_code == 403
    made = client.post(
        f"/v1/admin/orgs/{org}/keys", json={"name": "ci", "scopes": ["read"]}, headers=bearer(key)
    )
    assert made.status_code == 201
    limits = client.put(
        f"/v1/admin/orgs/{org}/limits", json={"max_concurrent": 9}, headers=bearer(key)
    )
    assert limits.status_code == 403 and "deployment admin" in limits.text
    config = client.put(
        "/v1/admin/providers/local/config", json={"config": {}}, headers=bearer(key)
    )
    assert config.status_code == 403


def test_keys_are_kept_as_hashes_shown_once_and_refused_once_revoked(
    client: TestClient, pg_db: Database
) -> None:
    org = f"rev-{uuid.uuid4().hex[:8]}"
    key = make_key(client, org, "read")
    listed = client.get(f"/v1/admin/orgs/{org}/keys", headers=admin_headers())
    assert key not in listed.text and "key_hash" not in listed.text
    with pg_db.session() as session:
        dump = session.execute(text("SELECT * FROM api_keys")).all()
    assert key not in repr(dump) and key[4:] not in repr(dump)
    assert client.get("/v1/admin/pools", headers=bearer(key)).status_code == 200
    (row,) = listed.json()["keys"]
    revoked = client.delete(f"/v1/admin/orgs/{org}/keys/{row['id']}", headers=admin_headers())
    assert revoked.status_code == 200
    assert client.get("/v1/admin/pools", headers=bearer(key)).status_code == 401
    again = client.delete(f"/v1/admin/orgs/{org}/keys/{row['id']}", headers=admin_headers())
    assert again.status_code == 404


def test_a_key_revoked_outside_the_api_process_is_refused_within_the_cache_ttl(
    make_client: ClientFactory, pg_db: Database
) -> None:
    """Revoked on the database (by the CLI, or through another api replica), a key this
    process found live is taken until its ``CORRAL_API_KEY_CACHE_TTL_S`` has passed since
    the revocation, and refused from then on."""
    ttl_s = 2.0
    client = make_client(secret_key=TEST_SECRET_KEY, api_key_cache_ttl_s=ttl_s)
    org = f"ttl-{uuid.uuid4().hex[:8]}"
    key = make_key(client, org, "read")
    (row,) = client.get(f"/v1/admin/orgs/{org}/keys", headers=admin_headers()).json()["keys"]
    assert client.get("/v1/admin/pools", headers=bearer(key)).status_code == 200  # found live
    with pg_db.session() as session:
        assert revoke_key(session, org, row["id"])
    revoked = time.monotonic()  # committed
    assert client.get("/v1/admin/pools", headers=bearer(key)).status_code == 200  # kept
    while True:
        asked = time.monotonic()
        status = client.get("/v1/admin/pools", headers=bearer(key)).status_code
        if status != 200:
            break
        assert asked - revoked <= ttl_s, "a revoked key was taken past the cache's TTL"
        time.sleep(0.05)  # the next look
    assert status == 401


def test_a_key_with_an_unknown_or_no_scope_is_refused(client: TestClient) -> None:
    org = f"scope-{uuid.uuid4().hex[:8]}"
    for scopes in (["root"], [], ["read"] * 5):
        answer = client.post(
            f"/v1/admin/orgs/{org}/keys",
            json={"name": "x", "scopes": scopes},
            headers=admin_headers(),
        )
        assert answer.status_code == 422, scopes
