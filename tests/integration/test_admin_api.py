"""The admin api's pools, providers, provider configuration and credentials, on real
PostgreSQL; and a stored provider configuration reaching a process's provider."""

from __future__ import annotations

import uuid
from typing import Any

import pytest
from pydantic import SecretStr
from sqlalchemy import text

from corral.providers.registry import default_registry
from corral.providers.testing import InMemoryProvider, InMemoryProviderConfig
from corral.scheduler.admin.pools import PoolCreate, create_pool
from corral.scheduler.admin.providers import AdminError, set_config
from corral.shared.runtime import Runtime
from corral.shared.settings import CoreSettings
from corral.shared.store import provider_configs
from corral.shared.store.db import Database
from corral.shared.store.sealing import Sealer
from tests.conftest import TEST_SECRET_KEY
from tests.integration.api_clients import ClientFactory
from tests.integration.test_api import admin_headers, awaiting_item

MISSING_BWRAP = {"isolation": "required", "bwrap_path": "/nonexistent/bwrap"}


def org() -> str:
    return f"org-{uuid.uuid4().hex[:8]}"


def new_pool(db: Database, org_id: str, name: str = "local") -> dict[str, Any]:
    return create_pool(db, PoolCreate(org_id=org_id, name=name, provider_id="local"))


def test_every_new_route_needs_the_admin_token(make_client: ClientFactory) -> None:
    client = make_client()
    for method, path in [
        ("GET", "/v1/admin/providers"),
        ("GET", "/v1/admin/providers/local/schema"),
        ("GET", "/v1/admin/providers/local/config"),
        ("PUT", "/v1/admin/providers/local/config"),
        ("POST", "/v1/admin/providers/local/check"),
        ("PATCH", "/v1/admin/pools/pool-x"),
        ("DELETE", "/v1/admin/pools/pool-x"),
        ("GET", "/v1/admin/orgs/acme/credentials"),
        ("PUT", "/v1/admin/orgs/acme/credentials/e2b"),
        ("DELETE", "/v1/admin/orgs/acme/credentials/e2b"),
        ("POST", "/v1/admin/orgs/acme/credentials/e2b/test"),
    ]:
        answer = client.request(method, path, json={}, headers={"Authorization": "Bearer no"})
        assert answer.status_code == 401, (method, path)


def test_a_pool_is_updated_disabled_enabled_and_checked(
    make_client: ClientFactory, pg_db: Database
) -> None:
    client = make_client()
    pool = new_pool(pg_db, org())
    path = f"/v1/admin/pools/{pool['id']}"
    changed = client.patch(path, json={"priority": 7, "max_concurrent": 3}, headers=admin_headers())
    assert changed.status_code == 200, changed.text
    assert (changed.json()["priority"], changed.json()["max_concurrent"]) == (7, 3)
    assert changed.json()["name"] == "local"  # what was not given is kept
    disabled = client.patch(path, json={"active": False}, headers=admin_headers())
    assert disabled.json()["active"] is False
    enabled = client.patch(path, json={"active": True}, headers=admin_headers())
    assert enabled.json()["active"] is True
    bad = client.patch(path, json={"capabilities": {"gpus": 1}}, headers=admin_headers())
    assert bad.status_code == 422
    assert "unknown capability field" in bad.text
    bad = client.patch(path, json={"sandbox_config": {"nope": 1}}, headers=admin_headers())
    assert bad.status_code == 422
    assert "invalid sandbox_config" in bad.text
    assert client.patch(path, json={"org_id": "x"}, headers=admin_headers()).status_code == 422
    missing = client.patch("/v1/admin/pools/pool-none", json={}, headers=admin_headers())
    assert missing.status_code == 404


