"""Whether an item may ask for network is the deployment's (CORRAL_SANDBOX_NETWORK and its
per-org exceptions), never the message's: refused as network_not_allowed on the one-item and
the batch routing paths alike, before any pool is looked at."""

from __future__ import annotations

import pytest

from corral.scheduler.batch import accept_batch
from corral.scheduler.intake import accept, route_item
from corral.shared.messages import DispatchRequest
from corral.shared.settings import CoreSettings
from corral.shared.store.db import Database
from corral.shared.store.models import WorkItem


def message(org: str, *, network: bool) -> DispatchRequest:
    return DispatchRequest.model_validate(
        {
            "org": org,
            "project": "web",
            "profile": "default",
            "work": {"kind": "shell", "command": "true"},
            "egress": {"allow_network": network},
        }
    )


# A deployment that gives no sandbox network but to two orgs'.
DENY_BUT_TRUSTED = CoreSettings(sandbox_network="deny", sandbox_network_except_orgs="trusted, ops")


@pytest.fixture
def deny_but_trusted(sqlite_db: Database) -> Database:
    return sqlite_db


def _error_code(db: Database, item_id: str) -> str | None:
    with db.session() as session:
        return session.get_one(WorkItem, item_id).error_code


def test_the_batch_path_refuses_network_the_deployment_does_not_give(
    deny_but_trusted: Database,
) -> None:
    db = deny_but_trusted
    requests = [
        message("acme", network=True),
        message("acme", network=False),
        message("trusted", network=True),
    ]
    taken = accept_batch(db, requests, actor="test", settings=DENY_BUT_TRUSTED)
    codes = [_error_code(db, one.item_id) for one in taken]
    # The others pass the gate (and meet the next one: no profile in this database).
    assert codes == ["network_not_allowed", "unknown_profile", "unknown_profile"]
    with db.session() as session:
        refused = session.get_one(WorkItem, taken[0].item_id)
        assert "CORRAL_SANDBOX_NETWORK" in (refused.error_message or "")


def test_the_one_item_path_answers_the_same(deny_but_trusted: Database) -> None:
    db = deny_but_trusted
    codes = []
    for request in (message("acme", network=True), message("ops", network=True)):
        item_id = accept(db, request, actor="test").item_id
        route_item(db, item_id, actor="test", settings=DENY_BUT_TRUSTED)
        codes.append(_error_code(db, item_id))
    assert codes == ["network_not_allowed", "unknown_profile"]


def test_allow_with_exceptions_refuses_only_the_excepted_orgs() -> None:
    settings = CoreSettings(sandbox_network="allow", sandbox_network_except_orgs="sandboxed")
    assert settings.network_allowed("acme")
    assert not settings.network_allowed("sandboxed")
