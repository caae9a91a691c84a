"""The test suite's rule for ResourceWarnings (tests/conftest.py): one raised while the
cyclic garbage collector runs is shown, not raised; one raised when the last reference goes
stays an error in the test that dropped it."""

from __future__ import annotations

import gc
import socket
import sys
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any


@contextmanager
def _unraisable() -> Iterator[list[Any]]:
    """What reaches ``sys.unraisablehook`` (an exception raised in a finaliser)."""
    caught: list[Any] = []
    previous = sys.unraisablehook
    sys.unraisablehook = caught.append
    try:
        yield caught
    finally:
        sys.unraisablehook = previous


def test_a_socket_found_by_the_collector_is_shown_not_raised() -> None:
    with _unraisable() as raised, warnings.catch_warnings(record=True) as shown:
        warnings.simplefilter("error")
        cycle: list[Any] = [socket.socket()]
        cycle.append(cycle)
        del cycle
        gc.collect()
    assert raised == []
    assert [w.category for w in shown] == [ResourceWarning]
    assert "unclosed <socket.socket" in str(shown[0].message)


def test_a_socket_dropped_by_its_last_reference_is_still_an_error() -> None:
    with _unraisable() as raised, warnings.catch_warnings(record=True) as shown:
        warnings.simplefilter("error")
        dropped = socket.socket()
        del dropped
    assert shown == []
    assert [type(hook.exc_value) for hook in raised] == [ResourceWarning]


def test_an_ignore_before_the_error_still_ignores_it() -> None:
    with _unraisable() as raised, warnings.catch_warnings(record=True) as shown:
        warnings.simplefilter("error")
        warnings.filterwarnings("ignore", "unclosed <socket.socket", ResourceWarning)
        cycle: list[Any] = [socket.socket()]
        cycle.append(cycle)
        del cycle
        gc.collect()
    assert (raised, shown) == ([], [])
