"""Rate limits on the runner protocol: token buckets held in this process.

Each api replica keeps its own buckets (nothing is shared through the database or Redis), so
with N replicas behind a balancer a caller may make up to N times the configured rate. Three
kinds of bucket, each with a rate (tokens per second) and a burst (the bucket's size):

- per runner session (``CORRAL_RUNNER_RATE_PER_S`` / ``_BURST``), keyed by a digest of the
  bearer token, checked first, so that a session over its rate does not use up its
  address's bucket;
- per source address for every runner call (``CORRAL_RUNNER_ADDRESS_RATE_PER_S`` /
  ``_BURST``);
- per source address for ``register`` (``CORRAL_REGISTER_RATE_PER_S`` / ``_BURST``).

Callers on the api's Unix socket have no address: each sandbox counts as one, by the key the
server put in the scope (its pid namespace, ``scheduler/api/peers.py``), so that one sandbox's
flood costs only itself. Those the server could not tell apart share one.

A call over a limit is answered 429 with ``Retry-After`` (whole seconds) before its body is
read; the runner waits that long and tries again.
"""

from __future__ import annotations

import hashlib
import math
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from starlette.types import ASGIApp, Receive, Scope, Send

from corral.scheduler.api.http_errors import problem
from corral.scheduler.api.peers import PEER_EXTENSION
from corral.scheduler.api.process_runtime import runtime_of
from corral.shared.settings import ApiSettings

RUNNER_PREFIX = "/v1/runner/"
REGISTER_PATH = "/v1/runner/register"
# Redeeming a credential: counted per address like a registration (docs/warm-pools.md).
REDEEM_PATHS = frozenset({REGISTER_PATH, "/v1/runner/enrol"})
MAX_KEYS = 50_000


@dataclass
class _Bucket:
    tokens: float
    at: float


class TokenBuckets:
    """Token buckets by key. A bucket not used for a while is full again, so forgetting it
    changes nothing; beyond ``max_keys`` the least recently used are forgotten."""

    def __init__(
        self, *, max_keys: int = MAX_KEYS, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self._buckets: OrderedDict[str, _Bucket] = OrderedDict()
        self._max_keys = max_keys
        self._clock = clock
        self._lock = threading.Lock()

    def take(self, key: str, *, rate: float, burst: int) -> float:
        """Take a token from ``key``'s bucket: 0 when there was one, else the seconds until
        there will be (nothing is taken then). A rate of 0 means no limit."""
        if rate <= 0:
            return 0.0
        with self._lock:
            now = self._clock()
            bucket = self._buckets.pop(key, None)
            tokens = float(burst) if bucket is None else bucket.tokens
            if bucket is not None:
                tokens = min(float(burst), tokens + (now - bucket.at) * rate)
            wait = 0.0 if tokens >= 1 else (1 - tokens) / rate
            if wait == 0.0:
                tokens -= 1
            self._buckets[key] = _Bucket(tokens, now)
            while len(self._buckets) > self._max_keys:
                self._buckets.popitem(last=False)
            return wait

    def __len__(self) -> int:
        return len(self._buckets)


class RunnerRateLimitMiddleware:
    """429 with Retry-After for runner calls over a session's or an address's rate.

    The rates are ``settings()``'s, else those of the runtime the app's routes get."""

    def __init__(
        self,
        app: ASGIApp,
        *,
        settings: Callable[[], ApiSettings] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.app = app
        self.settings = settings
        self.buckets = TokenBuckets(clock=clock)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"].startswith(RUNNER_PREFIX):
            settings = self.settings() if self.settings else runtime_of(scope["app"]).settings
            wait = self.wait(scope, settings)
            if wait > 0:
                retry_after = max(1, math.ceil(wait))
                refused = problem(
                    429,
                    "rate_limited",
                    "(request)",
                    f"too many calls; retry after {retry_after} s",
                    headers={"Retry-After": str(retry_after)},
                )
                await refused(scope, receive, send)
                return
        await self.app(scope, receive, send)

    def wait(self, scope: Scope, settings: ApiSettings) -> float:
        """Seconds the call must wait; 0 when it may go ahead (its tokens are taken)."""
        address = _address(scope)
        checks: list[tuple[str, float, int]] = []
        session = _bearer_digest(scope)
        if session is not None:
            checks.append(
                (f"session:{session}", settings.runner_rate_per_s, settings.runner_rate_burst)
            )
        if scope["path"].rstrip("/") in REDEEM_PATHS:
            checks.append(
                (f"register:{address}", settings.register_rate_per_s, settings.register_burst)
            )
        checks.append(
            (
                f"address:{address}",
                settings.runner_address_rate_per_s,
                settings.runner_address_burst,
            )
        )
        for key, rate, burst in checks:
            wait = self.buckets.take(key, rate=rate, burst=burst)
            if wait > 0:
                return wait
        return 0.0


def _address(scope: Scope) -> str:
    """The caller's address: on the Unix socket its sandbox's key, else its IP address."""
    # The key goes first: a forwarded-for header sent on the socket, which made up a
    # client (under FORWARDED_ALLOW_IPS=*), does not stand in for it.
    peer = (scope.get("extensions") or {}).get(PEER_EXTENSION)
    if peer is None:
        client = scope.get("client")
        return str(client[0]) if client else "unix"
    key = peer.get("key")
    # No key: a peer the server could not tell apart (scheduler/api/peers.py); all of those
    # share this one bucket, as every caller on the socket did before keys.
    return f"unix:{key}" if isinstance(key, str) else "unix"


def _bearer_digest(scope: Scope) -> str | None:
    for name, value in scope["headers"]:
        if name == b"authorization":
            scheme, _, token = value.partition(b" ")
            if scheme.lower() == b"bearer" and token.strip():
                return hashlib.sha256(token.strip()).hexdigest()[:32]
    return None
