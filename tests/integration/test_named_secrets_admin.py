"""Named secrets through the admin api (real PostgreSQL) and `corral secrets` (SQLite): an
org key manages its own org's secrets and nothing else (another org's answer 404, the
deployment's 403), the admin token manages both, no answer or output ever holds a value,
and a refused name or value is a 422 that does not echo it."""

from __future__ import annotations

import json
import uuid

import pytest
from fastapi.testclient import TestClient
from typer.testing import CliRunner

from corral.cli.app import app
from corral.shared.store import secrets
from corral.shared.store.db import Database
from tests.conftest import TEST_SECRET_KEY
from tests.integration.api_clients import ClientFactory
from tests.integration.test_api import admin_headers
from tests.integration.test_org_keys import bearer, make_key


@pytest.fixture
def client(make_client: ClientFactory) -> TestClient:
    return make_client(secret_key=TEST_SECRET_KEY)


def _value() -> str:
    return f"value-{uuid.uuid4().hex}"


def test_an_org_key_manages_its_own_secrets_and_never_sees_a_value(
    client: TestClient, pg_db: Database
) -> None:
    org = f"acme-{uuid.uuid4().hex[:8]}"
    key = bearer(make_key(client, org, "admin"))
    value, replaced = _value(), _value()
    base = f"/v1/admin/orgs/{org}/secrets"
    answers = [client.put(f"{base}/api-token", json={"value": value}, headers=key)]
    assert answers[-1].status_code == 200, answers[-1].text
    assert answers[-1].json() == {"name": "api-token", "scope": "org", "org": org, "created": True}
    answers.append(client.put(f"{base}/api-token", json={"value": replaced}, headers=key))
    assert answers[-1].json()["created"] is False
    answers.append(client.get(base, headers=key))
    [row] = answers[-1].json()["secrets"]
    assert (row["name"], row["scope"], row["org"]) == ("api-token", "org", org)
    assert set(row) == {"name", "scope", "org", "created_at", "updated_at"}
    assert secrets.resolve_secret(pg_db, org, "api-token") == replaced
    answers.append(client.delete(f"{base}/api-token", headers=key))
    assert answers[-1].status_code == 200
    answers.append(client.delete(f"{base}/api-token", headers=key))
    assert answers[-1].status_code == 404
    assert not any(value in a.text or replaced in a.text for a in answers)


def test_an_org_key_cannot_touch_another_orgs_or_the_deployments_secrets(
    client: TestClient, pg_db: Database
) -> None:
    victim, intruder = f"victim-{uuid.uuid4().hex[:8]}", f"intruder-{uuid.uuid4().hex[:8]}"
    name = f"shared-{uuid.uuid4().hex[:8]}"
    value = _value()
    secrets.set_secret(pg_db, victim, "token", value)
    secrets.set_secret(pg_db, None, name, value)
    key = bearer(make_key(client, intruder, "admin"))
    tries = [
        ("GET", f"/v1/admin/orgs/{victim}/secrets", None, 404),
        ("PUT", f"/v1/admin/orgs/{victim}/secrets/token", {"value": "stolen"}, 404),
        ("DELETE", f"/v1/admin/orgs/{victim}/secrets/token", None, 404),
        ("GET", "/v1/admin/secrets", None, 403),
        ("PUT", f"/v1/admin/secrets/{name}", {"value": "stolen"}, 403),
        ("DELETE", f"/v1/admin/secrets/{name}", None, 403),
    ]
    for method, path, body, status in tries:
        answer = client.request(method, path, json=body, headers=key)
        assert answer.status_code == status, (method, path, answer.text)
        assert value not in answer.text and victim not in answer.text
    assert secrets.resolve_secret(pg_db, victim, "token") == value
    assert secrets.resolve_secret(pg_db, intruder, name) == value  # deployment's: still there
    # The admin token manages the deployment's secrets; listing shows no value.
    listed = client.get("/v1/admin/secrets", headers=admin_headers())
    assert name in [row["name"] for row in listed.json()["secrets"]] and value not in listed.text
    assert client.delete(f"/v1/admin/secrets/{name}", headers=admin_headers()).status_code == 200


def test_refused_names_and_values_are_not_echoed(client: TestClient) -> None:
    org = f"acme-{uuid.uuid4().hex[:8]}"
    base = f"/v1/admin/orgs/{org}/secrets"
    bad_name = client.put(f"{base}/-bad%20name", json={"value": "v"}, headers=admin_headers())
    assert bad_name.status_code == 422 and "-bad name" not in bad_name.text
    nul = "secret-with-nul\x00-4711"
    refused = client.put(f"{base}/ok", json={"value": nul}, headers=admin_headers())
    assert refused.status_code == 422, refused.text
    assert "secret-with-nul" not in refused.text and "NUL" in refused.text
    long = "y" * (secrets.MAX_VALUE + 1)
    refused = client.put(f"{base}/ok", json={"value": long}, headers=admin_headers())
    assert refused.status_code == 422 and long not in refused.text


