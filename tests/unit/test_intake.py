"""Intake and routing against a real (SQLite) database: rows, states and lifecycle events."""

from __future__ import annotations

import json
from typing import Any

import pytest
from pydantic import ValidationError
from sqlalchemy import func, select

from corral.scheduler.admin import pools as admin
from corral.scheduler.intake import accept, record_invalid, route_item
from corral.shared import runtime
from corral.shared.messages import DispatchRequest
from corral.shared.store.db import Database
from corral.shared.store.lifecycle import transition
from corral.shared.store.models import AuthMode, ItemState, LifecycleEvent, WorkItem
from corral.worker import maintenance
from tests.seeding import SETTINGS

ACTOR = "test"
SECRET = "sk-live-DO-NOT-STORE-4f1c9a"


def message(**fields: Any) -> dict[str, Any]:
    return {
        "org": "acme",
        "project": "web",
        "profile": "default",
        "work": {"kind": "shell", "command": "true"},
    } | fields


def dispatch(**fields: Any) -> DispatchRequest:
    return DispatchRequest.model_validate(message(**fields))


def make_profile(db: Database, auth_mode: AuthMode = AuthMode.BYOK, name: str = "default") -> None:
    admin.create_profile(db, admin.ProfileCreate(name=name, model="m-1", auth_mode=auth_mode))


def make_pool(db: Database, provider_id: str = "local", **fields: Any) -> str:
    fields.setdefault("name", f"{provider_id}-pool")
    fields.setdefault("org_id", "acme")
    created = admin.create_pool(db, admin.PoolCreate(provider_id=provider_id, **fields))
    return str(created["id"])


def load(db: Database, item_id: str) -> WorkItem:
    with db.session() as session:
        item = session.get(WorkItem, item_id)
        assert item is not None
        return item


def events(db: Database, item_id: str) -> list[tuple[str | None, str]]:
    with db.session() as session:
        rows = session.scalars(
            select(LifecycleEvent)
            .where(LifecycleEvent.work_item_id == item_id)
            .order_by(LifecycleEvent.id)
        )
        return [(row.from_state, row.to_state) for row in rows]


def item_count(db: Database) -> int:
    with db.session() as session:
        return int(session.scalar(select(func.count()).select_from(WorkItem)) or 0)


def set_state(db: Database, item_id: str, state: ItemState) -> None:
    with db.session() as session:
        item = session.get(WorkItem, item_id)
        assert item is not None
        transition(session, item, state, actor=ACTOR)


# --- accept --------------------------------------------------------------------------------


def test_accept_writes_a_received_row_and_its_lifecycle_event(sqlite_db: Database) -> None:
    request = dispatch(idempotency_key="k-1", env={"GREETING": "hello-from-the-sealed-env"})
    accepted = accept(sqlite_db, request, actor=ACTOR)
    assert accepted.created
    item = load(sqlite_db, accepted.item_id)
    assert item.state == ItemState.RECEIVED
    assert (item.org_id, item.project_id, item.profile) == ("acme", "web", "default")
    assert item.idempotency_key == "k-1"
    assert (
        DispatchRequest.model_validate(sqlite_db.sealer.open(item.payload, item.org_id, item.id))
        == request
    )
    # Stored sealed: the name is readable, the value is not.
    assert item.payload["env"]["GREETING"].startswith("corral-sealed:v2:")
    assert "hello-from-the-sealed-env" not in json.dumps(item.payload)
    assert item.pool_id is None and item.queue is None and item.attempts == 0
    assert [to for _, to in events(sqlite_db, accepted.item_id)] == ["received"]


def test_repeated_idempotency_key_returns_the_first_item(sqlite_db: Database) -> None:
    first = accept(sqlite_db, dispatch(idempotency_key="same"), actor=ACTOR)
    again = accept(
        sqlite_db,
        dispatch(idempotency_key="same", work={"kind": "shell", "command": "ls"}),
        actor=ACTOR,
    )
    assert again.item_id == first.item_id
    assert (first.created, again.created) == (True, False)
    assert item_count(sqlite_db) == 1
    assert len(events(sqlite_db, first.item_id)) == 1


def test_idempotency_key_is_per_org_and_optional(sqlite_db: Database) -> None:
    acme = accept(sqlite_db, dispatch(idempotency_key="same"), actor=ACTOR)
    other = accept(sqlite_db, dispatch(org="globex", idempotency_key="same"), actor=ACTOR)
    assert other.created and other.item_id != acme.item_id
    keyless = [accept(sqlite_db, dispatch(), actor=ACTOR) for _ in range(2)]
    assert all(a.created for a in keyless)
    assert keyless[0].item_id != keyless[1].item_id
    assert item_count(sqlite_db) == 4


# --- route_item ----------------------------------------------------------------------------


