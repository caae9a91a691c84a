"""A warm pool's schedule: which window holds a moment of the week (UTC), and how many warm
sandboxes the pool wants then (docs/warm-pools.md)."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import pytest
from pydantic import ValidationError

from corral.shared.store.models import Pool
from corral.shared.store.warm import WarmWindow, keeps_warm, wanted

MONDAY = datetime(2026, 11, 23, tzinfo=UTC)  # a Monday, 00:00 UTC


def at(day: int, clock: str) -> datetime:
    hours, minutes = (int(part) for part in clock.split(":"))
    return MONDAY.replace(day=23 + day, hour=hours, minute=minutes)


def pool(warm_min: int = 1, schedule: list[dict[str, Any]] | None = None, **fields: Any) -> Pool:
    return Pool(
        id="pool-w",
        org_id="acme",
        provider_id="local",
        name="w",
        max_concurrent=10,
        warm_min=warm_min,
        warm_schedule=schedule,
        active=fields.get("active", True),
        deleted_at=fields.get("deleted_at"),
    )


@pytest.mark.parametrize(
    ("moment", "inside"),
    [
        (at(0, "08:00"), True),  # the start is in
        (at(0, "17:59"), True),
        (at(0, "18:00"), False),  # the end is out
        (at(0, "07:59"), False),
        (at(1, "12:00"), True),  # tuesday
        (at(2, "12:00"), False),  # wednesday is not one of its days
    ],
)
def test_a_day_window_holds_from_its_start_to_its_end_on_its_days(
    moment: datetime, inside: bool
) -> None:
    window = WarmWindow(days=["mon", "tue"], start="08:00", end="18:00", warm_min=3)
    assert window.contains(moment) is inside


@pytest.mark.parametrize(
    ("moment", "inside"),
    [
        (at(4, "22:00"), True),  # friday evening
        (at(5, "05:59"), True),  # saturday morning: still friday's night
        (at(5, "06:00"), False),
        (at(5, "22:00"), False),  # saturday evening: not one of its days
        (at(0, "03:00"), False),  # monday morning: sunday's night, not one of its days
    ],
)
def test_a_window_that_ends_at_or_before_its_start_runs_past_midnight(
    moment: datetime, inside: bool
) -> None:
    window = WarmWindow(days=["fri"], start="22:00", end="06:00", warm_min=3)
    assert window.contains(moment) is inside


def test_the_first_window_that_holds_the_moment_sets_warm_min() -> None:
    schedule = [
        {"days": ["mon"], "start": "09:00", "end": "12:00", "warm_min": 5},
        {"start": "08:00", "end": "20:00", "warm_min": 2},  # every day
    ]
    assert wanted(pool(1, schedule), at(0, "10:00")) == 5
    assert wanted(pool(1, schedule), at(0, "13:00")) == 2
    assert wanted(pool(1, schedule), at(3, "10:00")) == 2
    assert wanted(pool(1, schedule), at(3, "21:00")) == 1, "outside every window: warm_min"
    assert wanted(pool(1, schedule, active=False), at(0, "10:00")) == 0, "disabled: none"
    assert keeps_warm(pool(0, schedule)) and not keeps_warm(pool(0, []))


@pytest.mark.parametrize(
    "window",
    [
        {"start": "8:00", "end": "18:00", "warm_min": 1},
        {"start": "24:00", "end": "18:00", "warm_min": 1},
        {"start": "08:00", "end": "18:00", "warm_min": 101},
        {"days": ["monday"], "start": "08:00", "end": "18:00", "warm_min": 1},
        {"days": [], "start": "08:00", "end": "18:00", "warm_min": 1},
        {"start": "08:00", "end": "18:00", "warm_min": 1, "tz": "CET"},
    ],
)
def test_a_malformed_window_is_refused(window: dict[str, Any]) -> None:
    with pytest.raises(ValidationError):
        WarmWindow.model_validate(window)