def test_the_cli_reads_values_from_stdin_and_never_prints_them(
    sqlite_db: Database, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CORRAL_DATABASE_URL", str(sqlite_db.engine.url))
    runner = CliRunner()
    value, shared = _value(), _value()
    outputs = [
        runner.invoke(app, ["secrets", "set", "api-token", "--org", "acme"], input=value + "\n"),
        runner.invoke(app, ["secrets", "set", "api-token", "--org", "acme"], input=value),
        runner.invoke(app, ["secrets", "set", "shared"], input=shared + "\n"),
        runner.invoke(app, ["secrets", "list", "--org", "acme"]),
        runner.invoke(app, ["secrets", "list", "--format", "json"]),
    ]
    assert [r.exit_code for r in outputs] == [0] * 5, [r.output for r in outputs]
    assert "stored the secret api-token of org acme" in outputs[0].output
    assert "replaced" in outputs[1].output
    assert outputs[3].output.split()[:6] == [
        "name",
        "scope",
        "created",
        "updated",
        "api-token",
        "org",
    ]
    assert [row["scope"] for row in json.loads(outputs[4].output)] == ["deployment"]
    assert secrets.resolve_secret(sqlite_db, "acme", "api-token") == value  # newline dropped
    assert secrets.resolve_secret(sqlite_db, "globex", "shared") == shared
    outputs.append(runner.invoke(app, ["secrets", "delete", "api-token", "--org", "acme"]))
    gone = runner.invoke(app, ["secrets", "delete", "api-token", "--org", "acme"])
    assert gone.exit_code == 2 and "has no secret named api-token" in gone.output
    empty = runner.invoke(app, ["secrets", "set", "x", "--org", "acme"], input="")
    assert empty.exit_code == 2 and "no value on standard input" in empty.output
    # No value on the command line: there is no argument or option that takes one.
    extra = runner.invoke(app, ["secrets", "set", "x", value, "--org", "acme"])
    assert extra.exit_code == 2
    assert not any(value in r.output or shared in r.output for r in outputs)


@pytest.mark.parametrize("org", ["*", "acme corp", ""])
def test_the_cli_refuses_an_org_that_is_no_org_id(
    sqlite_db: Database, monkeypatch: pytest.MonkeyPatch, org: str
) -> None:
    # "*" is the deployment's row: `--org '*'` wrote the deployment's secret (said "of org *").
    monkeypatch.setenv("CORRAL_DATABASE_URL", str(sqlite_db.engine.url))
    runner = CliRunner()
    value = _value()
    outputs = [
        runner.invoke(app, ["secrets", "set", "shared", "--org", org], input=value),
        runner.invoke(app, ["secrets", "list", "--org", org]),
        runner.invoke(app, ["secrets", "delete", "shared", "--org", org]),
    ]
    assert [r.exit_code for r in outputs] == [2] * 3, [r.output for r in outputs]
    assert all("org id" in r.output for r in outputs)
    assert secrets.list_secrets(sqlite_db, None) == []


def test_an_org_holds_a_bounded_number_of_secrets(
    client: TestClient, pg_db: Database, monkeypatch: pytest.MonkeyPatch
) -> None:
    # An org key's PUTs, each a new name, grew the control plane's database and every
    # listing without a bound (webhook endpoints and org keys have theirs).
    monkeypatch.setattr(secrets, "MAX_SECRETS", 3, raising=False)
    org = f"acme-{uuid.uuid4().hex[:8]}"
    key = bearer(make_key(client, org, "admin"))
    base = f"/v1/admin/orgs/{org}/secrets"
    for number in range(3):
        assert client.put(f"{base}/s{number}", json={"value": "v"}, headers=key).status_code == 200
    over = client.put(f"{base}/s3", json={"value": "v"}, headers=key)
    assert over.status_code == 422, over.text
    assert "at most 3" in over.text
    # Replacing one that exists is no new secret, and another org has its own bound.
    assert client.put(f"{base}/s0", json={"value": "w"}, headers=key).status_code == 200
    secrets.set_secret(pg_db, f"other-{uuid.uuid4().hex[:8]}", "s3", "v")
    assert [info.name for info in secrets.list_secrets(pg_db, org)] == ["s0", "s1", "s2"]
