"""GroupCommit: concurrent requests run as shared batches, by one of the submitting threads."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor

import pytest

from corral.shared.batching import GroupCommit


def _until(condition: Callable[[], bool], timeout_s: float = 5) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.005)


class Recorder:
    """A batch function that records each batch and can be held while one runs."""

    def __init__(self) -> None:
        self.batches: list[list[int]] = []
        self.threads: list[int] = []
        self.hold = threading.Event()
        self.hold.set()
        self.running = threading.Event()

    def __call__(self, requests: Sequence[int]) -> list[int]:
        self.batches.append(list(requests))
        self.threads.append(threading.get_ident())
        self.running.set()
        assert self.hold.wait(5)
        return [request * 10 for request in requests]


def test_a_lone_request_runs_at_once_in_its_own_thread() -> None:
    run = Recorder()
    commit = GroupCommit(run, gather_s=5.0)
    started = time.monotonic()
    assert commit.submit(7) == 70
    assert time.monotonic() - started < 1  # no waiting for company when there is none
    assert run.batches == [[7]] and run.threads == [threading.get_ident()]


def test_requests_that_arrive_while_a_batch_runs_share_the_next_batch() -> None:
    run = Recorder()
    run.hold.clear()
    commit = GroupCommit(run)
    with ThreadPoolExecutor(8) as pool:
        first = pool.submit(commit.submit, 1)
        assert run.running.wait(5)
        rest = [pool.submit(commit.submit, n) for n in range(2, 8)]
        _until(lambda: commit.queued == 6)
        run.hold.set()
        assert first.result(5) == 10
        assert [future.result(5) for future in rest] == [n * 10 for n in range(2, 8)]
    assert [sorted(batch) for batch in run.batches] == [[1], [2, 3, 4, 5, 6, 7]]
    assert commit.batches == 2


def test_batches_hold_at_most_max_batch_requests() -> None:
    run = Recorder()
    run.hold.clear()
    commit = GroupCommit(run, max_batch=2)
    with ThreadPoolExecutor(6) as pool:
        futures = [pool.submit(commit.submit, 0)]
        assert run.running.wait(5)
        futures += [pool.submit(commit.submit, n) for n in range(1, 6)]
        _until(lambda: commit.queued == 5)
        run.hold.set()
        assert sorted(future.result(5) for future in futures) == [0, 10, 20, 30, 40, 50]
    assert [len(batch) for batch in run.batches] == [1, 2, 2, 1]


def test_a_failed_batch_fails_each_of_its_requests_and_the_next_batch_runs() -> None:
    def run(requests: Sequence[int]) -> list[int]:
        if 13 in requests:
            raise ConnectionError("database down")
        return list(requests)

    commit = GroupCommit(run)
    with pytest.raises(ConnectionError, match="database down"):
        commit.submit(13)
    assert commit.submit(1) == 1
    assert commit.queued == 0


def test_a_batch_that_gives_the_wrong_number_of_results_fails_its_requests() -> None:
    commit: GroupCommit[int, int] = GroupCommit(lambda requests: [])
    with pytest.raises(RuntimeError, match="a batch of 1 gave 0 results"):
        commit.submit(1)


def test_under_load_a_batch_waits_to_fill_up_to_max_batch() -> None:
    run = Recorder()
    commit = GroupCommit(run, max_batch=4, gather_s=5.0)
    run.hold.clear()
    with ThreadPoolExecutor(8) as pool:
        futures = [pool.submit(commit.submit, 0)]
        assert run.running.wait(5)
        futures += [pool.submit(commit.submit, n) for n in (1, 2)]
        _until(lambda: commit.queued == 2)
        run.hold.set()  # batch [1, 2] runs at once: the one before it was alone
        _until(lambda: len(run.batches) == 2)
        started = time.monotonic()
        futures += [pool.submit(commit.submit, n) for n in (3, 4, 5, 6)]
        assert sorted(f.result(5) for f in futures) == [n * 10 for n in range(7)]
    # The batch after a shared one waited for company, and ran once it was full, long
    # before gather_s ran out.
    assert [sorted(batch) for batch in run.batches[2:]] == [[3, 4, 5, 6]]
    assert time.monotonic() - started < 4


def test_invalid_limits_are_refused() -> None:
    with pytest.raises(ValueError, match="max_batch"):
        GroupCommit(lambda requests: requests, max_batch=0)
