"""The lifecycle's one table of what entering each state implies, as the set-based paths
read it: a move's columns, and a refusal for a move whose effects no column carries."""

from __future__ import annotations

import pytest

from corral.providers.base import SandboxState
from corral.shared.store.db import utcnow
from corral.shared.store.lifecycle import (
    ITEM_TRANSITIONS,
    SANDBOX_TRANSITIONS,
    item_move_values,
    item_stamps,
    sandbox_move_values,
)
from corral.shared.store.models import ItemState


def test_the_claim_and_the_handle_moves_are_their_columns_alone() -> None:
    now = utcnow()
    claimed = item_move_values(ItemState.ROUTED, ItemState.PROVISIONING, now)
    assert claimed == {"state": "provisioning", "updated_at": now}
    handled = item_move_values(ItemState.PROVISIONING, ItemState.AWAITING_CLAIM, now)
    assert handled == {"state": "awaiting_claim", "updated_at": now, "provisioned_at": now}
    assert sandbox_move_values(SandboxState.READY, now) == {"status": "ready"}


def test_a_code_item_started_at_once_is_stamped_provisioned_as_well_as_claimed() -> None:
    now = utcnow()
    started = item_move_values(ItemState.PROVISIONING, ItemState.RUNNING, now)
    assert started == {
        "state": "running",
        "updated_at": now,
        "claimed_at": now,
        "provisioned_at": now,
    }
    assert item_stamps(ItemState.AWAITING_CLAIM, ItemState.RUNNING) == ("updated_at", "claimed_at")


@pytest.mark.parametrize(
    ("from_state", "to"),
    [
        (ItemState.RUNNING, ItemState.FAILED),  # ends the item
        (ItemState.ROUTED, ItemState.RECEIVED),  # requeues it, and gives its slot back
        (ItemState.ROUTED, ItemState.WAITING_CAPACITY),  # gives its slot back
    ],
)
def test_a_move_with_effects_beyond_its_columns_is_refused(
    from_state: ItemState, to: ItemState
) -> None:
    with pytest.raises(ValueError, match="effects"):
        item_move_values(from_state, to, utcnow())


def test_a_sandbox_end_is_refused_and_stamps_what_bills_it() -> None:
    with pytest.raises(ValueError, match="ends it"):
        sandbox_move_values(SandboxState.TERMINATED, utcnow())
    for ended in (SandboxState.TERMINATED, SandboxState.FAILED):
        assert SANDBOX_TRANSITIONS[ended].stamps == ("terminated_at", "cost_due_at")


def test_every_state_is_declared_and_every_item_move_stamps_updated_at() -> None:
    assert set(ITEM_TRANSITIONS) == set(ItemState)
    assert set(SANDBOX_TRANSITIONS) == set(SandboxState)
    assert all(entering.stamps[0] == "updated_at" for entering in ITEM_TRANSITIONS.values())
    assert [s for s, e in ITEM_TRANSITIONS.items() if e.ends] == [
        s for s in ItemState if s.is_final
    ]
