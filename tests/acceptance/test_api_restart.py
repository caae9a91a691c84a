"""The api goes down for 15 s while runners are finishing their work: the runners keep
their results and report them when it is back, through a new socket at the same path."""

from __future__ import annotations

import os
import signal
import time

from tests.acceptance.conftest import shell
from tests.acceptance.stack import Stack

DOWN_S = 15.0


def test_runners_report_to_an_api_that_was_down_for_15_seconds(fresh_stack: Stack) -> None:
    stack = fresh_stack
    stack.make_org("apidown", max_concurrent=16)
    ids = []
    for number in range(5):  # no network: the runners reach the api through its socket
        status, body = stack.request(
            "POST", "/v1/dispatch", shell("apidown", f"sleep 3; echo r{number}")
        )
        assert status == 202, body
        ids.append(body["id"])
    deadline = time.monotonic() + 60
    while {stack.request("GET", f"/v1/work-items/{i}")[1]["state"] for i in ids} != {"running"}:
        assert time.monotonic() < deadline, "the items did not start running"
        time.sleep(0.1)

    api = stack.processes["api"]
    os.killpg(api.pid, signal.SIGKILL)  # a crash: the socket file stays behind
    api.wait()
    down_until = time.monotonic() + DOWN_S
    while time.monotonic() < down_until:  # the work ends meanwhile; its reports fail
        time.sleep(0.5)
    stack.start_only(["api"])

    views = stack.wait_final(ids, timeout_s=120)
    assert [v["state"] for v in views] == ["succeeded"] * 5, [v["error"] for v in views]
    stack.check_alive()
