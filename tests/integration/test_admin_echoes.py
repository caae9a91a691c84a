"""The admin api's and the console's error answers never repeat a value the client sent:
a hostile value (markup, 10 KB, or an id-shaped word) in every id, name and key they take,
and another org's pool or budget id through an org admin key, on real PostgreSQL."""

from __future__ import annotations

import uuid
from typing import Any
from urllib.parse import quote

import pytest

from corral.scheduler.admin.budgets import BudgetSet, set_budget
from corral.scheduler.admin.pools import PoolCreate, create_pool
from corral.shared.store.api_keys import create_key
from corral.shared.store.db import Database
from tests.integration.api_clients import ClientFactory
from tests.integration.test_api import admin_headers
from tests.integration.test_console import logged_in

# Markup, a long value, and one that passes the id pattern (so it reaches the lookups).
HOSTILE = ["<script>x</script>", "x" * 10_240, "EchoMe-0123456789abcdef"]
Request = tuple[str, str, dict[str, Any]]


def _org() -> str:
    return f"org-{uuid.uuid4().hex[:8]}"


def _api_walk(value: str) -> list[Request]:
    """Every admin route, with ``value`` as each id, name or key it takes (a form sent back
    to be corrected, the console's, is no error message and not walked)."""
    v = quote(value, safe="")
    orgs = f"/v1/admin/orgs/{v}"
    budget = {"org_id": "acme", "period": "day", "cap_micros": 1, "pool": value}
    pool = {"org_id": value, "name": value, "provider_id": value}
    return [
        ("PATCH", f"/v1/admin/pools/{v}", {"json": {"active": False}}),
        ("DELETE", f"/v1/admin/pools/{v}", {}),
        ("GET", f"/v1/admin/pools?org={v}", {}),
        ("POST", "/v1/admin/pools", {"json": pool}),
        ("POST", "/v1/admin/pools", {"json": {**pool, "org_id": "acme", "name": "p"}}),
        (
            "POST",
            "/v1/admin/pools",
            {
                "json": {
                    "org_id": "acme",
                    "name": "p",
                    "provider_id": "local",
                    "sandbox_config": {value: 1},
                }
            },
        ),
        ("POST", "/v1/admin/profiles", {"json": {"name": value, "model": "m", "auth_mode": value}}),
        ("PUT", "/v1/admin/budgets", {"json": budget}),
        ("PUT", "/v1/admin/budgets", {"json": {**budget, "org_id": value}}),
        ("DELETE", f"/v1/admin/budgets/{v}", {}),
        ("GET", f"/v1/admin/budgets?org={v}", {}),
        ("GET", f"/v1/admin/providers/{v}/schema", {}),
        ("GET", f"/v1/admin/providers/{v}/config", {}),
        ("PUT", f"/v1/admin/providers/{v}/config", {"json": {"config": {}}}),
        ("PUT", "/v1/admin/providers/local/config", {"json": {"config": {value: 1}}}),
        ("PUT", "/v1/admin/providers/local/config", {"json": {"config": {"isolation": value}}}),
        ("DELETE", f"/v1/admin/providers/{v}/config", {}),
        ("POST", f"/v1/admin/providers/{v}/check", {}),
        ("POST", f"/v1/admin/providers/local/check?org={v}", {}),
        ("GET", f"{orgs}/credentials", {}),
        ("PUT", f"{orgs}/credentials/{v}", {"json": {"secret": "s"}}),
        ("DELETE", f"{orgs}/credentials/{v}", {}),
        ("POST", f"{orgs}/credentials/{v}/test", {}),
        ("POST", f"{orgs}/keys", {"json": {"name": value, "scopes": [value]}}),
        ("GET", f"{orgs}/keys", {}),
        ("DELETE", f"/v1/admin/orgs/acme/keys/{v}", {}),
        ("GET", f"{orgs}/limits", {}),
        ("PUT", f"{orgs}/limits", {"json": {"max_concurrent": value}}),
    ]


def _assert_not_echoed(answer: Any, value: str, where: str) -> None:
    """An error answer holds ``value`` in no form; a success may name what it was asked."""
    if answer.status_code < 400:
        return
    for form in {value, quote(value, safe=""), value.replace("<", "&lt;")}:
        assert form not in answer.text, (where, answer.status_code, answer.text[:300])


@pytest.mark.parametrize("value", HOSTILE, ids=["markup", "10KB", "id-shaped"])
def test_no_admin_api_error_echoes_a_hostile_value(make_client: ClientFactory, value: str) -> None:
    client = make_client()
    for method, path, extra in _api_walk(value):
        answer = client.request(method, path, headers=admin_headers(), **extra)
        _assert_not_echoed(answer, value, f"{method} {path[:80]}")


def test_another_orgs_pool_or_budget_is_no_such_one_as_an_unknown_id_is(
    make_client: ClientFactory, pg_db: Database
) -> None:
    mine, theirs = _org(), _org()
    their_pool = create_pool(pg_db, PoolCreate(org_id=theirs, name="p", provider_id="local"))
    their_budget = set_budget(pg_db, BudgetSet(org_id=theirs, period="day", cap_micros=1))
    with pg_db.session() as session:
        _, key = create_key(session, mine, "admin", ["admin"])
    client = make_client()
    headers = {"Authorization": f"Bearer {key}"}
    requests = [
        ("PATCH", "/v1/admin/pools/{}", {"json": {"active": False}}, their_pool["id"]),
        ("DELETE", "/v1/admin/pools/{}", {}, their_pool["id"]),
        ("DELETE", "/v1/admin/budgets/{}", {}, their_budget["id"]),
    ]
    for method, template, extra, theirs_id in requests:
        answer = client.request(method, template.format(theirs_id), headers=headers, **extra)
        _assert_not_echoed(answer, theirs_id, f"{method} {template}")
        unknown = client.request(method, template.format("none-such"), headers=headers, **extra)
        # The same answer: it tells nothing of whether the id exists elsewhere.
        assert (answer.status_code, answer.json()) == (unknown.status_code, unknown.json())
    budget = {"org_id": mine, "period": "day", "cap_micros": 1, "pool": their_pool["id"]}
    answer = client.put("/v1/admin/budgets", json=budget, headers=headers)
    _assert_not_echoed(answer, their_pool["id"], "PUT /v1/admin/budgets")
    _assert_not_echoed(answer, mine, "PUT /v1/admin/budgets")


@pytest.mark.parametrize("value", HOSTILE, ids=["markup", "10KB", "id-shaped"])
def test_no_console_error_echoes_a_hostile_value(make_client: ClientFactory, value: str) -> None:
    client = make_client()
    csrf = logged_in(client)
    v = quote(value, safe="")
    walk = [
        ("GET", f"/console/items/{v}", {}),
        ("GET", f"/console/items?org={v}&state={v}&since={v}&after={v}", {}),
        ("POST", f"/console/items/{v}/cancel", {}),
        ("GET", f"/console/pools/{v}", {}),
        ("POST", f"/console/pools/{v}", {"priority": value}),
        ("POST", f"/console/pools/{v}/active", {"active": "false"}),
        ("GET", f"/console/providers/{v}", {}),
        ("POST", f"/console/providers/{v}/config", {}),
        ("POST", "/console/providers/local/check", {"org": value}),
        ("POST", "/console/providers/local/credentials", {"org": value, "secret": "s"}),
        ("GET", f"/console/costs?org={v}&since={v}&by={v}", {}),
    ]
    for method, path, form in walk:
        data = {"csrf": csrf, **form} if method == "POST" else None
        answer = client.request(method, path, data=data)
        _assert_not_echoed(answer, value, f"{method} {path[:80]}")
