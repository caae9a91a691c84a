"""The estimated start's rule (shared/store/estimates.py) and its words: those ahead and the
item's own turn at the recent rate, a free slot sparing its turn, never before the time it
is held to, unknown without throughput, a lower bound at the place's cap."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from corral.shared.store.estimates import (
    StartEstimate,
    Throughput,
    estimate_fields,
    estimate_start,
    said,
)
from corral.shared.store.places import MAX_AHEAD

NOW = datetime(2030, 1, 2, 3, 4, 5, tzinfo=UTC)
ONE_A_MINUTE = Throughput(count=10, span_s=600.0)


def test_those_ahead_and_its_own_turn_at_the_rate() -> None:
    assert estimate_start(4, ONE_A_MINUTE, free_now=False, now=NOW) == StartEstimate(
        wait_s=300.0, start_at=NOW + timedelta(seconds=300), bound="about"
    )


def test_a_free_slot_spares_its_own_turn() -> None:
    estimate = estimate_start(4, ONE_A_MINUTE, free_now=True, now=NOW)
    assert estimate is not None and estimate.wait_s == 240.0
    first = estimate_start(0, ONE_A_MINUTE, free_now=True, now=NOW)
    assert first is not None and first.wait_s == 0.0 and first.start_at == NOW


def test_it_starts_no_earlier_than_it_is_held_to() -> None:
    held = NOW + timedelta(seconds=500)
    late = estimate_start(1, ONE_A_MINUTE, free_now=False, now=NOW, not_before=held)
    assert late is not None and late.start_at == held and late.wait_s == 500.0
    passed = estimate_start(1, ONE_A_MINUTE, free_now=False, now=NOW, not_before=NOW)
    assert passed is not None and passed.wait_s == 120.0


def test_nothing_handed_on_is_unknown() -> None:
    assert estimate_start(3, Throughput(count=0, span_s=600.0), free_now=False, now=NOW) is None
    fields = estimate_fields(None)
    assert fields == {"estimated_start_at": None, "estimated_wait_s": None, "estimate": None}
    assert said(fields) == "unknown: nothing handed on in the last 10 min"


def test_a_place_at_the_cap_is_a_lower_bound() -> None:
    estimate = estimate_start(MAX_AHEAD, ONE_A_MINUTE, free_now=False, now=NOW)
    assert estimate is not None and estimate.bound == "at_least"
    fields = estimate_fields(estimate)
    assert fields["estimate"] == "at_least"
    # (10,000 + 1) turns a minute apart: 600,060 s.
    assert said(fields) == "in at least 166.7 h (2030-01-09 01:45:05 UTC)"


def test_the_words_name_the_wait_in_its_unit() -> None:
    for wait_s, words in ((42.0, "42 s"), (300.0, "5 min"), (7200.0, "2.0 h")):
        estimate = StartEstimate(wait_s, NOW + timedelta(seconds=wait_s), "about")
        assert said(estimate_fields(estimate)).startswith(f"in about {words} (")
