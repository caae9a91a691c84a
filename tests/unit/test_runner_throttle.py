"""The runner against a control plane that throttles it (429 + Retry-After) and that stops
storing its logs (the work item's log budget spent)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from corral.runner.control import ControlClient, Endpoint
from corral.runner.errors import ThrottledError
from corral.runner.logs import LogShipper
from tests.unit.test_runner import PlaneFactory, control_plane, run_runner, shell

__all__ = ["control_plane"]  # the fixture, used by name


def test_throttled_calls_wait_their_retry_after_and_go_through(
    control_plane: PlaneFactory, tmp_path: Path
) -> None:
    throttled = {f"/v1/runner/{call}": 2 for call in ("register", "claim", "logs", "complete")}
    # Over one batch of output: its first batch is a /logs call, the rest comes with the report.
    plane = control_plane(shell("seq 250; echo through"), throttled=dict(throttled))

    finished = run_runner(plane, tmp_path)

    assert finished.returncode == 0, finished.stderr
    paths = plane.paths()
    for path, refusals in throttled.items():
        assert paths.count(path) >= refusals + 1, (path, paths)  # refused, then answered
    assert paths.count("/v1/runner/complete") == 3  # twice refused, once answered
    assert "through" in plane.lines("stdout")


def test_a_call_throttled_past_its_budget_fails_like_any_error(
    control_plane: PlaneFactory,
) -> None:
    plane = control_plane(shell("true"), throttled={"/v1/runner/heartbeat": 1000})
    client = ControlClient(Endpoint.parse(plane.url), throttle_budget_s=0.35)
    started = time.monotonic()
    with pytest.raises(ThrottledError) as raised:
        client.with_session("crs_x").heartbeat()
    assert raised.value.status == 429 and raised.value.retry_after_s == 0.1
    assert 0.3 <= time.monotonic() - started < 5
    assert plane.paths().count("/v1/runner/heartbeat") == 4  # three waits of 0.1 s fit


def test_once_the_control_plane_drops_lines_the_runner_stops_sending(
    control_plane: PlaneFactory, tmp_path: Path
) -> None:
    plane = control_plane(
        shell("for i in $(seq 1 500); do echo line $i; done; sleep 1.5; echo after"),
        logs_answer={"accepted": 10, "dropped": 190},
    )

    finished = run_runner(plane, tmp_path)

    assert finished.returncode == 0, finished.stderr
    assert "after" not in plane.lines()
    assert plane.paths().count("/v1/runner/logs") == 1
    assert "log budget for this work item is spent" in finished.stderr


def test_the_shipper_reads_accepted_and_dropped_and_ignores_other_answers() -> None:
    answers: list[Any] = [None, {"accepted": 2}, {"accepted": 1, "dropped": 0}]
    sent: list[int] = []

    def send(lines: list[dict[str, Any]]) -> Any:
        sent.append(len(lines))
        return answers.pop(0) if answers else {"accepted": 0, "dropped": len(lines)}

    shipper = LogShipper(send, interval_s=60, batch_size=2)
    for number in range(10):
        shipper.emit("stdout", str(number))
        shipper.flush()
    shipper.close()
    assert sent == [1, 1, 1, 1]  # the fourth answer dropped lines: nothing after it
