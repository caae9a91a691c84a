"""The routing gates are declared once (scheduler/placement.py) and both routing paths apply
them: an item gets the same answer from the one-item path (route_item) and from the batch
path (accept_batch), case by case. Before, the one-item path checked an unknown profile
before the org's limit and the batch path the other way round."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from corral.scheduler.batch import accept_batch
from corral.scheduler.intake import accept, route_item
from corral.shared.messages import DispatchRequest
from corral.shared.settings import CoreSettings
from corral.shared.store.db import Database
from corral.shared.store.models import ModelProfile, Pool, WorkItem
from corral.shared.store.org_limits import set_limit

CASES: dict[str, tuple[dict[str, Any], dict[str, Any], str]] = {
    # name: (the org's state, the message's fields, the answer)
    "unknown profile at the org's limit": ({"full": True}, {"profile": "nope"}, "unknown_profile"),
    "known profile at the org's limit": ({"full": True}, {}, "waiting_capacity"),
    "room": ({}, {}, "routed"),
    "network refused before the profile": (
        {"network": False},
        {"profile": "nope", "egress": {"allow_network": True}},
        "network_not_allowed",
    ),
    "network refused at the org's limit": (
        {"network": False, "full": True},
        {"egress": {"allow_network": True}},
        "network_not_allowed",
    ),
    "a provider the org has no pool of": ({}, {"provider": "docker"}, "no_eligible_pool"),
    # The deployment's default lets no item name an image of its own.
    "an image at the org's limit": ({"full": True}, {"image": "ubuntu"}, "image_not_allowed"),
    "an image before the profile": ({}, {"image": "x", "profile": "nope"}, "image_not_allowed"),
    # Failover is what a provision failure does: a new item is routed alike without it.
    "failover off": ({}, {"failover": False}, "routed"),
    "failover off at the org's limit": ({"full": True}, {"failover": False}, "waiting_capacity"),
}


@pytest.fixture
def db(sqlite_db: Database) -> Iterator[Database]:
    with sqlite_db.session() as session:
        session.add(ModelProfile(name="default", model="m", auth_mode="byok"))
    yield sqlite_db


def _org(db: Database, *, full: bool = False, network: bool = True) -> tuple[str, CoreSettings]:
    """A new org with a pool, and the settings of a deployment that does (or does not)
    give its sandboxes network."""
    org_id = f"o{uuid.uuid4().hex[:10]}"
    with db.session() as session:
        session.add(
            Pool(
                id=f"pool-{org_id}",
                org_id=org_id,
                name="a",
                provider_id="local",
                max_concurrent=5,
                slots_in_use=1 if full else 0,
            )
        )
        session.flush()
        set_limit(session, org_id, 1 if full else 10)
    settings = CoreSettings(
        sandbox_network="allow", sandbox_network_except_orgs="" if network else org_id
    )
    return org_id, settings


def _request(org_id: str, fields: dict[str, Any]) -> DispatchRequest:
    message = {
        "org": org_id,
        "project": "web",
        "profile": "default",
        "work": {"kind": "shell", "command": "true"},
        **fields,
    }
    return DispatchRequest.model_validate(message)


def _answer(db: Database, item_id: str) -> str:
    with db.session() as session:
        item = session.get_one(WorkItem, item_id)
        return item.error_code or item.state


@pytest.mark.parametrize("case", list(CASES))
def test_both_paths_give_an_item_the_same_answer(db: Database, case: str) -> None:
    state, fields, expected = CASES[case]
    one_org, settings = _org(db, **state)
    one = accept(db, _request(one_org, fields), actor="test").item_id
    route_item(db, one, actor="test", settings=settings)
    batch_org, settings = _org(db, **state)
    [taken] = accept_batch(db, [_request(batch_org, fields)], actor="test", settings=settings)
    assert (_answer(db, one), _answer(db, taken.item_id)) == (expected, expected)
