"""The console's shared capacity page, on real PostgreSQL: the deployment admin creates a
capacity, puts pools on it from their pages, weighs an org and sees the re-drive's division
(weights, slots held, shares, items waiting); changes, refusals and deletion; an org login
neither sees the page nor places its pool."""

from __future__ import annotations

import re
import uuid

from fastapi.testclient import TestClient

from corral.scheduler.admin import capacities
from corral.scheduler.admin import pools as pool_admin
from corral.scheduler.batch import accept_batch
from corral.shared import runtime
from corral.shared.messages import DispatchRequest
from corral.shared.store import shares
from corral.shared.store.api_keys import create_key
from corral.shared.store.db import Database
from corral.shared.store.models import Pool
from corral.worker import maintenance
from tests.integration.api_clients import ClientFactory
from tests.integration.test_console import logged_in, text_of
from tests.seeding import SETTINGS, org_with_pool


def _send(db: Database, org: str, count: int) -> None:
    work = {"kind": "shell", "command": "true"}
    message = {"org": org, "project": "p", "profile": "default", "work": work}
    requests = [DispatchRequest.model_validate(message) for _ in range(count)]
    accept_batch(db, requests, actor="test", settings=SETTINGS)


def _member(html: str, pool_id: str) -> list[str]:
    """The cells of a pool's row on the capacity page: org, pool, weight, held, share,
    waiting, state."""
    row = re.search(rf'<tr id="member-{pool_id}">(.*?)</tr>', html, re.S)
    assert row is not None, pool_id
    return text_of(row.group(1)).split()


def _pool_capacity(html: str) -> str:
    """What a pool's page says of its shared capacity, in words."""
    found = re.search(r'<dd id="pool-capacity">(.*?)</dd>', html, re.S)
    assert found is not None
    return " ".join(text_of(found.group(1)).split())


def _created(client: TestClient, csrf: str, slots: str = "4") -> dict[str, object]:
    name = f"shared-{uuid.uuid4().hex[:8]}"
    made = client.post("/console/capacities", data={"csrf": csrf, "name": name, "slots": slots})
    assert made.status_code == 200, made.text
    assert f"{name} " in text_of(made.text)
    return capacities.find_capacity(runtime.current().db, name)


