"""What an org admin key may change, tried on corral's real processes: every pool field the
deployment decides is refused with a 403 naming it, the cost events stay at the deployment's
rate, and an item naming an image outside its org's allow-list is refused at dispatch."""

from __future__ import annotations

import uuid
from typing import Any

from tests.acceptance.conftest import shell
from tests.acceptance.stack import Stack

RATE = 1234  # micro-units per sandbox ("fixed"): each cost event is exactly this

# Each deployment-owned field an org admin key tries, with a value that would serve it.
ATTEMPTS: dict[str, Any] = {
    "rate_micros": 0,
    "billing_model": "wall-clock",
    "sandbox_config": {"command": ["sh", "-c", "cat > /tmp/token"]},
    "capabilities": {"max_concurrent": 2_147_483_647},
    "runtime_provides": {"runtimeKinds": ["npm"], "requirementKinds": []},
    "max_concurrent_ceiling": 2_147_483_647,
    "lease": {"max_attempts": 20},
    "warm_min": 1,
    "warm_idle_ttl_s": 60,
    "warm_schedule": [],
    "capacity": "shared",
}


def _org_with_admin_key(stack: Stack) -> tuple[str, str, str]:
    org = f"tenant{uuid.uuid4().hex[:8]}"
    stack.make_org(org)  # the profile
    status, pools = stack.request("GET", f"/v1/admin/pools?org={org}")
    assert status == 200, pools
    [pool] = pools["pools"]
    update = {"billing_model": "fixed", "rate_micros": RATE, "max_concurrent": 4}
    status, body = stack.request("PATCH", f"/v1/admin/pools/{pool['id']}", update)
    assert status == 200 and body["max_concurrent_ceiling"] == 64, body  # make_org's 64
    status, body = stack.request(
        "PATCH", f"/v1/admin/pools/{pool['id']}", {"max_concurrent_ceiling": 8}
    )
    assert status == 200 and body["max_concurrent_ceiling"] == 8, body
    status, key = stack.request(
        "POST", f"/v1/admin/orgs/{org}/keys", {"name": "ops", "scopes": ["admin"]}
    )
    assert status == 201, key
    return org, pool["id"], key["key"]


def test_an_org_admin_key_changes_its_fields_and_no_deployment_field(stack: Stack) -> None:
    org, pool_id, key = _org_with_admin_key(stack)
    path = f"/v1/admin/pools/{pool_id}"
    for field, value in ATTEMPTS.items():
        status, body = stack.request("PATCH", path, {field: value}, token=key)
        assert status == 403, (field, body)
        assert body["detail"].startswith(f"{field}: only the deployment admin"), body
    status, body = stack.request("PATCH", path, {"max_concurrent": 9}, token=key)
    assert status == 403 and body["detail"].startswith("max_concurrent: at most 8"), body
    status, body = stack.request("DELETE", path, token=key)
    assert status == 403, body
    new_pool = {"org_id": org, "name": "mine", "provider_id": "local", "rate_micros": 0}
    status, body = stack.request("POST", "/v1/admin/pools", new_pool, token=key)
    assert status == 403, body
    # What is the org's to change, it changes.
    change = {"name": "renamed", "priority": 5, "max_concurrent": 8, "active": True}
    status, body = stack.request("PATCH", path, change, token=key)
    assert status == 200 and {k: body[k] for k in change} == change, body
    assert (body["rate_micros"], body["billing_model"]) == (RATE, "fixed")
    # The owners, as the api states them.
    status, owners = stack.request("GET", "/v1/admin/pools/fields", token=key)
    assert status == 200 and owners["owners"]["rate_micros"] == "deployment", owners
    assert owners["owners"]["max_concurrent"] == "org"
    # The work it runs is billed at the deployment's rate.
    ids = []
    for number in range(2):
        status, body = stack.request(
            "POST", "/v1/dispatch", shell(org, f"echo {number}"), token=key
        )
        assert status in (200, 201, 202), body
        ids.append(body["id"])
    assert [v["state"] for v in stack.wait_final(ids)] == ["succeeded", "succeeded"]

    def billed() -> dict[str, Any] | None:
        status, costs = stack.request("GET", f"/v1/costs?org={org}&by=pool")
        assert status == 200, costs
        return costs if costs["total"]["events"] == 2 else None

    costs = stack.until(billed, "both sandboxes billed")
    assert costs["total"]["amount_micros"] == 2 * RATE, costs


def test_an_image_outside_the_orgs_allow_list_is_refused_at_dispatch(stack: Stack) -> None:
    org, _, key = _org_with_admin_key(stack)
    # An org admin key may not widen its own allow-list.
    policy = {"item_images": ["*"], "regions": None}
    status, body = stack.request("PUT", f"/v1/admin/orgs/{org}/policy", policy, token=key)
    assert status == 403, body
    policy = {"item_images": [f"registry.example.com/{org}/*"], "regions": ["eu-*"]}
    status, body = stack.request("PUT", f"/v1/admin/orgs/{org}/policy", policy)
    assert status == 200 and body["item_images"] == policy["item_images"], body
    refused = {
        "image_not_allowed": {"image": "registry.example.com/another-org/private:1"},
        "region_not_allowed": {"region": "us-east-1"},
    }
    ids = {}
    for code, fields in refused.items():
        status, body = stack.request(
            "POST", "/v1/dispatch", shell(org, "true", **fields), token=key
        )
        assert status in (200, 201, 202), body
        ids[code] = body["id"]
    for code, item_id in ids.items():
        [view] = stack.wait_final([item_id])
        assert (view["state"], view["error"]["code"]) == ("dispatch_error", code), view
        assert "another-org" not in str(view), view  # the reference is not echoed
