"""The api's batches of sandbox ends (corral.scheduler.end_batches): gathered for the
window, sent at once when full or when the window is 0, and never lost to a broker away
without a word (the reaper's finished rule ends what a batch did not carry)."""

from __future__ import annotations

import threading
from typing import Any

import pytest

from corral.scheduler import end_batches
from corral.scheduler.end_batches import MAX_BATCH, EndBatches


@pytest.fixture
def sent(monkeypatch: pytest.MonkeyPatch) -> list[tuple[list[str], str]]:
    found: list[tuple[list[str], str]] = []
    arrived = threading.Condition()

    def send(name: str, *, args: list[Any]) -> None:
        assert name == "corral.terminate_many"
        with arrived:
            found.append((list(args[0]), args[1]))
            arrived.notify_all()

    monkeypatch.setattr(end_batches.app, "send_task", send)
    return found


def test_ends_within_the_window_go_as_one_message(sent: list[tuple[list[str], str]]) -> None:
    batches = EndBatches()
    batches.add("sb-1", window_s=30)
    batches.add("sb-2", window_s=30)
    assert sent == []  # the window is open
    batches.flush()
    assert sent == [(["sb-1", "sb-2"], "finished")]
    batches.flush()
    assert len(sent) == 1  # nothing left to send


def test_the_window_sends_the_batch_by_itself(sent: list[tuple[list[str], str]]) -> None:
    batches = EndBatches()
    batches.add("sb-1", window_s=0.05)
    batches.add("sb-2", window_s=0.05)
    done = threading.Event()
    for _ in range(200):  # the timer's thread sends it; wait for that, not for a time
        if sent:
            break
        done.wait(0.05)
    assert sent == [(["sb-1", "sb-2"], "finished")]


def test_a_window_that_ends_after_its_batch_was_sent_does_not_send_the_next_early(
    sent: list[tuple[list[str], str]],
) -> None:
    # Its timer fired as the flush ran, too late to be cancelled: the next batch, with a
    # window of its own, is not its to send.
    batches = EndBatches()
    batches.add("sb-1", window_s=30)
    stale = batches._timer
    assert stale is not None
    batches.flush()
    batches.add("sb-2", window_s=30)
    stale.function()  # what the timer's thread runs when it fires
    assert sent == [(["sb-1"], "finished")]
    batches.flush()
    assert sent[-1] == (["sb-2"], "finished")


def test_a_full_batch_and_a_zero_window_go_at_once(sent: list[tuple[list[str], str]]) -> None:
    batches = EndBatches()
    for number in range(MAX_BATCH):
        batches.add(f"sb-{number}", window_s=30)
    assert [len(ids) for ids, _ in sent] == [MAX_BATCH]
    batches.add("sb-alone", window_s=0)
    assert sent[-1] == (["sb-alone"], "finished")


def test_a_broker_away_is_logged_not_raised(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    def refuse(name: str, **_: Any) -> None:
        raise ConnectionError("the broker is away")

    monkeypatch.setattr(end_batches.app, "send_task", refuse)
    batches = EndBatches()
    batches.add("sb-1", window_s=0)  # does not raise
    assert "the reaper ends them" in caplog.text
