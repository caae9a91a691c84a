"""Shared capacities and org weights through the admin api, on real PostgreSQL: created,
listed, changed and deleted by the deployment admin alone; pools put on a capacity and
taken off it, with each rule's refusal naming its field; weights set and reset."""

from __future__ import annotations

import uuid
from typing import Any

import pytest
from fastapi.testclient import TestClient

from corral.scheduler.admin import pools as pool_admin
from corral.shared.store.api_keys import create_key
from corral.shared.store.db import Database
from corral.shared.store.models import Pool
from tests.integration.api_clients import ClientFactory
from tests.integration.test_api import admin_headers

ADMIN = admin_headers()


def tag() -> str:
    return uuid.uuid4().hex[:8]


def new_capacity(client: TestClient, slots: int = 4) -> dict[str, Any]:
    made = client.post(
        "/v1/admin/capacities", json={"name": f"shared-{tag()}", "slots": slots}, headers=ADMIN
    )
    assert made.status_code == 201, made.text
    return dict(made.json())


def new_pool(client: TestClient, org: str, name: str = "shared", **fields: Any) -> dict[str, Any]:
    body = {"org_id": org, "name": name, "provider_id": "local", **fields}
    made = client.post("/v1/admin/pools", json=body, headers=ADMIN)
    assert made.status_code == 201, made.text
    return dict(made.json())


def patch_pool(client: TestClient, pool_id: str, body: dict[str, Any], **headers: str) -> Any:
    return client.patch(f"/v1/admin/pools/{pool_id}", json=body, headers=headers or ADMIN)


def org_key(db: Database, org: str) -> dict[str, str]:
    with db.session() as session:
        _, key = create_key(session, org, "ops", ["admin"])
    return {"Authorization": f"Bearer {key}"}


def test_a_capacity_is_created_listed_shown_changed_and_deleted(
    make_client: ClientFactory,
) -> None:
    client = make_client()
    capacity = new_capacity(client, slots=4)
    assert (capacity["slots"], capacity["slots_in_use"], capacity["pools"]) == (4, 0, [])
    path = f"/v1/admin/capacities/{capacity['name']}"
    listed = client.get("/v1/admin/capacities", headers=ADMIN).json()["capacities"]
    assert capacity["id"] in {row["id"] for row in listed}
    assert client.get(path, headers=ADMIN).json()["id"] == capacity["id"]
    by_id = client.get(f"/v1/admin/capacities/{capacity['id']}", headers=ADMIN)
    assert by_id.json()["name"] == capacity["name"]
    changed = client.patch(path, json={"slots": 9}, headers=ADMIN)
    assert changed.status_code == 200 and changed.json()["slots"] == 9, changed.text
    for bad in ({"slots": 0}, {"slots": 1_000_001}, {"name": "x"}):
        assert client.patch(path, json=bad, headers=ADMIN).status_code == 422, bad
    taken = client.post(
        "/v1/admin/capacities", json={"name": capacity["name"], "slots": 1}, headers=ADMIN
    )
    assert taken.status_code == 409 and taken.json()["error"] == "capacity_name_taken"
    assert taken.json()["detail"][0]["field"] == "name"
    assert client.delete(path, headers=ADMIN).json() == {"id": capacity["name"], "deleted": True}
    assert client.get(path, headers=ADMIN).status_code == 404
    assert client.delete(path, headers=ADMIN).status_code == 404


