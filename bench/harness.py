"""What every benchmark shares: its smoke mode, and waits that end.

A benchmark's ``--smoke`` runs it once at tiny sizes, one round: that it runs to the end and
prints its figures, never a speed (tests/acceptance/test_benchmarks.py runs each in CI). Its
figures are then no measurement, and the run says so first.

Every wait of a benchmark has a deadline and, past it, fails naming what it waited for: a
benchmark that hangs is one nobody runs again.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

from corral.shared.settings import CoreSettings

SMOKE_HELP = (
    "tiny sizes, one round: checks that the benchmark runs to the end and prints its "
    "figures (they measure nothing)"
)


def add_smoke_flag(parser: argparse.ArgumentParser) -> None:
    """Give ``parser`` the ``--smoke`` flag every benchmark takes."""
    parser.add_argument("--smoke", action="store_true", help=SMOKE_HELP)


SMOKE_NOTICE = "smoke run: tiny sizes, one round; the figures below measure nothing"


def say_smoke(smoke: bool) -> None:
    """Say, before any figure, that a smoke run's figures are no measurement."""
    if smoke:
        print(SMOKE_NOTICE, flush=True)


class WaitTimeoutError(TimeoutError):
    """A benchmark waited past its deadline."""


def until(
    done: Callable[[], object],
    what: str,
    timeout_s: float,
    *,
    poll_s: float = 0.02,
    check: Callable[[], None] | None = None,
) -> None:
    """Return once ``done()`` is true; ``check()`` (which raises when a process it watches
    has died) runs between looks.

    Raises:
        WaitTimeoutError: ``timeout_s`` passed first; the message names ``what``.
    """
    deadline = time.monotonic() + timeout_s
    while not done():
        if check is not None:
            check()
        if time.monotonic() > deadline:
            raise WaitTimeoutError(f"waited {timeout_s:g} s for {what}")
        time.sleep(poll_s)


# The periodic intervals a stack of tests shortens (tests/acceptance/stack.py), each set back
# to the deployment's default: a benchmark measures what a deployment pays.
_PERIODIC = (
    "redrive_interval_s",
    "reaper_interval_s",
    "reconcile_interval_s",
    "heartbeat_interval_s",
)


def deployment_intervals() -> dict[str, str]:
    """The environment that gives a stack the deployment's default periodic intervals."""
    fields = CoreSettings.model_fields
    return {f"CORRAL_{name.upper()}": str(fields[name].default) for name in _PERIODIC}
