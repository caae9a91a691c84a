"""A running corral: separate api, scheduler, worker, maintenance and beat processes."""

from __future__ import annotations

import contextlib
import os
import socket
import threading
from collections.abc import Iterator
from typing import Any
from urllib.parse import urlsplit

import pytest
from celery import Celery
from sqlalchemy import Engine

from corral.shared.broker import celery_app
from corral.shared.settings import CoreSettings
from corral.shared.store.db import Database, make_engine
from tests.acceptance.private_redis import REDIS_SERVER, PrivateRedis
from tests.acceptance.stack import Stack, running_stack
from tests.conftest import database_copy


@pytest.fixture(scope="module")
def postgres_database_url(postgres_engine: Engine, postgres_template: str) -> Iterator[str]:
    """A PostgreSQL database of this module's own: a stack stopped mid-work leaves its items
    waiting, and another module's stack on the same database would run them."""
    with database_copy(postgres_engine, "corral_m_", postgres_template) as url:
        yield url


@pytest.fixture(scope="module")
def stack(postgres_database_url: str, redis_url: str) -> Iterator[Stack]:
    with running_stack(postgres_database_url, redis_url) as running:
        yield running


@pytest.fixture
def fresh_stack(fresh_pg_url: str, redis_url: str) -> Iterator[Stack]:
    """A stack and a database of the test's own, for a test that stops or overloads its
    processes."""
    with running_stack(fresh_pg_url, redis_url) as running:
        yield running


@pytest.fixture(scope="module")
def db(stack: Stack) -> Iterator[Database]:
    database = Database(make_engine(stack.database_url))
    yield database
    database.dispose()


@pytest.fixture(scope="module")
def sender(stack: Stack) -> Celery:
    """corral's Celery app in this process, pointed at the stack's broker."""
    return celery_app.configure(
        CoreSettings(broker_url=stack.broker_url, broker_key_prefix=stack.key_prefix)
    )


@pytest.fixture(scope="module")
def setup_org(stack: Stack) -> str:
    """Org acme with a byok profile `default` and one local pool."""
    status, _ = stack.request(
        "POST", "/v1/admin/profiles", {"name": "default", "model": "m", "auth_mode": "byok"}
    )
    assert status == 201
    status, _ = stack.request(
        "POST",
        "/v1/admin/pools",
        {"org_id": "acme", "name": "local", "provider_id": "local", "max_concurrent": 64},
    )
    assert status == 201
    return "acme"


def start_provider_stack(
    database_url: str, broker_url: str, provider_id: str, config: dict[str, Any], org: str
) -> Stack:
    """A stack whose only provider worker is ``provider_id``'s (with ``config``), and org
    ``org`` with one pool of it; the profile `default` too, unless an earlier stack on the
    same database made it. The caller stops it."""
    stack = Stack(
        database_url=database_url, broker_url=broker_url, provider_config={provider_id: config}
    )
    try:
        stack.start_only(["api", "scheduler", f"worker-{provider_id}", "maintenance", "beat"])
        profile = {"name": "default", "model": "m", "auth_mode": "byok"}
        assert stack.request("POST", "/v1/admin/profiles", profile)[0] in (201, 409)
        pool = {"org_id": org, "name": "pool", "provider_id": provider_id, "max_concurrent": 8}
        assert stack.request("POST", "/v1/admin/pools", pool)[0] == 201
    except BaseException:
        stack.stop()
        raise
    return stack


class RedisMonitor:
    """Every command Redis receives while running, through MONITOR, as raw text."""

    def __init__(self, host: str = "127.0.0.1", port: int = 6379) -> None:
        self._sock = socket.create_connection((host, port))
        self._sock.sendall(b"MONITOR\r\n")
        self._sock.settimeout(0.2)
        self._chunks: list[bytes] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        while not self._stop.is_set():
            try:
                chunk = self._sock.recv(65536)
            except TimeoutError:
                continue
            if not chunk:
                return
            self._chunks.append(chunk)

    def stop(self) -> bytes:
        if not self._stop.is_set():
            self._stop.set()
            self._thread.join(5)
            self._sock.close()
        return b"".join(self._chunks)


@contextlib.contextmanager
def _running_private_redis() -> Iterator[PrivateRedis]:
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


@pytest.fixture
def private_redis() -> Iterator[PrivateRedis]:
    with _running_private_redis() as server:
        yield server


@pytest.fixture(scope="module")
def module_redis() -> Iterator[PrivateRedis]:
    """A Redis of the module's own, for a stack whose whole broker traffic a test reads: the
    other test processes of the run (pytest-xdist's workers) share the machine's Redis."""
    with _running_private_redis() as server:
        yield server


@pytest.fixture
def redis_monitor(stack: Stack, redis_url: str) -> Iterator[RedisMonitor]:
    """MONITOR on the module's stack's broker, which must be a Redis of its own
    (``module_redis``): on the machine's Redis it would read other tests' traffic too."""
    address = urlsplit(stack.broker_url)
    assert address.netloc != urlsplit(redis_url).netloc, "the stack's broker is module_redis"
    monitor = RedisMonitor(address.hostname or "127.0.0.1", address.port or 6379)
    yield monitor
    monitor.stop()


def shell(org: str, command: str, **fields: Any) -> dict[str, Any]:
    return {
        "org": org,
        "project": "web",
        "profile": "default",
        "work": {"kind": "shell", "command": command},
        **fields,
    }