def test_a_pool_is_put_on_a_capacity_and_taken_off_it(
    make_client: ClientFactory, pg_db: Database, monkeypatch: pytest.MonkeyPatch
) -> None:
    asked: list[str] = []
    monkeypatch.setattr(pool_admin, "request_redrive", lambda: asked.append("redrive") or True)
    client = make_client()
    capacity = new_capacity(client)
    org = f"org-{tag()}"
    pool = new_pool(client, org)
    assert (pool["capacity_id"], pool["capacity"], pool["share_limit"]) == (None, None, None)
    linked = patch_pool(client, pool["id"], {"capacity": capacity["name"]})
    assert linked.status_code == 200, linked.text
    assert (linked.json()["capacity_id"], linked.json()["capacity"]) == (
        capacity["id"],
        capacity["name"],
    )
    assert linked.json()["share_limit"] == 0  # until the re-drive divides the capacity
    assert asked == ["redrive"]
    members = client.get(f"/v1/admin/capacities/{capacity['name']}", headers=ADMIN).json()
    [member] = members["pools"]
    assert (member["pool_id"], member["org_id"], member["weight"]) == (pool["id"], org, 1)
    assert (member["waiting"], member["waiting_counted_all"]) == (0, True)
    # Linked again to the same capacity: its share is kept, nothing is asked.
    with pg_db.session() as session:
        session.get_one(Pool, pool["id"]).share_limit = 3
    again = patch_pool(client, pool["id"], {"capacity": capacity["name"], "priority": 2})
    assert again.json()["share_limit"] == 3 and asked == ["redrive"]
    # The capacity cannot go while the pool draws on it; the refusal names the pool.
    refused = client.delete(f"/v1/admin/capacities/{capacity['name']}", headers=ADMIN)
    assert refused.status_code == 409, refused.text
    assert refused.json()["error"] == "capacity_in_use"
    assert f"{org}/shared" in refused.json()["detail"][0]["message"]
    # Taken off: closed to fresh arrivals (a share of the slots it holds, none here) until
    # the re-drive asked for now has served the items waiting for it, or opened it.
    with pg_db.session() as session:
        session.get_one(Pool, pool["id"]).slots_in_use = 2
    unlinked = patch_pool(client, pool["id"], {"capacity": None})
    assert (unlinked.json()["capacity_id"], unlinked.json()["share_limit"]) == (None, 2)
    assert asked == ["redrive", "redrive"]
    gone = client.delete(f"/v1/admin/capacities/{capacity['name']}", headers=ADMIN)
    assert gone.status_code == 200, gone.text


def test_a_pool_is_created_on_a_capacity_and_an_unknown_one_is_refused(
    make_client: ClientFactory,
) -> None:
    client = make_client()
    capacity = new_capacity(client)
    pool = new_pool(client, f"org-{tag()}", capacity=capacity["name"])
    assert (pool["capacity"], pool["share_limit"]) == (capacity["name"], 0)
    body = {"org_id": f"org-{tag()}", "name": "p", "provider_id": "local", "capacity": "nope"}
    unknown = client.post("/v1/admin/pools", json=body, headers=ADMIN)
    assert unknown.status_code == 422, unknown.text
    assert unknown.json()["detail"][0]["field"] == "capacity"
    assert "corral capacities list" in unknown.text and "nope" not in unknown.text
    unknown = patch_pool(client, pool["id"], {"capacity": "nope"})
    assert unknown.status_code == 422 and unknown.json()["detail"][0]["field"] == "capacity"


def test_an_org_links_one_pool_to_a_capacity(make_client: ClientFactory) -> None:
    client = make_client()
    capacity = new_capacity(client)
    org = f"org-{tag()}"
    first = new_pool(client, org, "first", capacity=capacity["name"])
    second = new_pool(client, org, "second")
    refused = patch_pool(client, second["id"], {"capacity": capacity["name"]})
    assert refused.status_code == 409, refused.text
    answer = refused.json()
    assert answer["error"] == "capacity_already_linked"
    assert answer["detail"][0]["field"] == "capacity"
    assert "pool first draws on that capacity already" in answer["detail"][0]["message"]
    body = {"org_id": org, "name": "third", "provider_id": "local", "capacity": capacity["name"]}
    assert client.post("/v1/admin/pools", json=body, headers=ADMIN).status_code == 409
    # Another org's pool may; and once the first is off, the second may.
    assert new_pool(client, f"org-{tag()}", capacity=capacity["name"])["share_limit"] == 0
    patch_pool(client, first["id"], {"capacity": None})
    assert patch_pool(client, second["id"], {"capacity": capacity["name"]}).status_code == 200


