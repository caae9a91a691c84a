"""Org keys an api process found live lately, kept for a few seconds.

Without it every call with an org key reads the key's row (a pool checkout, a transaction,
one indexed read): on the dispatch route, a third of the api's time per request. The
process keeps each live key it found by the key's SHA-256 (the digest the database keeps:
the key itself is held nowhere) for ``CORRAL_API_KEY_CACHE_TTL_S`` (5 s by default), counted
from before the read that found it. So a key revoked anywhere (another replica, the CLI,
the console) is refused by every api process at most that long after the revocation
commits; one revoked through this process's api is forgotten at once, and a read that was
under way then keeps nothing. Unknown and revoked keys are never kept: each is read again
every time, so a caller trying keys fills nothing. At most :data:`MAX_KEYS` are kept, the
least recently used dropped first. A TTL of 0 keeps nothing.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from corral.shared.store.api_keys import FoundKey

MAX_KEYS = 10_000


@dataclass(frozen=True)
class _Kept:
    key: FoundKey
    until: float  # monotonic time it is good until


class KeyCache:
    """Live org keys by their SHA-256, each kept for ``ttl_s`` from the read that found it."""

    def __init__(
        self,
        *,
        ttl_s: float,
        max_keys: int = MAX_KEYS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._ttl_s = ttl_s
        self._max_keys = max_keys
        self._clock = clock
        self._kept: OrderedDict[str, _Kept] = OrderedDict()
        self._forgotten = 0  # how many forgets so far: a read older than the last keeps nothing
        self._lock = threading.Lock()

    def kept(self, digest: str) -> FoundKey | None:
        """The key whose SHA-256 is ``digest`` while it is kept and good, else None (read it
        with :meth:`find`)."""
        with self._lock:
            return self._good(digest, self._clock())

    def find(self, digest: str, read: Callable[[str], FoundKey | None]) -> FoundKey | None:
        """The live key whose SHA-256 is ``digest``: the kept one while it is good, else
        ``read(digest)``'s answer (kept when it is a key)."""
        with self._lock:
            started, forgotten = self._clock(), self._forgotten
            kept = self._good(digest, started)
        if kept is not None:
            return kept
        found = read(digest)
        if found is None or self._ttl_s <= 0:
            return found
        with self._lock:
            if forgotten == self._forgotten:  # nothing was revoked here during the read
                self._kept[digest] = _Kept(found, started + self._ttl_s)
                self._kept.move_to_end(digest)
                while len(self._kept) > self._max_keys:
                    self._kept.popitem(last=False)
        return found

    def _good(self, digest: str, now: float) -> FoundKey | None:
        kept = self._kept.get(digest)
        if kept is None:
            return None
        if kept.until <= now:
            del self._kept[digest]
            return None
        self._kept.move_to_end(digest)
        return kept.key

    def forget(self, key_id: str) -> None:
        """Drop key ``key_id`` (it was just revoked), and what reads under way would keep."""
        with self._lock:
            self._forgotten += 1
            for digest in [d for d, kept in self._kept.items() if kept.key.id == key_id]:
                del self._kept[digest]

    def __len__(self) -> int:
        return len(self._kept)
