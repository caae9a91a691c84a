"""The item's model profile in the runner's claim (its answer's ``profile`` and the work's
``CORRAL_MODEL``, ``CORRAL_PROFILE`` and ``CORRAL_AUTH_MODE``) and in an interactive
session's commands, on PostgreSQL."""

from __future__ import annotations

import uuid

from corral.scheduler.admin.pools import ProfileCreate, create_profile
from corral.scheduler.api.interactive import session_env
from corral.shared.store.db import Database
from corral.shared.store.models import AuthMode, WorkItem
from tests.integration.api_clients import ClientFactory
from tests.integration.test_api import awaiting_item


def test_the_claim_carries_the_items_profile_as_it_is_at_the_claim(
    make_client: ClientFactory, pg_db: Database
) -> None:
    client = make_client()
    item_id, token = awaiting_item(pg_db, f"org-{uuid.uuid4().hex[:8]}")
    name = f"p-{uuid.uuid4().hex[:8]}"
    create_profile(pg_db, ProfileCreate(name=name, model="claude-x", auth_mode=AuthMode.METERED))
    with pg_db.session() as session:
        session.get_one(WorkItem, item_id).profile = name
    registered = client.post("/v1/runner/register", json={"token": token})
    assert registered.status_code == 200, registered.text
    headers = {"Authorization": f"Bearer {registered.json()['session_token']}"}
    claimed = client.post("/v1/runner/claim", json={}, headers=headers)
    assert claimed.status_code == 200, claimed.text
    answer = claimed.json()
    assert answer["profile"] == {"name": name, "model": "claude-x", "auth_mode": "metered"}
    assert {k: v for k, v in answer["env"].items() if k.startswith("CORRAL_")} == {
        "CORRAL_MODEL": "claude-x",
        "CORRAL_PROFILE": name,
        "CORRAL_AUTH_MODE": "metered",
    }
    assert session_env(pg_db, item_id)["CORRAL_MODEL"] == "claude-x"  # a session's commands
