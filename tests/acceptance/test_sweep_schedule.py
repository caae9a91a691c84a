"""The reaper's sweeps keep their schedule under a re-drive backlog.

500 items wait for 4 slots; every ended sandbox frees a slot and asks for a re-drive, and
beat asks for one every second too. Sweeps (due every second) must keep running on time:
re-drive requests are coalesced and expire, and at most one re-drive runs per process, so
they can neither pile up on the maintenance queue nor take every worker slot.
"""

from __future__ import annotations

import itertools
import time
from datetime import UTC, datetime

from corral.shared.broker import celery_app
from corral.shared.settings import CoreSettings
from tests.acceptance.conftest import shell
from tests.acceptance.stack import Stack

ITEMS = 500
WINDOW_S = 20.0
MAX_GAP_S = 6.0  # sweeps are due every second; allow for a loaded 2-core machine


def test_sweeps_run_on_time_under_a_redrive_backlog(fresh_stack: Stack) -> None:
    stack = fresh_stack
    stack.make_org("backlog", max_concurrent=4)
    sender = celery_app.configure(
        CoreSettings(broker_url=stack.broker_url, broker_key_prefix=stack.key_prefix)
    )
    # The window is measured from a sweep before it to a sweep after it: no gap between
    # two sweeps anywhere across it may pass MAX_GAP_S, at its edges either.
    [before] = stack.until(lambda: stack.sweeps_done()[-1:], "a sweep before the backlog")
    for number in range(ITEMS):
        message = shell("backlog", "sleep 1", idempotency_key=f"backlog-{number}")
        sender.send_task("corral.dispatch", args=[message])

    started = time.monotonic()
    while time.monotonic() - started < WINDOW_S:  # the backlog's window, not a wait
        stack.check_alive()
        time.sleep(0.5)
    ended = datetime.now(UTC)
    stack.until(
        lambda: stack.sweeps_done()[-1] > ended,
        f"a sweep after the window (none since {stack.sweeps_done()[-1]})",
        timeout_s=60,
    )
    sweeps = [at for at in stack.sweeps_done() if at >= before]
    after = next(index for index, at in enumerate(sweeps) if at > ended)
    sweeps = sweeps[: after + 1]
    assert len(sweeps) >= WINDOW_S / MAX_GAP_S, f"{len(sweeps)} sweeps\n{stack.logs()}"
    gaps = [(b - a).total_seconds() for a, b in itertools.pairwise(sweeps)]
    late = [(str(a), gap) for a, gap in zip(sweeps, gaps, strict=False) if gap > MAX_GAP_S]
    assert not late, f"sweeps stopped for more than {MAX_GAP_S:g} s after: {late}"
