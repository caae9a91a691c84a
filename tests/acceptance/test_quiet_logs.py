"""An idle stack is quiet: the maintenance worker and beat write their routine task lines
(a periodic task received, succeeded, sent) at DEBUG, so at the default intervals an idle
maintenance worker writes a reaper sweep's line every 15 s and beat nothing (at INFO they
wrote about 170 and 90 lines a minute: docs/operations.md#logs)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path

import pytest
from sqlalchemy import Engine

from tests.acceptance.stack import Stack
from tests.conftest import _database, _url

SWEEP_EVERY_S = 5  # the reaper's interval here: the window is measured between its sweeps
DEFAULTS = {  # the deployment's defaults (the test stack's are shorter)
    "CORRAL_REDRIVE_INTERVAL_S": "5",
    "CORRAL_REAPER_INTERVAL_S": str(SWEEP_EVERY_S),
    "CORRAL_RECONCILE_INTERVAL_S": "60",
    "CORRAL_HEARTBEAT_INTERVAL_S": "10",
}
MOST_PER_MINUTE = 15  # the sweeps' own 12 a minute, and a little room


@pytest.fixture
def idle(postgres_engine: Engine, postgres_template: str, redis_url: str) -> Iterator[Stack]:
    """The maintenance worker and beat alone, on an empty database of their own."""
    with _database(postgres_engine, "corral_q_", postgres_template) as name:
        stack = Stack(database_url=_url(name), broker_url=redis_url, extra_env=DEFAULTS)
        try:
            yield stack.start_only(["maintenance", "beat"])
        finally:
            stack.stop()


def lines_between(path: Path, start: datetime, end: datetime) -> list[str]:
    """The process's log lines written in [start, end) (JSON lines: their own time)."""
    found = []
    for line in path.read_text(errors="replace").splitlines():
        try:
            at = datetime.fromisoformat(json.loads(line)["ts"])
        except (ValueError, KeyError, TypeError):  # Celery's banner, a line being written
            continue
        if start <= at < end:
            found.append(line)
    return found


def test_an_idle_maintenance_worker_and_beat_write_a_few_lines_a_minute(idle: Stack) -> None:
    # From the second sweep (the first may come while the processes start) to the fifth.
    sweeps = idle.until(lambda: len(done := idle.sweeps_done()) >= 5 and done, "five sweeps", 90)
    start, end = sweeps[1], sweeps[4]
    minutes = (end - start).total_seconds() / 60
    written = {
        name: lines_between(idle.log_path(name), start, end) for name in ("maintenance", "beat")
    }
    per_minute = sum(map(len, written.values())) / minutes
    assert per_minute < MOST_PER_MINUTE, written
    assert written["beat"] == [], written["beat"]  # every send is routine
    routine = [line for line in written["maintenance"] if "reaper sweep done" not in line]
    assert routine == []  # the outcomes, re-drive and warm ticks handled in the window
