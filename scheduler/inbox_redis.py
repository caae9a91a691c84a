"""The ``dispatch`` queue on Redis as a reliable queue.

kombu's Redis transport pops a message with BRPOP and only then notes it as unacknowledged:
a consumer killed in between loses the message. Here a message moves from the queue list
into this consumer's *in-flight* list in one atomic step (``BLMOVE``, or a Lua script for a
batch), and leaves it only when acknowledged. Each consumer keeps a short-lived *alive* key
fresh from a heartbeat thread; any consumer that finds another's alive key gone moves that
one's in-flight messages back to the head of the queue (again one atomic script), so a
killed scheduler's messages are delivered again within about one lease.

The lists are kombu's own (``<prefix>dispatch`` and its priority lists), so every Celery,
kombu or celery-node sender keeps working unchanged.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import uuid
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import redis

from corral.scheduler.inbox import Delivery, Inbox
from corral.shared.broker.envelope import DEFAULT_LIMITS, Limits, parse_redis_entry

log = logging.getLogger(__name__)

# kombu's Redis transport: a message with priority p goes to "<queue>\x06\x16<p>" (p > 0),
# and consumers read the steps in this order.
PRIORITY_SEPARATOR = "\x06\x16"
PRIORITY_STEPS = (0, 3, 6, 9)

_TAKE = """
local taken = {}
local limit = tonumber(ARGV[1])
for i = 2, #KEYS do
  while #taken < limit do
    local message = redis.call('RPOP', KEYS[i])
    if not message then break end
    redis.call('LPUSH', KEYS[1], message)
    taken[#taken + 1] = message
  end
end
return taken
"""

# KEYS: in-flight, queue head. ARGV: the messages to hand back, oldest first.
_RELEASE = """
for i = #ARGV, 1, -1 do
  if redis.call('LREM', KEYS[1], -1, ARGV[i]) > 0 then
    redis.call('RPUSH', KEYS[2], ARGV[i])
  end
end
return #ARGV
"""

# KEYS: the dead consumer's alive key, its in-flight list, the consumer set, queue head.
# ARGV: its id. Moves its messages back (oldest first in line) unless it is alive after all.
_RECOVER = """
if redis.call('EXISTS', KEYS[1]) == 1 then return -1 end
local moved = 0
while true do
  local message = redis.call('LMOVE', KEYS[2], KEYS[4], 'LEFT', 'RIGHT')
  if not message then break end
  moved = moved + 1
end
redis.call('SREM', KEYS[3], ARGV[1])
return moved
"""


def queue_keys(queue: str, prefix: str) -> list[str]:
    """The Redis lists kombu keeps ``queue`` in, highest priority first."""
    return [
        f"{prefix}{queue}{PRIORITY_SEPARATOR}{step}" if step else f"{prefix}{queue}"
        for step in PRIORITY_STEPS
    ]


class RedisInbox(Inbox):
    """A reliable consumer of one kombu queue on Redis (see the module docstring)."""

    def __init__(
        self,
        url: str,
        *,
        queue: str,
        prefix: str = "",
        lease_s: float = 10.0,
        limits: Limits = DEFAULT_LIMITS,
        client: redis.Redis | None = None,
    ) -> None:
        self._client = client or redis.Redis.from_url(
            url, socket_timeout=max(30.0, lease_s * 3), health_check_interval=30
        )
        self._prefix, self._queue, self._limits = prefix, queue, limits
        self._sources = queue_keys(queue, prefix)
        self.consumer_id = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        self._consumers = f"{prefix}corral.intake.consumers:{queue}"
        self._inflight = self._inflight_key(self.consumer_id)
        self._alive = self._alive_key(self.consumer_id)
        self._lease_ms = int(lease_s * 1000)
        self._take_script = self._client.register_script(_TAKE)
        self._release_script = self._client.register_script(_RELEASE)
        self._recover_script = self._client.register_script(_RECOVER)
        self._stop = threading.Event()
        self._heartbeat = threading.Thread(target=self._beat, name="intake-heartbeat", daemon=True)
        self._heartbeat.start()

    def _inflight_key(self, consumer_id: str) -> str:
        return f"{self._prefix}corral.intake.inflight:{self._queue}:{consumer_id}"

    def _alive_key(self, consumer_id: str) -> str:
        return f"{self._prefix}corral.intake.alive:{self._queue}:{consumer_id}"

    def _beat(self) -> None:
        while True:
            try:
                self._client.set(self._alive, b"1", px=self._lease_ms)
                self._client.sadd(self._consumers, self.consumer_id)
            except redis.RedisError:
                log.warning("intake: could not renew the consumer lease", exc_info=True)
            if self._stop.wait(self._lease_ms / 4000):
                return

    def take(self, limit: int, *, wait_s: float) -> list[Delivery]:
        with _reachable():
            taken: list[bytes] = list(
                self._take_script(keys=[self._inflight, *self._sources], args=[limit])
            )
            if not taken and wait_s > 0:
                # The queue was empty: the message that ends the wait is handed on alone, at
                # once (any that came with it are the next take's, a round trip later).
                # BLMOVE takes fractions of a second; redis-py's typing says int.
                first = self._client.execute_command(  # type: ignore[no-untyped-call]
                    "BLMOVE", self._sources[0], self._inflight, "RIGHT", "LEFT", wait_s
                )
                taken = [first] if first is not None else []
        return [self._delivery(raw) for raw in taken]

    def _delivery(self, raw: bytes) -> Delivery:
        limits = self._limits
        return Delivery(raw=raw, read=lambda: parse_redis_entry(raw, limits), handle=raw)

    def ack(self, deliveries: Sequence[Delivery]) -> None:
        if not deliveries:
            return
        with _reachable(), self._client.pipeline(transaction=False) as pipe:
            for delivery in deliveries:
                pipe.lrem(self._inflight, -1, delivery.raw)  # type: ignore[arg-type]  # bytes
            pipe.execute()

    def release(self, deliveries: Sequence[Delivery]) -> None:
        if deliveries:
            with _reachable():
                self._release_script(
                    keys=[self._inflight, self._sources[0]], args=[d.raw for d in deliveries]
                )

    def recover(self) -> int:
        """Hand back the in-flight messages of every consumer whose lease ran out."""
        with _reachable():
            return self._recover()

    def _recover(self) -> int:
        moved = 0
        for member in self._client.smembers(self._consumers):
            consumer_id = member.decode() if isinstance(member, bytes) else str(member)
            if consumer_id == self.consumer_id:
                continue
            keys = [self._alive_key(consumer_id), self._inflight_key(consumer_id)]
            keys += [self._consumers, self._sources[0]]
            result = int(self._recover_script(keys=keys, args=[consumer_id]))
            if result > 0:
                log.warning(
                    "intake: %d messages of a stopped consumer are queued again",
                    result,
                    extra={"consumer": consumer_id},
                )
                moved += result
        return moved

    def stray_messages(self) -> int:
        if not self._prefix:
            return 0
        with _reachable(), self._client.pipeline(transaction=False) as pipe:
            for key in queue_keys(self._queue, ""):
                pipe.llen(key)
            lengths: list[Any] = pipe.execute()
        return sum(int(n) for n in lengths)

    def close(self) -> None:
        """Stop the heartbeat; hand back anything still held; leave the consumer set."""
        self._stop.set()
        self._heartbeat.join(timeout=5)
        try:
            held = [_as_bytes(raw) for raw in self._client.lrange(self._inflight, 0, -1)]
            if held:
                self.release([self._delivery(raw) for raw in reversed(held)])
            self._client.delete(self._alive)
            self._client.srem(self._consumers, self.consumer_id)
        except (redis.RedisError, ConnectionError):
            log.warning("intake: could not leave cleanly; the lease expires", exc_info=True)
        finally:
            self._client.close()


@contextmanager
def _reachable() -> Iterator[None]:
    """Redis unreachable (down, restarting, timing out) as the builtin ConnectionError, which
    the intake loop waits out (it reopens the inbox and backs off): redis-py's own errors
    are not ConnectionError subclasses and would end the loop."""
    try:
        yield
    except (redis.ConnectionError, redis.TimeoutError) as exc:
        raise ConnectionError(f"Redis: {exc}") from exc


def _as_bytes(value: bytes | str) -> bytes:
    return value if isinstance(value, bytes) else value.encode()
