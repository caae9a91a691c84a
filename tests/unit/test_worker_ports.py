"""Each pytest-xdist worker hands out ports of its own share of the tests' range, so that a
port one worker's process has not bound yet is never another's (tests/acceptance/stack.py)."""

from __future__ import annotations

from tests.acceptance.stack import worker_ports


def test_a_serial_run_has_the_whole_range() -> None:
    whole = worker_ports({})
    assert (whole.start, whole.stop, whole.step) == (20000, 32768, 1)
    assert worker_ports({"PYTEST_XDIST_WORKER": "gw0", "PYTEST_XDIST_WORKER_COUNT": "1"}) == whole


def test_the_workers_shares_are_disjoint_and_cover_the_range() -> None:
    shares = [
        set(worker_ports({"PYTEST_XDIST_WORKER": f"gw{n}", "PYTEST_XDIST_WORKER_COUNT": "3"}))
        for n in range(3)
    ]
    assert all(len(share) > 4000 for share in shares)
    assert not (shares[0] & shares[1] or shares[0] & shares[2] or shares[1] & shares[2])
    assert set.union(*shares) == set(worker_ports({}))
