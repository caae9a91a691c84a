"""Redis dies under the running processes, with messages in flight, and comes back empty.

A private Redis of the test's own (so nothing else on the machine loses its broker) is
SIGKILLed twice while items are being provisioned and run; each time a new one starts on
the same port with nothing in it. Every corral process must still be alive afterwards and
serving: items dispatched after the restarts succeed.
"""

from __future__ import annotations

import time

from tests.acceptance.conftest import shell
from tests.acceptance.private_redis import PrivateRedis
from tests.acceptance.stack import Stack
from tests.conftest import require_bwrap_path


def test_every_process_survives_redis_restarting_empty_twice(
    private_redis: PrivateRedis, postgres_database_url: str
) -> None:
    require_bwrap_path()
    stack = Stack(database_url=postgres_database_url, broker_url=private_redis.url)
    try:
        stack.start()
        stack.make_org("redisdown")
        for _ in range(2):
            # Work in flight: provisions being made, runners running, tasks unacknowledged.
            ids = [
                stack.request("POST", "/v1/dispatch", shell("redisdown", f"sleep 1; echo {n}"))[1][
                    "id"
                ]
                for n in range(20)
            ]
            _await_some_taken(stack, ids)
            private_redis.kill()
            time.sleep(1)
            private_redis.start()
            stack.check_alive()
        after = []
        for _ in range(5):
            status, body = stack.request("POST", "/v1/dispatch", shell("redisdown", "echo after"))
            assert status == 202, body
            after.append(body["id"])
        views = stack.wait_final(after, timeout_s=180)
        assert [v["state"] for v in views] == ["succeeded"] * 5, views
        stack.check_alive()
    finally:
        stack.stop()


def _await_some_taken(stack: Stack, ids: list[str]) -> None:
    """Until a provider worker has taken some of ``ids`` (their sandboxes are being made)."""
    deadline = time.monotonic() + 60
    while True:
        states = {stack.request("GET", f"/v1/work-items/{i}")[1]["state"] for i in ids}
        if states & {"provisioning", "awaiting_claim", "running"}:
            return
        assert time.monotonic() < deadline, f"no item was taken: {states}"
        time.sleep(0.05)