def test_warm_sandboxes_and_a_capacity_exclude_each_other(make_client: ClientFactory) -> None:
    client = make_client()
    capacity = new_capacity(client)
    org = f"org-{tag()}"
    warm = new_pool(client, org, "warm", warm_min=1)
    refused = patch_pool(client, warm["id"], {"capacity": capacity["name"]})
    assert refused.status_code == 422, refused.text
    [problem] = refused.json()["detail"]
    assert problem["field"] == "capacity" and "set warm_min to 0" in problem["message"]
    scheduled = [{"days": ["mon"], "start": "08:00", "end": "18:00", "warm_min": 1}]
    body = {
        "org_id": f"org-{tag()}",
        "name": "p",
        "provider_id": "local",
        "capacity": capacity["name"],
        "warm_schedule": scheduled,
    }
    created = client.post("/v1/admin/pools", json=body, headers=ADMIN)
    assert created.status_code == 422 and created.json()["detail"][0]["field"] == "capacity"
    # Warm off and the capacity on in one change: allowed.
    both = patch_pool(client, warm["id"], {"capacity": capacity["name"], "warm_min": 0})
    assert both.status_code == 200, both.text
    for field, value in (("warm_min", 2), ("warm_schedule", scheduled)):
        refused = patch_pool(client, warm["id"], {field: value})
        assert refused.status_code == 422, refused.text
        [problem] = refused.json()["detail"]
        assert problem["field"] == field and "--no-capacity" in problem["message"]


def test_an_org_key_cannot_place_a_pool_nor_set_a_weight_nor_touch_capacities(
    make_client: ClientFactory, pg_db: Database
) -> None:
    client = make_client()
    capacity = new_capacity(client)
    org = f"org-{tag()}"
    pool = new_pool(client, org)
    key = org_key(pg_db, org)
    refused = patch_pool(client, pool["id"], {"capacity": capacity["name"]}, **key)
    assert refused.status_code == 403, refused.text
    assert refused.json()["detail"].startswith("capacity: only the deployment admin")
    # An unknown capacity is refused the same: nothing tells an org key which exist.
    assert patch_pool(client, pool["id"], {"capacity": "nope"}, **key).status_code == 403
    linked = patch_pool(client, pool["id"], {"capacity": capacity["name"]})
    assert linked.status_code == 200
    unlinked = patch_pool(client, pool["id"], {"capacity": None}, **key)
    assert unlinked.status_code == 403, unlinked.text
    with pg_db.session() as session:
        assert session.get_one(Pool, pool["id"]).capacity_id == capacity["id"]
    owners = client.get("/v1/admin/pools/fields", headers=key).json()["owners"]
    assert owners["capacity"] == "deployment"
    weight = f"/v1/admin/orgs/{org}/weight"
    assert client.put(weight, json={"weight": 9}, headers=key).status_code == 403
    assert client.delete(weight, headers=key).status_code == 403
    assert client.get(weight, headers=key).json() == {"org_id": org, "weight": 1, "default": True}
    path = f"/v1/admin/capacities/{capacity['name']}"
    for method, target, body in (
        ("GET", "/v1/admin/capacities", None),
        ("POST", "/v1/admin/capacities", {"name": f"mine-{tag()}", "slots": 100}),
        ("GET", path, None),
        ("PATCH", path, {"slots": 100}),
        ("DELETE", path, None),
    ):
        answer = client.request(method, target, json=body, headers=key)
        assert answer.status_code == 403, (method, target, answer.text)
    assert client.get(path, headers=ADMIN).json()["slots"] == capacity["slots"]


def test_an_orgs_weight_is_set_shown_and_reset(make_client: ClientFactory) -> None:
    client = make_client()
    capacity = new_capacity(client)
    org = f"org-{tag()}"
    new_pool(client, org, capacity=capacity["name"])
    path = f"/v1/admin/orgs/{org}/weight"
    assert client.get(path, headers=ADMIN).json()["default"] is True
    set_ = client.put(path, json={"weight": 3}, headers=ADMIN)
    assert set_.status_code == 200 and set_.json() == {"org_id": org, "weight": 3, "default": False}
    [member] = client.get(f"/v1/admin/capacities/{capacity['id']}", headers=ADMIN).json()["pools"]
    assert member["weight"] == 3
    for bad in (0, 1001, None, [3]):
        answer = client.put(path, json={"weight": bad}, headers=ADMIN)
        assert answer.status_code == 422, bad
        assert answer.json()["detail"][0]["field"] == "weight"
    reset = client.delete(path, headers=ADMIN)
    assert reset.json() == {"org_id": org, "weight": 1, "default": True}
