"""Lease policies: which level's field is in force, the back-off, and what a message may
not ask for (refused by name, as invalid_message)."""

from __future__ import annotations

from dataclasses import asdict
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from pydantic import ValidationError

from corral.shared.messages import DispatchRequest, field_errors
from corral.shared.store.leases import (
    MAX_ATTEMPTS_LIMIT,
    LeaseSpec,
    chosen,
    deployment_default,
    in_force,
    resolve,
)
from tests.unit.test_messages import message

NOW = datetime(2026, 11, 23, 12, 0, tzinfo=UTC)


def test_the_default_is_what_corral_did_before_leases() -> None:
    lease = resolve(None, None, max_attempts=3)

    assert lease == deployment_default(3)
    assert (lease.max_attempts, lease.retry_on_work_failed, lease.on_heartbeat_lost) == (
        3,
        False,
        "fail",
    )
    assert not lease.requeues_lost_runner
    assert lease.not_before(1, NOW) is None  # a requeue is routed at once


def test_the_items_field_beats_the_pools_which_beats_the_deployments() -> None:
    pool = {"max_attempts": 5, "on_heartbeat_lost": "requeue", "backoff_s": 30}
    item = LeaseSpec(max_attempts=2, retry_on_work_failed=True)

    lease = resolve(item, pool, max_attempts=3)

    assert asdict(lease) == {
        "max_attempts": 2,  # the item's
        "retry_on_work_failed": True,  # the item's
        "on_heartbeat_lost": "requeue",  # the pool's
        "backoff_s": 30,  # the pool's
        "backoff_factor": 2.0,  # the deployment's
        "backoff_max_s": 300.0,  # the deployment's
    }
    # What is stored on the item is what was chosen; the rest stays the deployment's.
    assert chosen(item, pool) == {
        "max_attempts": 2,
        "retry_on_work_failed": True,
        "on_heartbeat_lost": "requeue",
        "backoff_s": 30,
    }
    assert in_force(chosen(item, pool), max_attempts=3) == lease
    assert in_force(chosen(None, None), max_attempts=7).max_attempts == 7


def test_an_item_routed_before_leases_were_stored_gets_the_deployments_policy() -> None:
    assert in_force(None, max_attempts=4) == deployment_default(4)
    # A deployment may allow more attempts than a message may ask for.
    assert in_force({}, max_attempts=50).max_attempts == 50


def test_the_back_off_grows_by_its_factor_up_to_its_cap_without_jitter() -> None:
    lease = resolve(
        LeaseSpec(backoff_s=10, backoff_factor=3, backoff_max_s=100), None, max_attempts=5
    )

    assert [lease.delay_s(n) for n in (1, 2, 3, 4)] == [10, 30, 90, 100]
    assert lease.not_before(2, NOW) == NOW + timedelta(seconds=30)
    assert lease.not_before(2, NOW) == lease.not_before(2, NOW)  # no jitter


def test_a_lease_in_a_message_is_kept_with_only_its_given_fields() -> None:
    request = DispatchRequest.model_validate(
        message(lease={"max_attempts": 4, "on_heartbeat_lost": "requeue"})
    )

    assert request.lease is not None
    assert request.lease.given() == {"max_attempts": 4, "on_heartbeat_lost": "requeue"}
    assert DispatchRequest.model_validate(message()).lease is None


@pytest.mark.parametrize(
    ("lease", "field", "words"),
    [
        ({"max_attempts": 0}, "lease.max_attempts", "greater than or equal to 1"),
        (
            {"max_attempts": 1000},
            "lease.max_attempts",
            f"less than or equal to {MAX_ATTEMPTS_LIMIT}",
        ),
        ({"on_heartbeat_lost": "retry"}, "lease.on_heartbeat_lost", "'fail' or 'requeue'"),
        ({"retry_on_work_failed": "yes"}, "lease.retry_on_work_failed", "valid boolean"),
        ({"backoff_s": -1}, "lease.backoff_s", "greater than or equal to 0"),
        ({"backoff_factor": 0.5}, "lease.backoff_factor", "greater than or equal to 1"),
        ({"backoff_max_s": 10**9}, "lease.backoff_max_s", "less than or equal to 86400"),
        ({"max_attemps": 3}, "lease.max_attemps", "Extra inputs are not permitted"),
    ],
)
def test_what_cannot_be_enforced_is_refused_naming_the_field(
    lease: dict[str, Any], field: str, words: str
) -> None:
    with pytest.raises(ValidationError) as raised:
        DispatchRequest.model_validate(message(lease=lease))

    errors = field_errors(raised.value)
    assert [error["field"] for error in errors] == [field]
    assert words in errors[0]["message"]
