"""A pool's own unserved-queue TTL (routed_ttl_s) through the admin api, the CLI's update and
the console's form: the deployment sets and clears it, an org key may not (the field is the
deployment's); the console's overview flags a queue items wait on that no worker consumes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from sqlalchemy import update
from typer.testing import CliRunner, Result

from corral.cli.app import app as cli
from corral.scheduler.batch import accept_batch
from corral.shared import runtime
from corral.shared.store.api_keys import create_key
from corral.shared.store.db import Database
from corral.shared.store.models import Pool
from tests.batches import requests_for
from tests.integration.api_clients import ClientFactory
from tests.integration.test_api import admin_headers
from tests.integration.test_console import logged_in, text_of
from tests.seeding import SETTINGS, org_with_pool


def _ttl(db: Database, pool_id: str) -> int | None:
    with db.session() as session:
        return session.get_one(Pool, pool_id).routed_ttl_s


def test_the_deployment_sets_and_clears_a_pools_ttl_and_an_org_key_may_not(
    make_client: ClientFactory, pg_db: Database
) -> None:
    org = org_with_pool(pg_db, "ttl")
    pool_id = f"pool-{org}"
    client = make_client()
    path = f"/v1/admin/pools/{pool_id}"
    answer = client.patch(path, json={"routed_ttl_s": 120}, headers=admin_headers())
    assert answer.status_code == 200, answer.text
    assert answer.json()["routed_ttl_s"] == 120 and _ttl(pg_db, pool_id) == 120
    refused = client.patch(path, json={"routed_ttl_s": -1}, headers=admin_headers())
    assert refused.status_code == 422 and "routed_ttl_s" in refused.text
    with pg_db.session() as session:
        _, key = create_key(session, org, "ops", ["admin"])
    owned = client.patch(path, json={"routed_ttl_s": 0}, headers={"Authorization": f"Bearer {key}"})
    assert owned.status_code == 403 and "routed_ttl_s" in owned.text
    assert _ttl(pg_db, pool_id) == 120
    fields = client.get("/v1/admin/pools/fields", headers=admin_headers()).json()
    assert fields["owners"]["routed_ttl_s"] == "deployment"
    cleared = client.patch(path, json={"routed_ttl_s": None}, headers=admin_headers())
    assert cleared.json()["routed_ttl_s"] is None and _ttl(pg_db, pool_id) is None


def test_the_cli_sets_and_clears_a_pools_ttl(
    pg_db: Database, postgres_database_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    org = org_with_pool(pg_db, "ttl")
    monkeypatch.setenv("CORRAL_DATABASE_URL", postgres_database_url)
    monkeypatch.setenv("CORRAL_STATE_DIR", str(tmp_path))
    update_local = ["pools", "update", "local", "--org", org]
    done = _cli([*update_local, "--routed-ttl-s", "30"])
    assert done.exit_code == 0, done.output
    assert json.loads(done.output)["routed_ttl_s"] == 30 and _ttl(pg_db, f"pool-{org}") == 30
    refused = _cli([*update_local, "--routed-ttl-s", "5", "--default-routed-ttl"])
    assert refused.exit_code != 0 and "give one of them" in refused.output
    assert _ttl(pg_db, f"pool-{org}") == 30
    done = _cli([*update_local, "--default-routed-ttl"])
    assert done.exit_code == 0, done.output
    assert _ttl(pg_db, f"pool-{org}") is None


def _cli(args: list[str]) -> Result:
    """Run a `corral` command in this process; the runtime it made is closed after it."""
    try:
        return CliRunner().invoke(cli, args)
    finally:
        runtime.current().db.dispose()
        runtime.reset()


def test_the_console_form_sets_the_ttl_and_the_overview_flags_an_unserved_queue(
    make_client: ClientFactory, pg_db: Database
) -> None:
    org = org_with_pool(pg_db, "ttl")
    pool_id = f"pool-{org}"
    client = make_client()
    csrf = logged_in(client)
    form = {"csrf": csrf, "priority": "0", "max_concurrent": "10", "routed_ttl_s": "45"}
    assert client.post(f"/console/pools/{pool_id}", data=form).status_code == 200
    assert _ttl(pg_db, pool_id) == 45
    assert "45 s" in text_of(client.get(f"/console/pools/{pool_id}").text)
    bad = client.post(f"/console/pools/{pool_id}", data={**form, "routed_ttl_s": "soon"})
    assert bad.status_code == 422 and "routed_ttl_s" in text_of(bad.text)
    assert client.post(f"/console/pools/{pool_id}", data={**form, "routed_ttl_s": ""}).is_success
    assert _ttl(pg_db, pool_id) is None

    # The org's items go to a provider no worker of this test consumes: its login's overview
    # (the org's alone, whatever other tests left in this database) flags the queue.
    with pg_db.session() as session:
        session.execute(update(Pool).where(Pool.id == pool_id).values(provider_id="vercel"))
        _, key = create_key(session, org, "console", ["read"])
    accept_batch(pg_db, requests_for(org, 2), actor="test", settings=SETTINGS)
    org_client = make_client()
    logged_in(org_client, key)
    page = org_client.get("/console/overview").text
    assert 'id="unserved-provision.vercel"' in page
    assert "no_worker" in text_of(page)
