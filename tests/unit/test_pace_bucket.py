"""The pace of a provider credential's creates (corral.shared.store.pacing), as pure state:
the rate's slots (GCRA with a burst), reservations, the cap in flight, the slowdown after a
refusal and the recovery after successes."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from corral.providers.pacing import PaceLimits
from corral.shared.store import pacing
from corral.shared.store.pacing import GO, PaceState, Wait

LEASE_S = 300.0


def _admit(
    state: PaceState, limits: PaceLimits, holder: str, now: float
) -> tuple[PaceState, pacing.Go | Wait]:
    return pacing.admit(state, limits, holder, now=now, lease_s=LEASE_S)


def _slots(limits: PaceLimits, count: int, now: float = 1000.0) -> list[float]:
    """When each of ``count`` creates asked at ``now`` may go."""
    state, slots = PaceState(), []
    for number in range(count):
        state, decided = _admit(state, limits, f"wi-{number}", now)
        slots.append(now if decided is GO else decided.until)
    return slots


def test_creates_go_at_the_rate_after_the_burst_each_given_its_slot() -> None:
    slots = _slots(PaceLimits(creates_per_s=5.0, burst=3), 6)
    assert slots[:3] == [1000.0] * 3  # the burst goes at once
    assert slots[3:] == pytest.approx([1000.2, 1000.4, 1000.6])


def test_a_reserved_create_goes_at_its_slot_without_taking_another() -> None:
    limits = PaceLimits(creates_per_s=2.0)
    state, first = _admit(PaceState(), limits, "a", 10.0)
    state, second = _admit(state, limits, "b", 10.0)
    assert first is GO and second == Wait(10.5, "rate")
    assert _admit(state, limits, "b", 10.2) == (state, Wait(10.5, "rate"))  # back early
    state, back = _admit(state, limits, "b", 10.5)
    assert back is GO and state.reserved == {}
    _, third = _admit(state, limits, "c", 10.5)  # the next slot is after b's, not b's again
    assert third == Wait(pytest.approx(11.0), "rate")


def test_creates_back_late_together_catch_up_at_twice_the_rate_not_at_once() -> None:
    limits = PaceLimits(creates_per_s=2.0)
    state, slots = PaceState(), []
    for holder in "abcd":
        state, decided = _admit(state, limits, holder, 10.0)
        slots.append(decided)
    assert slots[0] is GO and [s.until for s in slots[1:]] == pytest.approx([10.5, 11.0, 11.5])
    tat = state.tat
    # Their worker stalled: b, c and d come back together at 12.0, past every slot.
    state, b = _admit(state, limits, "b", 12.0)
    state, c = _admit(state, limits, "c", 12.0)
    assert b is GO
    assert c == Wait(pytest.approx(12.25), "rate"), "creates back late went at once"
    state, d = _admit(state, limits, "d", 12.1)
    assert d == Wait(pytest.approx(12.25), "rate")  # c's turn is not given away
    state, c = _admit(state, limits, "c", 12.25)
    state, d = _admit(state, limits, "d", 12.3)
    assert (c, d) == (GO, Wait(pytest.approx(12.5), "rate"))
    assert _admit(state, limits, "d", 12.5)[1] is GO
    assert state.tat == tat  # no slot of the rate was taken twice or lost


def test_creates_on_time_go_at_their_slots() -> None:
    limits = PaceLimits(creates_per_s=4.0, burst=2)
    state, asked = PaceState(), {}
    for holder in "abcdef":
        state, asked[holder] = _admit(state, limits, holder, 0.0)
    assert [asked[h] for h in "ab"] == [GO, GO]
    for holder in "cdef":
        slot = asked[holder]
        assert isinstance(slot, Wait)
        state, went = _admit(state, limits, holder, slot.until)
        assert went is GO, holder


def test_slots_are_reserved_only_so_far_ahead_and_the_rest_ask_again_spread() -> None:
    limits = PaceLimits(creates_per_s=1.0)
    state, asked = PaceState(), []
    for number in range(30):
        state, decided = _admit(state, limits, f"wi-{number}", 0.0)
        asked.append(decided)
    ahead = int(pacing.RESERVE_AHEAD_S)
    assert asked[0] is GO and list(state.reserved.values()) == [float(n) for n in range(1, 11)]
    assert len(state.reserved) == ahead
    later = [wait.until for wait in asked[ahead + 1 :] if isinstance(wait, Wait)]
    assert len(later) == 30 - ahead - 1
    assert all(1.0 <= until < 1.0 + ahead / 2 for until in later)
    assert len(set(later)) == len(later)  # spread, not all at once
    slowed = replace(PaceState(), rate=0.5)  # slowed: no slot tied to it far ahead
    for number in range(5):
        slowed, _ = _admit(slowed, limits, f"wi-{number}", 0.0)
    assert max(slowed.reserved.values()) <= pacing.SLOWED_RESERVE_AHEAD_S


def test_a_reservation_nobody_comes_back_for_is_dropped() -> None:
    state = PaceState(tat=5.0, reserved={"gone": 4.0})
    later = state.tidied(4.0 + pacing.RESERVATION_GRACE_S + 1)
    assert later.reserved == {}


def test_an_idle_pace_gives_its_burst_again() -> None:
    limits = PaceLimits(creates_per_s=1.0, burst=2)
    state = PaceState()
    for holder in "ab":
        state, decided = _admit(state, limits, holder, 0.0)
        assert decided is GO
    state, decided = _admit(state, limits, "c", 60.0)
    assert decided is GO
    _, decided = _admit(state, limits, "d", 60.0)
    assert decided is GO


def test_the_cap_in_flight_holds_creates_until_one_settles_or_its_lease_ends() -> None:
    limits = PaceLimits(creates_per_s=None, in_flight=2)
    state = PaceState()
    for holder in "ab":
        state, decided = _admit(state, limits, holder, 0.0)
        assert decided is GO
    state, held = _admit(state, limits, "c", 0.0)
    assert held == Wait(pacing.IN_FLIGHT_RECHECK_S, "in_flight")
    _, again = _admit(state, limits, "a", 0.0)  # a second delivery of one in flight
    assert again is GO
    settled = pacing.settle(state, limits, "a", succeeded=True, now=1.0)
    _, decided = _admit(settled, limits, "c", 1.0)
    assert decided is GO
    _, decided = _admit(state, limits, "c", LEASE_S + 1)  # a and b's workers died
    assert decided is GO


def test_a_create_waiting_for_room_in_flight_takes_no_slot_of_the_rate() -> None:
    limits = PaceLimits(creates_per_s=1.0, in_flight=1)
    state, _ = _admit(PaceState(), limits, "a", 0.0)
    state, held = _admit(state, limits, "b", 0.0)
    assert held == Wait(pacing.IN_FLIGHT_RECHECK_S, "in_flight") and state.reserved == {}
    state = pacing.settle(state, limits, "a", succeeded=True, now=0.5)
    state, decided = _admit(state, limits, "b", 0.5)
    assert decided == Wait(pytest.approx(1.0), "rate") and "b" in state.reserved


def test_a_refusal_halves_the_rate_once_per_burst_of_refusals_and_leaves_no_burst() -> None:
    limits = PaceLimits(creates_per_s=4.0, burst=4, in_flight=10)
    state = PaceState()
    for holder in "abcd":
        state, _ = _admit(state, limits, holder, 100.0)
    state, until = pacing.refused(state, limits, "a", now=100.1)
    assert state.rate == 2.0 and state.slowed_at == 100.1
    assert until == pytest.approx(100.1)  # the first slot at the slowed rate, no burst
    state, until_b = pacing.refused(state, limits, "b", now=100.2)  # the same burst
    assert state.rate == 2.0
    assert until_b == pytest.approx(100.6)
    assert set(state.in_flight) == {"c", "d"} and set(state.reserved) == {"a", "b"}
    _, decided = _admit(state, limits, "e", 100.2)
    assert isinstance(decided, Wait) and decided.until == pytest.approx(101.1)
    state, _ = pacing.refused(state, limits, "c", now=102.0)  # later: slowed again
    assert state.rate == 1.0


def test_the_rate_never_slows_below_its_floor_and_successes_bring_it_back() -> None:
    limits = PaceLimits(creates_per_s=10.0)
    state = PaceState()
    for second in range(20):
        state, _ = pacing.refused(state, limits, "x", now=float(second * 10))
    assert state.rate == pytest.approx(10.0 * pacing.FLOOR_SHARE)
    successes = 0
    while state.rate is not None:
        state = pacing.settle(state, limits, "x", succeeded=True, now=1000.0)
        successes += 1
    assert successes == math.ceil((1 - pacing.FLOOR_SHARE) / pacing.RECOVERY_SHARE)
    failed = pacing.settle(PaceState(rate=5.0), limits, "x", succeeded=False, now=0.0)
    assert failed.rate == 5.0  # a failure for another reason is no success


def test_a_refusal_without_a_rate_waits_a_fixed_time_or_the_providers_word() -> None:
    limits = PaceLimits(creates_per_s=None, in_flight=4)
    state, until = pacing.refused(PaceState(in_flight={"a": 500.0}), limits, "a", now=10.0)
    assert until == 10.0 + pacing.NO_RATE_WAIT_S and state.in_flight == {}
    _, until = pacing.refused(PaceState(), limits, "a", now=10.0, retry_after_s=7)
    assert until == 17.0


def test_only_configured_limits_pace() -> None:
    assert not PaceLimits(creates_per_s=None).paced
    assert PaceLimits(creates_per_s=None, in_flight=3).paced
    assert PaceLimits(creates_per_s=0.5).paced
