"""Redis dies under the running processes, with messages in flight, and comes back empty.

A private Redis of the test's own (so nothing else on the machine loses its broker) is
SIGKILLed twice while items are being provisioned and run; each time a new one starts on
the same port with nothing in it. Every corral process must still be alive afterwards and
serving: items dispatched after the restarts succeed.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from tests.acceptance.conftest import shell
from tests.acceptance.stack import Stack, free_port
from tests.conftest import require_bwrap_path

REDIS_SERVER = shutil.which("redis-server")


class PrivateRedis:
    def __init__(self) -> None:
        self.port = free_port()
        self.dir = Path(tempfile.mkdtemp(prefix="corral-redis-"))
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        assert REDIS_SERVER is not None
        self.process = subprocess.Popen(
            [
                REDIS_SERVER,
                "--port",
                str(self.port),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
                "--dir",
                str(self.dir),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        deadline = time.monotonic() + 20
        while True:
            try:
                if redis.Redis.from_url(self.url, socket_timeout=1).ping():
                    return
            except redis.RedisError:
                assert time.monotonic() < deadline, "the private Redis did not start"
                time.sleep(0.05)

    def kill(self) -> None:
        assert self.process is not None
        self.process.send_signal(signal.SIGKILL)
        self.process.wait()

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.kill()
        shutil.rmtree(self.dir, ignore_errors=True)


@pytest.fixture
def private_redis() -> Iterator[PrivateRedis]:
    if REDIS_SERVER is None:
        if os.environ.get("CI"):
            pytest.fail("redis-server is not installed")
        pytest.skip("redis-server is not installed")
    server = PrivateRedis()
    server.start()
    try:
        yield server
    finally:
        server.stop()


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
