"""Spend caps on PostgreSQL, through the real routing paths: an org over its budget has new
work refused with ``budget_exhausted`` and the numbers; a pool over its budget is passed by
(the next pool takes the work) until every pool that could is over; the admin api shows the
spend against each cap."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import pytest
from sqlalchemy import update

from corral.providers.testing import InMemoryProvider
from corral.scheduler.batch import accept_batch
from corral.scheduler.intake import accept, route_item
from corral.shared.messages import DispatchRequest
from corral.shared.store.budgets import Period, period_start
from corral.shared.store.db import utcnow
from corral.shared.store.models import ItemState, Sandbox
from tests.integration.reaping import ADMIN, Reaped, reaped_world


@pytest.fixture
def reaped(fresh_pg_url: str, redis_url: str, tmp_path: Path) -> Iterator[Reaped]:
    provider = InMemoryProvider()
    with reaped_world(fresh_pg_url, redis_url, tmp_path, provider) as world:
        world.add_spare_pool()  # "main" (priority 10) first, "spare" after it
        yield world


def admin_headers() -> dict[str, str]:
    return {"Authorization": f"Bearer {ADMIN}"}


def _request() -> DispatchRequest:
    message = {"org": "acme", "project": "web", "profile": "default"}
    return DispatchRequest.model_validate(message | {"work": {"kind": "shell", "command": "true"}})


def _running_for(reaped: Reaped, seconds: float) -> str:
    """One item provisioned on "main", its sandbox started ``seconds`` ago."""
    item_id = reaped.dispatch()
    sandbox = reaped.sandbox(item_id)
    with reaped.db.session() as session:
        started = utcnow() - timedelta(seconds=seconds)
        session.execute(update(Sandbox).where(Sandbox.id == sandbox.id).values(started_at=started))
    return item_id


def _budget(reaped: Reaped, cap: int, pool: str | None = None) -> dict[str, object]:
    body = {"org_id": "acme", "period": "month", "cap_micros": cap, "pool": pool}
    answer = reaped.api.put("/v1/admin/budgets", json=body, headers=admin_headers())
    assert answer.status_code == 200, answer.text
    return answer.json()


def test_an_org_over_its_budget_has_new_work_refused_with_the_numbers(reaped: Reaped) -> None:
    _running_for(reaped, 10)  # 10 s at 2,500 micro-units a second: 25,000 run up
    budget = _budget(reaped, 20_000)
    assert budget["exhausted"] is True
    assert 25_000 <= int(str(budget["running_micros"])) < 40_000  # the item's own seconds

    item_id = accept(reaped.db, _request(), actor="test").item_id
    assert (
        route_item(reaped.db, item_id, actor="test", settings=reaped.rt.settings).state
        is ItemState.DISPATCH_ERROR
    )
    refused = reaped.item(item_id)
    assert refused.error_code == "budget_exhausted"
    assert "org budget of org acme for this month" in str(refused.error_message)
    assert "0.020000" in str(refused.error_message)  # the cap, as the ledger prints money
    (taken,) = accept_batch(
        reaped.db, [_request()], actor="test", settings=reaped.rt.settings
    )  # the batched intake too
    assert taken.outcome.state is ItemState.DISPATCH_ERROR

    raised = _budget(reaped, 10_000_000)  # a higher cap: routing takes work again
    assert raised["id"] == budget["id"] and raised["exhausted"] is False
    again = accept(reaped.db, _request(), actor="test").item_id
    assert (
        route_item(reaped.db, again, actor="test", settings=reaped.rt.settings).state
        is ItemState.ROUTED
    )


def test_a_pool_over_its_budget_is_passed_by_until_every_pool_is(reaped: Reaped) -> None:
    main = f"pool-{reaped.provider.id}"
    _running_for(reaped, 10)
    _budget(reaped, 1_000, pool="main")
    item_id = accept(reaped.db, _request(), actor="test").item_id
    assert (
        route_item(reaped.db, item_id, actor="test", settings=reaped.rt.settings).state
        is ItemState.ROUTED
    )
    assert reaped.item(item_id).pool_id == "pool-spare"  # spill-over

    _budget(reaped, 0, pool="spare")  # a cap of 0: nothing more there either
    last = accept(reaped.db, _request(), actor="test").item_id
    assert (
        route_item(reaped.db, last, actor="test", settings=reaped.rt.settings).state
        is ItemState.DISPATCH_ERROR
    )
    message = str(reaped.item(last).error_message)
    assert "pool main" in message and "pool spare" in message
    assert reaped.item(last).pool_id is None and main not in message


def test_budgets_are_listed_with_their_spend_and_deleted(reaped: Reaped) -> None:
    _running_for(reaped, 2)
    org = _budget(reaped, 1_000_000)
    _budget(reaped, 5, pool="spare")
    listed = reaped.api.get("/v1/admin/budgets?org=acme", headers=admin_headers()).json()
    rows = {(b["pool"], b["period"]): b for b in listed["budgets"]}
    assert set(rows) == {(None, "month"), ("spare", "month")}
    assert rows[(None, "month")]["spent_micros"] >= 5_000
    assert rows[("spare", "month")]["spent_micros"] == 0  # the item ran on "main"
    since = period_start(Period.MONTH, utcnow()).isoformat()
    assert rows[(None, "month")]["since"] == since
    gone = reaped.api.delete(f"/v1/admin/budgets/{org['id']}", headers=admin_headers())
    assert gone.json() == {"id": org["id"], "deleted": True}
    again = reaped.api.delete(f"/v1/admin/budgets/{org['id']}", headers=admin_headers())
    assert again.status_code == 404
    unknown_pool = {"org_id": "acme", "period": "day", "cap_micros": 1, "pool": "nosuch"}
    assert (
        reaped.api.put("/v1/admin/budgets", json=unknown_pool, headers=admin_headers()).status_code
        == 404
    )
    assert reaped.api.get("/v1/admin/budgets").status_code == 401