def test_route_item_routes_to_the_pool_and_queue(sqlite_db: Database) -> None:
    make_profile(sqlite_db)
    pool_id = make_pool(sqlite_db, "local")
    item_id = accept(sqlite_db, dispatch(), actor=ACTOR).item_id

    outcome = route_item(sqlite_db, item_id, actor="scheduler", settings=SETTINGS)

    assert (outcome.state, outcome.queue) == (ItemState.ROUTED, "provision.local")
    item = load(sqlite_db, item_id)
    assert item.state == ItemState.ROUTED
    assert (item.pool_id, item.queue, item.attempts) == (pool_id, "provision.local", 1)
    assert item.routed_at is not None
    assert item.error_code is None
    assert [to for _, to in events(sqlite_db, item_id)] == ["received", "routed"]
    assert events(sqlite_db, item_id)[-1] == ("received", "routed")


def test_route_item_leaves_a_routed_item_alone(sqlite_db: Database) -> None:
    make_profile(sqlite_db)
    make_pool(sqlite_db, "local")
    item_id = accept(sqlite_db, dispatch(), actor=ACTOR).item_id
    route_item(sqlite_db, item_id, actor=ACTOR, settings=SETTINGS)
    before = load(sqlite_db, item_id)

    outcome = route_item(sqlite_db, item_id, actor=ACTOR, settings=SETTINGS)

    assert outcome.state == ItemState.ROUTED
    assert outcome.queue is None  # nothing to enqueue a second time
    after = load(sqlite_db, item_id)
    assert (after.state, after.pool_id, after.queue, after.attempts) == (
        before.state,
        before.pool_id,
        before.queue,
        1,
    )
    assert len(events(sqlite_db, item_id)) == 2


def test_route_item_of_a_missing_item_raises(sqlite_db: Database) -> None:
    with pytest.raises(LookupError, match="wi-nope"):
        route_item(sqlite_db, "wi-nope", actor=ACTOR, settings=SETTINGS)


def test_unknown_profile_is_a_dispatch_error(sqlite_db: Database) -> None:
    make_pool(sqlite_db, "local")
    item_id = accept(sqlite_db, dispatch(profile="ghost"), actor=ACTOR).item_id

    outcome = route_item(sqlite_db, item_id, actor=ACTOR, settings=SETTINGS)

    assert (outcome.state, outcome.queue) == (ItemState.DISPATCH_ERROR, None)
    item = load(sqlite_db, item_id)
    assert (item.state, item.error_code) == (ItemState.DISPATCH_ERROR, "unknown_profile")
    assert "field profile" in (item.error_message or "")
    assert "ghost" not in (item.error_message or "")  # values are never echoed
    assert item.finished_at is not None
    assert events(sqlite_db, item_id)[-1] == ("received", "dispatch_error")


@pytest.mark.parametrize(
    ("pools", "fields", "fragment"),
    [
        pytest.param([], {}, "corral pools create", id="no-pool-at-all"),
        pytest.param(
            [{"provider_id": "local", "org_id": "globex"}],
            {},
            "corral pools create",
            id="other-orgs-pool",
        ),
        pytest.param(
            [{"provider_id": "local", "active": False}],
            {},
            "corral pools create",
            id="inactive-pool",
        ),
        pytest.param(
            [{"provider_id": "local"}],
            {"resources": {"gpu": 1}},
            "requirement gpu",
            id="pool-lacks-gpu",
        ),
    ],
)
def test_no_eligible_pool_is_a_dispatch_error(
    sqlite_db: Database, pools: list[dict[str, Any]], fields: dict[str, Any], fragment: str
) -> None:
    make_profile(sqlite_db)
    for pool in pools:
        make_pool(sqlite_db, **pool)
    item_id = accept(sqlite_db, dispatch(**fields), actor=ACTOR).item_id

    assert (
        route_item(sqlite_db, item_id, actor=ACTOR, settings=SETTINGS).state
        == ItemState.DISPATCH_ERROR
    )
    item = load(sqlite_db, item_id)
    assert (item.state, item.error_code) == (ItemState.DISPATCH_ERROR, "no_eligible_pool")
    assert fragment in (item.error_message or "")
    assert item.pool_id is None and item.queue is None


def test_local_auth_mode_with_only_an_e2b_pool(sqlite_db: Database) -> None:
    make_profile(sqlite_db, AuthMode.LOCAL)
    make_pool(sqlite_db, "e2b")
    item_id = accept(sqlite_db, dispatch(), actor=ACTOR).item_id

    route_item(sqlite_db, item_id, actor=ACTOR, settings=SETTINGS)

    item = load(sqlite_db, item_id)
    assert (item.state, item.error_code) == (ItemState.DISPATCH_ERROR, "auth_mode_requires_local")
    assert "e2b-pool (e2b)" in (item.error_message or "")