def test_a_pools_default_lease_is_set_replaced_cleared_and_checked(
    make_client: ClientFactory, pg_db: Database
) -> None:
    client = make_client()
    body = {
        "org_id": org(),
        "name": "leased",
        "provider_id": "local",
        "lease": {"max_attempts": 4, "on_heartbeat_lost": "requeue"},
    }
    answer = client.post("/v1/admin/pools", json=body, headers=admin_headers())
    assert answer.status_code == 201, answer.text
    created = answer.json()
    assert created["lease"] == {"max_attempts": 4, "on_heartbeat_lost": "requeue"}
    path = f"/v1/admin/pools/{created['id']}"
    lease = {"retry_on_work_failed": True, "backoff_s": 15}
    replaced = client.patch(path, json={"lease": lease}, headers=admin_headers())
    assert replaced.status_code == 200, replaced.text
    assert replaced.json()["lease"] == lease  # replaced as a whole, not merged
    kept = client.patch(path, json={"priority": 2}, headers=admin_headers())
    assert kept.json()["lease"] == lease  # not given: kept
    bad = client.patch(path, json={"lease": {"max_attempts": 1000}}, headers=admin_headers())
    assert bad.status_code == 422
    assert "lease.max_attempts" in bad.text
    bad = client.patch(
        path, json={"lease": {"on_heartbeat_lost": "ignore"}}, headers=admin_headers()
    )
    assert bad.status_code == 422
    assert "lease.on_heartbeat_lost" in bad.text
    assert client.get("/v1/admin/pools", headers=admin_headers()).status_code == 200
    cleared = client.patch(path, json={"lease": {}}, headers=admin_headers())
    assert cleared.json()["lease"] is None


def test_a_pool_with_work_in_flight_is_not_deleted_until_it_ends(
    make_client: ClientFactory, pg_db: Database
) -> None:
    client = make_client()
    org_id = org()
    item_id, _ = awaiting_item(pg_db, org_id)  # holds a slot of a pool of its own
    [pool] = client.get(f"/v1/admin/pools?org={org_id}", headers=admin_headers()).json()["pools"]
    path = f"/v1/admin/pools/{pool['id']}"
    refused = client.delete(path, headers=admin_headers())
    assert refused.status_code == 409
    assert "1 work item(s) in flight: disable it" in refused.json()["detail"]
    assert client.post(f"/v1/work-items/{item_id}/cancel", headers=admin_headers()).is_success
    deleted = client.delete(path, headers=admin_headers())
    assert deleted.status_code == 200, deleted.text
    assert deleted.json() == {"id": pool["id"], "deleted": True}
    listed = client.get(f"/v1/admin/pools?org={org_id}", headers=admin_headers()).json()
    assert listed["pools"] == []
    assert client.delete(path, headers=admin_headers()).status_code == 404
    # The item still names its pool; the name is free for a new pool.
    assert client.get(f"/v1/work-items/{item_id}", headers=admin_headers()).json()["pool_id"]
    new_pool(pg_db, org_id, name=pool["name"])


def test_providers_and_their_schemas(make_client: ClientFactory) -> None:
    client = make_client()
    providers = client.get("/v1/admin/providers", headers=admin_headers()).json()["providers"]
    local = next(p for p in providers if p["id"] == "local")
    assert local["sdk_installed"] is True
    assert local["capabilities"]["billing_model"] == "fixed"
    schema = client.get("/v1/admin/providers/local/schema", headers=admin_headers()).json()
    assert "isolation" in schema["config"]["properties"]
    assert "command" in schema["options"]["properties"]
    unknown = client.get("/v1/admin/providers/dokcer/schema", headers=admin_headers())
    assert unknown.status_code == 404
    assert "known providers: " in unknown.json()["detail"]
    assert "dokcer" not in unknown.text  # never echoed


def test_a_stored_config_is_validated_and_replaces_the_environments(
    make_client: ClientFactory, pg_db: Database
) -> None:
    client = make_client(provider_config={"local": {"bogus": 1}})
    path = "/v1/admin/providers/local/config"
    try:
        shown = client.get(path, headers=admin_headers()).json()
        assert (shown["source"], shown["config"]) == ("environment", {"bogus": "**********"})
        check = client.post("/v1/admin/providers/local/check", headers=admin_headers()).json()
        assert check["healthy"] is False
        assert "CORRAL_PROVIDER_CONFIG's configuration is refused" in check["message"]
        assert "unknown key(s) 'bogus'" in check["message"]
        refused = client.put(path, json={"config": {"isolaton": "off"}}, headers=admin_headers())
        assert refused.status_code == 422
        assert "unknown key(s) 'isolaton'" in refused.text
        stored = client.put(path, json={"config": MISSING_BWRAP}, headers=admin_headers())
        assert stored.status_code == 200, stored.text
        assert stored.json()["source"] == "stored"
        assert stored.json()["config"]["isolation"] == "required"
        # Valid for the schema, refused by the provider: unhealthy with the reason.
        check = client.post("/v1/admin/providers/local/check", headers=admin_headers()).json()
        assert check == {
            "provider": "local",
            "org": None,
            "healthy": False,
            "message": "isolation is required but bubblewrap (/nonexistent/bwrap) is not "
            "installed: apt-get install bubblewrap (isolation: off runs trusted work only)",
        }
        removed = client.delete(path, headers=admin_headers()).json()
        assert removed["source"] == "environment"
    finally:
        provider_configs.remove(pg_db, "local")


