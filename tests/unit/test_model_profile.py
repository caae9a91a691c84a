"""The model profile: an item that names none takes `default` (and, when that does not
exist, its dispatch error says so and how to make it), and the profile reaches the work as
the runner's claim gives it."""

from __future__ import annotations

import pytest

from corral.runner.protocol import ModelProfile, parse_claim
from corral.scheduler.batch import accept_batch
from corral.scheduler.intake import accept, route_item
from corral.shared.messages import DispatchRequest
from corral.shared.store.db import Database
from corral.shared.store.models import AuthMode, ItemState
from corral.shared.store.profiles import read_profile
from tests.seeding import SETTINGS
from tests.unit.test_intake import ACTOR, load, make_pool, make_profile, message


def unnamed() -> DispatchRequest:
    """A message that names no profile."""
    fields = message()
    del fields["profile"]
    return DispatchRequest.model_validate(fields)


def test_a_message_that_names_no_profile_takes_default() -> None:
    assert unnamed().profile == "default"
    assert unnamed().model_dump()["profile"] == "default"  # stored as it routes


def test_an_item_that_names_no_profile_runs_on_default(sqlite_db: Database) -> None:
    make_pool(sqlite_db)
    make_profile(sqlite_db)
    item_id = accept(sqlite_db, unnamed(), actor=ACTOR).item_id
    outcome = route_item(sqlite_db, item_id, actor=ACTOR, settings=SETTINGS)
    assert outcome.state is ItemState.ROUTED
    assert load(sqlite_db, item_id).profile == "default"


@pytest.mark.parametrize("path", ["one by one", "batched"])
def test_without_a_default_profile_the_error_says_which_one_and_how_to_make_it(
    sqlite_db: Database, path: str
) -> None:
    make_pool(sqlite_db)
    if path == "batched":
        [taken] = accept_batch(sqlite_db, [unnamed()], actor=ACTOR, settings=SETTINGS)
        item_id = taken.item_id
    else:
        item_id = accept(sqlite_db, unnamed(), actor=ACTOR).item_id
        route_item(sqlite_db, item_id, actor=ACTOR, settings=SETTINGS)
    item = load(sqlite_db, item_id)
    assert (item.state, item.error_code) == (ItemState.DISPATCH_ERROR, "unknown_profile")
    assert "model profile `default` (field profile; a message that names none takes it)" in (
        item.error_message or ""
    )
    assert "corral profiles create --name default" in (item.error_message or "")


def test_a_profile_is_read_as_it_is_now_and_carried_in_corrals_own_variables(
    sqlite_db: Database,
) -> None:
    make_profile(sqlite_db, AuthMode.LOCAL, name="laptop")
    with sqlite_db.session() as session:
        profile = read_profile(session, "laptop")
        assert read_profile(session, "gone") is None and read_profile(session, None) is None
    assert profile is not None
    assert profile.env() == {
        "CORRAL_MODEL": "m-1",
        "CORRAL_PROFILE": "laptop",
        "CORRAL_AUTH_MODE": "local",
    }


def test_the_runner_reads_the_claims_profile() -> None:
    body = {
        "work_item_id": "wi-1",
        "work": {"kind": "shell", "command": "true"},
        "install_commands": [],
        "post_acquire": [],
        "pre_release": [],
        "env": {"CORRAL_MODEL": "claude-sonnet"},
        "path": [],
        "timeout_s": None,
        "max_result_bytes": 1024,
        "bundle": None,
        "inputs": None,
        "profile": {"name": "default", "model": "claude-sonnet", "auth_mode": "byok"},
    }
    claim = parse_claim(body)
    assert claim.profile == ModelProfile("default", "claude-sonnet", "byok")
    assert claim.env["CORRAL_MODEL"] == "claude-sonnet"
    assert parse_claim({**body, "profile": None}).profile is None
    assert parse_claim({k: v for k, v in body.items() if k != "profile"}).profile is None