def test_provider_filter_limits_the_pools(sqlite_db: Database) -> None:
    make_profile(sqlite_db)
    make_pool(sqlite_db, "local", priority=10)
    docker_pool = make_pool(sqlite_db, "docker", priority=0)
    unfiltered = accept(sqlite_db, dispatch(), actor=ACTOR).item_id
    filtered = accept(sqlite_db, dispatch(provider="docker"), actor=ACTOR).item_id
    absent = accept(sqlite_db, dispatch(provider="e2b"), actor=ACTOR).item_id

    assert (
        route_item(sqlite_db, unfiltered, actor=ACTOR, settings=SETTINGS).queue == "provision.local"
    )
    assert (
        route_item(sqlite_db, filtered, actor=ACTOR, settings=SETTINGS).queue == "provision.docker"
    )
    assert load(sqlite_db, filtered).pool_id == docker_pool
    route_item(sqlite_db, absent, actor=ACTOR, settings=SETTINGS)
    missing = load(sqlite_db, absent)
    assert missing.error_code == "no_eligible_pool"
    assert "of provider e2b" in (missing.error_message or "")


def test_capacity_waits_then_routes_when_a_slot_frees(sqlite_db: Database) -> None:
    make_profile(sqlite_db)
    pool_id = make_pool(sqlite_db, "local", max_concurrent=1)
    first = accept(sqlite_db, dispatch(), actor=ACTOR).item_id
    second = accept(sqlite_db, dispatch(), actor=ACTOR).item_id

    assert route_item(sqlite_db, first, actor=ACTOR, settings=SETTINGS).state == ItemState.ROUTED
    waiting = route_item(sqlite_db, second, actor=ACTOR, settings=SETTINGS)
    assert (waiting.state, waiting.queue) == (ItemState.WAITING_CAPACITY, None)
    assert load(sqlite_db, second).pool_id is None
    # Still full: re-driving it again changes nothing and logs no repeat event.
    assert (
        route_item(sqlite_db, second, actor=ACTOR, settings=SETTINGS).state
        == ItemState.WAITING_CAPACITY
    )
    assert [to for _, to in events(sqlite_db, second)] == ["received", "waiting_capacity"]

    set_state(sqlite_db, first, ItemState.SUCCEEDED)
    # The freed slot is the waiting item's: the re-drive hands it on (a routing of its own
    # would find the pool closed to all but the re-drive while items wait for it).
    report = maintenance.redrive(runtime.Runtime(settings=SETTINGS, db=sqlite_db), actor=ACTOR)
    [rerouted] = report.routed

    assert (rerouted.item_id, rerouted.state, rerouted.queue) == (
        second,
        ItemState.ROUTED,
        "provision.local",
    )
    item = load(sqlite_db, second)
    assert (item.pool_id, item.attempts) == (pool_id, 1)
    assert events(sqlite_db, second)[-1] == ("waiting_capacity", "routed")


def test_full_pool_spills_to_the_next_priority(sqlite_db: Database) -> None:
    make_profile(sqlite_db)
    make_pool(sqlite_db, "local", name="first", priority=10, max_concurrent=1)
    second_pool = make_pool(sqlite_db, "docker", name="second", priority=1)
    route_item(
        sqlite_db,
        accept(sqlite_db, dispatch(), actor=ACTOR).item_id,
        actor=ACTOR,
        settings=SETTINGS,
    )
    item_id = accept(sqlite_db, dispatch(), actor=ACTOR).item_id

    assert (
        route_item(sqlite_db, item_id, actor=ACTOR, settings=SETTINGS).queue == "provision.docker"
    )
    assert load(sqlite_db, item_id).pool_id == second_pool


# --- record_invalid ------------------------------------------------------------------------


def test_record_invalid_names_the_field_and_keeps_no_values(sqlite_db: Database) -> None:
    bad = message(
        env={"API_KEY": SECRET},
        resources={"cpu": "plenty"},
        work={"kind": "shell", "command": "echo command-value-7"},
    )
    with pytest.raises(ValidationError) as raised:
        DispatchRequest.model_validate(bad)

    item_id = record_invalid(sqlite_db, bad, raised.value, actor=ACTOR)

    item = load(sqlite_db, item_id)
    assert (item.state, item.error_code) == (ItemState.DISPATCH_ERROR, "invalid_message")
    assert (item.org_id, item.project_id) == ("acme", "web")
    assert "resources.cpu" in (item.error_message or "")
    stored = json.dumps(item.payload) + (item.error_message or "")
    for value in (SECRET, "plenty", "command-value-7"):
        assert value not in stored
    assert item.payload == {
        "invalid_message": {"fields": ["env", "org", "profile", "project", "resources", "work"]}
    }
    assert events(sqlite_db, item_id)[-1][1] == "dispatch_error"


@pytest.mark.parametrize(
    ("raw", "org"),
    [
        pytest.param(["not", "an", "object"], "unknown", id="a-list"),
        pytest.param({"org": "x" * 64, "env": {"K": SECRET}}, "unknown", id="org-too-long"),
        pytest.param({"org": 42}, "unknown", id="org-not-a-string"),
    ],
)
def test_record_invalid_survives_any_shape(sqlite_db: Database, raw: Any, org: str) -> None:
    item_id = record_invalid(sqlite_db, raw, "invalid dispatch message", actor=ACTOR)
    item = load(sqlite_db, item_id)
    assert (item.state, item.error_code, item.org_id) == (
        ItemState.DISPATCH_ERROR,
        "invalid_message",
        org,
    )
    assert SECRET not in json.dumps(item.payload)
