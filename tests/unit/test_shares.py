"""The division of a shared capacity (corral.shared.store.shares): weighted max-min fair,
never more than the capacity, a freed slot to the org furthest below its part."""

from __future__ import annotations

from corral.shared.store.shares import Member, divide, shares


def test_divide_is_weighted_and_gives_no_org_more_than_it_wants() -> None:
    assert divide(8, {"a": 100, "b": 100}, {"a": 3}) == {"a": 6, "b": 2}
    assert divide(8, {"a": 100, "b": 1}, {}) == {"a": 7, "b": 1}
    assert divide(8, {"a": 2, "b": 3}, {}) == {"a": 2, "b": 3}
    assert divide(8, {"a": 0, "b": 100}, {}) == {"a": 0, "b": 8}
    assert divide(4, {"a": 9, "b": 9, "c": 9}, {"b": 2}) == {"a": 1, "b": 2, "c": 1}


def test_a_newcomer_gets_the_next_free_slot_not_the_org_that_holds_them_all() -> None:
    flood = Member("pa", "a", held=8, waiting=8, share=8)
    newcomer = Member("pb", "b", held=0, waiting=1, share=0)
    # Every slot held: nothing to hand on, and the flood's share stops at what it holds.
    assert shares(8, [flood, newcomer], {}) == {"pa": 8, "pb": 0}
    # One of the flood's items ended: its slot goes to the newcomer.
    ended = Member("pa", "a", held=7, waiting=8, share=7)
    assert shares(8, [ended, newcomer], {}) == {"pa": 7, "pb": 1}


def test_shares_never_add_up_to_more_than_the_slots() -> None:
    for held_a in range(9):
        for held_b in range(9 - held_a):
            members = [
                Member("pa", "a", held=held_a, waiting=5, share=None),
                Member("pb", "b", held=held_b, waiting=5, share=None),
                Member("pc", "c", held=0, waiting=0, share=None),
            ]
            given = shares(8, members, {"b": 3})
            assert sum(given.values()) <= 8
            assert given["pa"] >= held_a and given["pb"] >= held_b


def test_what_no_org_wants_is_headroom_by_weight() -> None:
    idle = [Member("pa", "a", 0, 0, None), Member("pb", "b", 0, 0, None)]
    assert shares(8, idle, {"a": 3}) == {"pa": 6, "pb": 2}
    busy = [Member("pa", "a", 2, 0, 2), Member("pb", "b", 0, 1, 0)]
    # b's one item first, then the five left over by weight (1:1): a 2+3, b 1+2 or so.
    given = shares(8, busy, {})
    assert given["pb"] >= 1 and sum(given.values()) == 8


def test_an_org_over_its_part_keeps_its_slots_and_gets_no_more() -> None:
    over = Member("pa", "a", held=6, waiting=10, share=6)
    under = Member("pb", "b", held=0, waiting=10, share=0)
    # Weights 1:3 make a's part 2: it keeps its 6 until they end; the 2 free go to b.
    assert shares(8, [over, under], {"b": 3}) == {"pa": 6, "pb": 2}
