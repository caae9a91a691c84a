"""The reaper's sweeps keep their schedule under a re-drive backlog.

500 items wait for 4 slots; every ended sandbox frees a slot and asks for a re-drive, and
beat asks for one every second too. Sweeps (due every second) must keep running on time:
re-drive requests are coalesced and expire, and at most one re-drive runs per process, so
they can neither pile up on the maintenance queue nor take every worker slot.
"""

from __future__ import annotations

import itertools
import json
import time
from datetime import datetime

from corral.shared import celery_app
from corral.shared.settings import CoreSettings
from tests.acceptance.conftest import shell
from tests.acceptance.stack import Stack

ITEMS = 500
WINDOW_S = 20.0
MAX_GAP_S = 6.0  # sweeps are due every second; allow for a loaded 2-core machine


def _sweeps(stack: Stack) -> list[datetime]:
    times = []
    for line in stack.log_path("maintenance").read_text(errors="replace").splitlines():
        if line.startswith("{") and '"reaper sweep done"' in line:
            times.append(datetime.fromisoformat(json.loads(line)["ts"]))
    return times


def test_sweeps_run_on_time_under_a_redrive_backlog(fresh_stack: Stack) -> None:
    stack = fresh_stack
    stack.make_org("backlog", max_concurrent=4)
    sender = celery_app.configure(
        CoreSettings(broker_url=stack.broker_url, broker_key_prefix=stack.key_prefix)
    )
    for number in range(ITEMS):
        message = shell("backlog", "sleep 1", idempotency_key=f"backlog-{number}")
        sender.send_task("corral.dispatch", args=[message])

    started = time.monotonic()
    first = len(_sweeps(stack))
    while time.monotonic() - started < WINDOW_S:
        stack.check_alive()
        time.sleep(0.5)
    sweeps = _sweeps(stack)[first:]
    assert len(sweeps) >= 2, f"{len(sweeps)} sweeps in {WINDOW_S:g} s\n{stack.logs()}"
    gaps = [(b - a).total_seconds() for a, b in itertools.pairwise(sweeps)]
    assert max(gaps) <= MAX_GAP_S, f"sweep gaps {sorted(gaps)[-5:]} s"
    uncovered = WINDOW_S - (sweeps[-1] - sweeps[0]).total_seconds()
    assert uncovered <= 2 * MAX_GAP_S, "sweeps stopped during the window"
