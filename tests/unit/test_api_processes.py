"""The api's processes: several only on a shared database (the real processes are in
tests/acceptance/test_api_processes.py)."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from corral.scheduler.api.processes import (
    CRASH_LIMIT,
    READY,
    STEADY_S,
    ApiProcesses,
    ApiProcessesFailedError,
    _Child,
)
from corral.scheduler.api.server import serve
from corral.shared.errors import ConfigurationError
from corral.shared.settings import CoreSettings


def test_several_processes_are_refused_on_the_embedded_database(tmp_path: Path) -> None:
    settings = CoreSettings(
        database_url=f"sqlite:///{tmp_path / 'corral.db'}",
        state_dir=tmp_path,
        api_port=0,
        api_processes=2,
    )
    with pytest.raises(ConfigurationError, match="CORRAL_API_PROCESSES=2 needs a shared"):
        serve(settings)
    assert list(tmp_path.iterdir()) == []  # refused before it bound or wrote anything


def _dead_child(index: int, *, said_ready: bool, lived_s: float) -> _Child:
    ready_r, ready_w = os.pipe()
    if said_ready:
        os.write(ready_w, READY)
    os.close(ready_w)  # the child is gone
    return _Child(index, started=time.monotonic() - lived_s, ready_r=ready_r)


def test_a_child_that_never_could_serve_counts_as_crashing_however_long_it_took(
    tmp_path: Path,
) -> None:
    # On a loaded host a child may take longer than STEADY_S to find it cannot start (a
    # schema it refuses): it still counts, so the parent stops instead of restarting it
    # for ever at once.
    parent = ApiProcesses(count=1, sockets=[], metrics_dir=tmp_path)
    slow = _dead_child(0, said_ready=False, lived_s=STEADY_S * 3)
    parent._died(slow, 2, time.monotonic())
    assert parent.crashes == 1 and slow.ready_r is None
    steady = _dead_child(0, said_ready=True, lived_s=STEADY_S * 3)
    parent._died(steady, -9, time.monotonic())
    assert parent.crashes == 0  # it served, and long enough
    quick = _dead_child(0, said_ready=True, lived_s=0.1)
    parent._died(quick, -9, time.monotonic())
    assert parent.crashes == 1  # served, but died at once


def test_after_the_limit_of_children_that_never_could_serve_the_parent_stops(
    tmp_path: Path,
) -> None:
    parent = ApiProcesses(count=1, sockets=[], metrics_dir=tmp_path)
    for _ in range(CRASH_LIMIT - 1):
        parent._died(_dead_child(0, said_ready=False, lived_s=STEADY_S * 2), 2, time.monotonic())
    with pytest.raises(ApiProcessesFailedError, match="before they could serve"):
        parent._died(_dead_child(0, said_ready=False, lived_s=STEADY_S * 2), 2, time.monotonic())