def test_the_deployment_admin_divides_a_capacity_and_sees_the_division(
    make_client: ClientFactory, pg_db: Database
) -> None:
    client = make_client()
    csrf = logged_in(client)
    assert 'href="/console/capacities"' in client.get("/console/overview").text
    capacity = _created(client, csrf)
    heavy, light = org_with_pool(pg_db, "heavy", max_concurrent=100), org_with_pool(pg_db, "light")
    # A pool is put on the capacity from its page.
    pool_page = client.get(f"/console/pools/pool-{heavy}").text
    assert f"<option>{capacity['name']}</option>" in pool_page
    form = {"csrf": csrf, "capacity": capacity["name"], "max_concurrent": "100"}
    assert client.post(f"/console/pools/pool-{heavy}", data=form).status_code == 200
    refused = client.post(f"/console/pools/pool-{heavy}", data={**form, "warm_min": "1"})
    assert refused.status_code == 422 and "warm_min: a pool on a shared capacity" in refused.text
    shown = _pool_capacity(client.get(f"/console/pools/pool-{heavy}").text)
    assert shown == f"{capacity['name']} : a share of 0 slot(s) now, set by the re-drive"
    form = {"csrf": csrf, "capacity": capacity["name"], "max_concurrent": "10"}
    assert client.post(f"/console/pools/pool-{light}", data=form).status_code == 200
    weighed = client.post("/console/weights", data={"csrf": csrf, "org": heavy, "weight": "3"})
    assert weighed.status_code == 200
    # Both send more than the capacity holds; before the re-drive nothing starts.
    _send(pg_db, heavy, 5)
    _send(pg_db, light, 2)
    page = client.get("/console/capacities").text
    assert _member(page, f"pool-{heavy}") == [heavy, "local", "3", "0", "0", "5", "enabled"]
    assert _member(page, f"pool-{light}") == [light, "local", "1", "0", "0", "2", "enabled"]
    maintenance.redrive(runtime.Runtime(settings=SETTINGS, db=pg_db), actor="test")
    page = client.get("/console/capacities").text
    assert _member(page, f"pool-{heavy}") == [heavy, "local", "3", "3", "3", "2", "enabled"]
    assert _member(page, f"pool-{light}") == [light, "local", "1", "1", "1", "1", "enabled"]
    assert "4 of 4 slots held" in text_of(page)
    # Its slots change; a bad number, a weight out of range and a capacity in use are refused.
    path = f"/console/capacities/{capacity['id']}"
    bad = client.post(path, data={"csrf": csrf, "slots": "0"})
    assert bad.status_code == 422 and "slots" in text_of(bad.text)
    assert client.post(path, data={"csrf": csrf, "slots": "6"}).status_code == 200
    assert capacities.find_capacity(pg_db, str(capacity["id"]))["slots"] == 6
    bad = client.post("/console/weights", data={"csrf": csrf, "org": heavy, "weight": "1001"})
    assert bad.status_code == 422 and "weight" in text_of(bad.text)
    in_use = client.post(f"{path}/delete", data={"csrf": csrf})
    assert in_use.status_code == 409
    assert f"{heavy}/local, {light}/local" in text_of(in_use.text)
    # An empty weight is the default again; pools taken off, the capacity goes.
    client.post("/console/weights", data={"csrf": csrf, "org": heavy, "weight": ""})
    with pg_db.session() as session:
        assert shares.weights_of(session, [heavy]) == {}
    for org in (heavy, light):
        off = {"csrf": csrf, "capacity": "", "max_concurrent": "10"}
        assert client.post(f"/console/pools/pool-{org}", data=off).status_code == 200
    assert client.post(f"{path}/delete", data={"csrf": csrf}).status_code == 200
    assert f'id="capacity-{capacity["id"]}"' not in client.get("/console/capacities").text


def test_an_org_login_neither_sees_the_capacities_nor_places_its_pool(
    make_client: ClientFactory, pg_db: Database
) -> None:
    client = make_client()
    admin_csrf = logged_in(client)
    capacity = _created(client, admin_csrf)
    org = org_with_pool(pg_db, "tenant")
    pool_admin.update_pool(
        pg_db,
        f"pool-{org}",
        pool_admin.PoolUpdate(capacity=str(capacity["name"])),
        by_deployment=True,
    )
    with pg_db.session() as session:
        _, key = create_key(session, org, "console", ["read", "admin"])
    client.cookies.clear()
    csrf = logged_in(client, key)
    assert 'href="/console/capacities"' not in client.get("/console/overview").text
    assert client.get("/console/capacities").status_code == 403
    weighed = client.post("/console/weights", data={"csrf": csrf, "org": org, "weight": "9"})
    assert weighed.status_code == 403
    made = client.post("/console/capacities", data={"csrf": csrf, "name": "mine", "slots": "9"})
    assert made.status_code == 403
    path = f"/console/capacities/{capacity['id']}"
    assert client.post(path, data={"csrf": csrf, "slots": "99"}).status_code == 403
    assert client.post(f"{path}/delete", data={"csrf": csrf}).status_code == 403
    page = client.get(f"/console/pools/pool-{org}").text
    assert _pool_capacity(page).startswith(f"{capacity['name']}: a share of 0 slot(s)")
    assert 'id="capacity"' not in page  # no capacity field in an org's form
    # A capacity field sent anyway changes nothing: an org's form sets the org's fields.
    form = {"csrf": csrf, "capacity": "", "priority": "4"}
    assert client.post(f"/console/pools/pool-{org}", data=form).status_code == 200
    with pg_db.session() as session:
        pool = session.get_one(Pool, f"pool-{org}")
        assert (pool.priority, pool.capacity_id) == (4, capacity["id"])
        assert shares.weights_of(session, [org]) == {}
    assert capacities.find_capacity(pg_db, str(capacity["id"]))["slots"] == 4
