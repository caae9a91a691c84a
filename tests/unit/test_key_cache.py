"""The api process's kept org keys (corral.scheduler.api.key_cache): a live key is read once
per TTL, a revoked one is refused at most a TTL after its revocation (at once when revoked
through the process), and nothing unknown is kept."""

from __future__ import annotations

from corral.scheduler.api.key_cache import KeyCache
from corral.shared.store.api_keys import FoundKey

KEY = FoundKey("key-1", "acme", frozenset({"dispatch", "read"}))


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class Rows:
    """The api_keys table as the cache reads it: digests of live keys, and the reads made."""

    def __init__(self, live: dict[str, FoundKey]) -> None:
        self.live = live
        self.reads: list[str] = []

    def read(self, digest: str) -> FoundKey | None:
        self.reads.append(digest)
        return self.live.get(digest)


def test_a_live_key_is_read_once_per_ttl() -> None:
    clock, rows = Clock(), Rows({"d1": KEY})
    cache = KeyCache(ttl_s=5, clock=clock)
    assert cache.find("d1", rows.read) == KEY
    clock.now += 4.9
    assert cache.find("d1", rows.read) == KEY
    assert rows.reads == ["d1"]
    clock.now += 0.1
    assert cache.find("d1", rows.read) == KEY
    assert rows.reads == ["d1", "d1"]


def test_a_key_revoked_elsewhere_is_refused_once_the_ttl_has_passed() -> None:
    clock, rows = Clock(), Rows({"d1": KEY})
    cache = KeyCache(ttl_s=5, clock=clock)
    cache.find("d1", rows.read)
    del rows.live["d1"]  # revoked by another replica, or the CLI
    clock.now += 4.9
    assert cache.find("d1", rows.read) == KEY  # within the TTL: still kept
    clock.now += 0.1
    assert cache.find("d1", rows.read) is None
    assert cache.find("d1", rows.read) is None  # a refused key is not kept either
    assert rows.reads == ["d1", "d1", "d1"]


def test_the_ttl_counts_from_before_the_read() -> None:
    """A read that takes its time (a slow database) does not stretch the bound: the key was
    found live as of the read's start, not its end."""
    clock, rows = Clock(), Rows({"d1": KEY})

    def slow_read(digest: str) -> FoundKey | None:
        clock.now += 3
        return rows.read(digest)

    cache = KeyCache(ttl_s=5, clock=clock)
    cache.find("d1", slow_read)
    clock.now += 2  # 5 s after the read began
    del rows.live["d1"]
    assert cache.find("d1", rows.read) is None


def test_a_key_revoked_through_the_process_is_forgotten_at_once() -> None:
    clock, rows = Clock(), Rows({"d1": KEY, "d2": FoundKey("key-2", "acme", frozenset())})
    cache = KeyCache(ttl_s=5, clock=clock)
    cache.find("d1", rows.read)
    cache.find("d2", rows.read)
    del rows.live["d1"]
    cache.forget("key-1")
    assert cache.find("d1", rows.read) is None
    assert len(cache) == 1  # the other key stays kept


def test_a_read_under_way_when_a_key_is_revoked_here_keeps_nothing() -> None:
    """The read may have seen the row before the revocation committed: what it found is
    answered to its own caller, but not kept for the next."""
    clock, rows = Clock(), Rows({"d1": KEY})
    cache = KeyCache(ttl_s=5, clock=clock)

    def read_then_revoke(digest: str) -> FoundKey | None:
        found = rows.read(digest)
        del rows.live["d1"]
        cache.forget("key-1")
        return found

    assert cache.find("d1", read_then_revoke) == KEY
    assert cache.find("d1", rows.read) is None


def test_unknown_keys_are_never_kept() -> None:
    clock, rows = Clock(), Rows({})
    cache = KeyCache(ttl_s=5, clock=clock)
    for _ in range(3):
        assert cache.find("guess", rows.read) is None
    assert rows.reads == ["guess"] * 3
    assert len(cache) == 0


def test_at_most_max_keys_are_kept_the_least_recently_used_dropped() -> None:
    clock = Clock()
    rows = Rows({f"d{n}": FoundKey(f"key-{n}", "acme", frozenset()) for n in range(3)})
    cache = KeyCache(ttl_s=5, max_keys=2, clock=clock)
    cache.find("d0", rows.read)
    cache.find("d1", rows.read)
    cache.find("d0", rows.read)  # used: d1 is now the least recent
    cache.find("d2", rows.read)
    rows.reads.clear()
    cache.find("d0", rows.read)
    cache.find("d1", rows.read)
    assert rows.reads == ["d1"]


def test_a_ttl_of_zero_reads_every_time() -> None:
    clock, rows = Clock(), Rows({"d1": KEY})
    cache = KeyCache(ttl_s=0, clock=clock)
    assert [cache.find("d1", rows.read) for _ in range(2)] == [KEY, KEY]
    assert rows.reads == ["d1", "d1"]
