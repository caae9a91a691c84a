"""A Celery process that stops on an error exits non-zero, so its supervisor restarts it."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from celery import bootsteps

from corral.cli.processes import run_celery
from corral.shared.broker import celery_app
from corral.shared.settings import CoreSettings


class _Broken(bootsteps.StartStopStep):  # type: ignore[misc]
    """A worker part that fails to start: Celery's "Unrecoverable error"."""

    def start(self, worker: Any) -> None:
        raise RuntimeError("this part of the worker cannot start")


@pytest.fixture
def broken_worker() -> Iterator[None]:
    steps = celery_app.app.steps["worker"]
    steps.add(_Broken)
    try:
        yield
    finally:
        steps.discard(_Broken)


@pytest.mark.usefixtures("broken_worker")
@pytest.mark.filterwarnings("ignore::celery.exceptions.SecurityWarning")  # root, in CI
def test_a_worker_stopped_by_an_unrecoverable_error_exits_non_zero() -> None:
    celery_app.configure(CoreSettings(broker_url="memory://"))
    with pytest.raises(SystemExit) as stopped:
        run_celery(
            [
                "worker",
                "--pool=solo",
                "--without-heartbeat",
                "--without-gossip",
                "--without-mingle",
                "--loglevel=CRITICAL",
                "--queues=maintenance",
            ]
        )
    assert stopped.value.code == 1
