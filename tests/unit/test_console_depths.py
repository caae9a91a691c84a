"""The console overview reads the broker's queue lengths at most once per DEPTHS_KEPT_S per
process: a page loaded again (or by many) does not wait on the broker again."""

from __future__ import annotations

from typing import Any

import pytest

from corral.scheduler.api.console import pages


def test_the_queue_lengths_are_read_once_per_interval(monkeypatch: pytest.MonkeyPatch) -> None:
    reads: list[list[str]] = []

    def depths(app: Any, names: list[str], *, timeout_s: float) -> dict[str, int]:
        reads.append(list(names))
        if len(reads) > 1:
            raise ConnectionError("the broker went away")
        return dict.fromkeys(names, 3)

    clock = [1000.0]
    monkeypatch.setattr(pages, "queue_depths", depths)
    monkeypatch.setattr(pages.time, "monotonic", lambda: clock[0])
    monkeypatch.setattr(pages, "_depths_kept", {})
    names = ["provision.local", "corral.dispatch"]
    assert pages._broker_depths(names) == ({"provision.local": 3, "corral.dispatch": 3}, "")
    clock[0] += pages.DEPTHS_KEPT_S / 2
    assert pages._broker_depths(list(reversed(names)))[0] == {
        "provision.local": 3,
        "corral.dispatch": 3,
    }
    assert len(reads) == 1  # kept
    clock[0] += pages.DEPTHS_KEPT_S
    waiting, said = pages._broker_depths(names)
    assert (waiting, said) == (None, "the broker did not answer (ConnectionError)")
    assert len(reads) == 2  # read again once the interval passed