class VaultConfig(InMemoryProviderConfig):
    api_key: SecretStr | None = None


class VaultProvider(InMemoryProvider):
    """A provider whose configuration holds a secret."""

    id = "vault-test"
    config_model = VaultConfig


def test_a_secret_in_a_stored_config_is_masked(make_client: ClientFactory, pg_db: Database) -> None:
    client = make_client()
    default_registry.register(VaultProvider)
    path = "/v1/admin/providers/vault-test/config"
    try:
        config = {"api_key": "very-secret-value"}
        stored = client.put(path, json={"config": config}, headers=admin_headers())
        assert stored.status_code == 200, stored.text
        shown = client.get(path, headers=admin_headers())
        for answer in (stored, shown):
            assert "very-secret-value" not in answer.text
            assert answer.json()["config"]["api_key"] == "**********"
        refused = client.put(path, json={"config": {"api_key": 7}}, headers=admin_headers())
        assert refused.status_code == 422
        assert "api_key" in refused.text
        # At rest it is sealed with CORRAL_SECRET_KEY; the workers' reading opens it.
        with pg_db.session() as session:
            raw = session.execute(
                text("SELECT config::text FROM provider_configs WHERE provider_id = 'vault-test'")
            ).scalar_one()
        assert "very-secret-value" not in raw and "api_key" not in raw
        settings = CoreSettings()
        opened = provider_configs.effective_config(pg_db, settings, "vault-test")
        assert opened.config == config
        # Without a key a secret field is refused, not stored in plain text.
        keyless = Database(pg_db.engine, sealer=Sealer(None))
        with pytest.raises(AdminError, match="CORRAL_SECRET_KEY"):
            set_config(Runtime(settings=settings, db=keyless), "vault-test", config)
    finally:
        provider_configs.remove(pg_db, "vault-test")
        default_registry.unregister("vault-test")


def test_org_credentials_are_stored_listed_tested_and_deleted_never_shown(
    make_client: ClientFactory,
) -> None:
    client = make_client()
    org_id = org()
    base = f"/v1/admin/orgs/{org_id}/credentials"
    secret = "e2b_" + uuid.uuid4().hex
    put = client.put(f"{base}/e2b", json={"secret": secret}, headers=admin_headers())
    assert put.status_code == 200, put.text
    listed = client.get(base, headers=admin_headers())
    assert [row["provider"] for row in listed.json()["credentials"]] == ["e2b"]
    tested = client.post(f"{base}/e2b/test", headers=admin_headers())
    assert tested.status_code == 200
    assert tested.json()["org"] == org_id
    assert tested.json()["healthy"] is False  # no E2B here to answer
    for answer in (put, listed, tested):
        assert secret not in answer.text
    assert client.delete(f"{base}/e2b", headers=admin_headers()).status_code == 200
    assert client.get(base, headers=admin_headers()).json()["credentials"] == []
    assert client.delete(f"{base}/e2b", headers=admin_headers()).status_code == 404
    unknown = client.put(f"{base}/nope", json={"secret": "x"}, headers=admin_headers())
    assert unknown.status_code == 404
    empty = client.put(f"{base}/e2b", json={"secret": ""}, headers=admin_headers())
    assert empty.status_code == 422


def test_a_stored_config_reaches_a_running_process_within_the_refresh_interval(
    pg_db: Database, postgres_database_url: str, tmp_path: Any
) -> None:
    settings = CoreSettings(
        database_url=postgres_database_url,
        state_dir=tmp_path,
        secret_key=TEST_SECRET_KEY,
        provider_config_refresh_s=0,
    )
    rt = Runtime(settings=settings, db=pg_db)
    try:
        first = rt.provider("local")
        assert rt.provider("local") is first  # unchanged: the same instance
        provider_configs.store(pg_db, "local", {"max_concurrent": 3})
        second = rt.provider("local")
        assert second is not first
        assert second.config.max_concurrent == 3  # type: ignore[attr-defined]
        slow = Runtime(
            settings=settings.model_copy(update={"provider_config_refresh_s": 3600}), db=pg_db
        )
        cached = slow.provider("local")
        provider_configs.store(pg_db, "local", {"max_concurrent": 4})
        assert slow.provider("local") is cached  # read again only after the interval
    finally:
        provider_configs.remove(pg_db, "local")
