"""The reaper's one-at-a-time lock: a Redis lock with a lease, or a process lock.

With a Redis broker every maintenance worker shares one lock key (under the broker's key
prefix, so deployments sharing a Redis do not block each other). The holder renews the lease
as it works; a holder that crashed stops renewing and its lock expires after the lease.
With an in-process broker (``corral dev``) there is one process, so a process lock does.

Whatever the lock, the reaper's writes are guarded row by row as well (an ended sandbox is
never ended twice, an event is never written twice), so a lost lease costs time, not
correctness.
"""

from __future__ import annotations

import logging
import threading
import time
from abc import ABC, abstractmethod
from typing import Any

import redis
from redis.exceptions import LockError

from corral.shared.settings import CoreSettings

log = logging.getLogger(__name__)

LOCK_KEY = "corral:reaper:lock"
DUE_KEY = "corral:reaper:due:"


class SweepLock(ABC):
    """A lease on the right to sweep, and the clock of the sweep's less frequent phases."""

    def __init__(self, lease_s: float) -> None:
        self.lease_s = lease_s
        self._renewed = 0.0

    @abstractmethod
    def acquire(self) -> bool:
        """Take the lock if nobody holds it; never waits."""

    @abstractmethod
    def _renew(self) -> bool: ...

    @abstractmethod
    def release(self) -> None:
        """Give the lock up (no error if its lease ran out meanwhile)."""

    @abstractmethod
    def due(self, phase: str, interval_s: float) -> bool:
        """Whether ``phase`` is due (last run more than ``interval_s`` ago); if so, it is
        marked as run now."""

    def renew(self) -> bool:
        """Extend the lease when a third of it has passed. False: the lease was lost."""
        if time.monotonic() - self._renewed < self.lease_s / 3:
            return True
        ok = self._renew()
        self._renewed = time.monotonic()
        if not ok:
            log.warning("the reaper lost its sweep lock (lease expired); stopping this sweep")
        return ok


class RedisSweepLock(SweepLock):
    def __init__(self, client: redis.Redis, *, prefix: str, lease_s: float) -> None:
        super().__init__(lease_s)
        self._client = client
        self._prefix = prefix
        self._lock = client.lock(prefix + LOCK_KEY, timeout=lease_s, blocking=False)

    def acquire(self) -> bool:
        acquired = bool(self._lock.acquire(blocking=False))
        self._renewed = time.monotonic()
        return acquired

    def _renew(self) -> bool:
        try:
            self._lock.reacquire()
        except LockError:
            return False
        return True

    def release(self) -> None:
        try:
            self._lock.release()
        except LockError:
            log.warning("the sweep lock had expired before the sweep released it")

    def due(self, phase: str, interval_s: float) -> bool:
        if interval_s <= 0:
            return True
        key = self._prefix + DUE_KEY + phase
        return bool(self._client.set(key, "1", nx=True, px=max(1, int(interval_s * 1000))))


class LocalSweepLock(SweepLock):
    """For one process: the embedded stack and unit tests."""

    _held = threading.Lock()
    _last_run: dict[str, float] = {}  # noqa: RUF012 - process-wide on purpose

    def acquire(self) -> bool:
        self._renewed = time.monotonic()
        return self._held.acquire(blocking=False)

    def _renew(self) -> bool:
        return True

    def release(self) -> None:
        self._held.release()

    def due(self, phase: str, interval_s: float) -> bool:
        now = time.monotonic()
        last = self._last_run.get(phase)
        if last is not None and now - last < interval_s:
            return False
        self._last_run[phase] = now
        return True


_clients: dict[str, Any] = {}
_clients_lock = threading.Lock()


def sweep_lock(settings: CoreSettings) -> SweepLock:
    """The lock for this deployment: on Redis when the broker is Redis."""
    url = settings.broker_url
    if not url.startswith(("redis://", "rediss://", "unix://")):
        return LocalSweepLock(settings.reaper_lock_ttl_s)
    with _clients_lock:
        client = _clients.get(url)
        if client is None:
            client = _clients[url] = redis.Redis.from_url(url, socket_timeout=10)
    return RedisSweepLock(
        client, prefix=settings.broker_key_prefix, lease_s=settings.reaper_lock_ttl_s
    )
