"""Output and files far past a limit, for the tests of what a provider, and the api, hold of
a command's output and of a file copied out (docs/sessions.md)."""

from __future__ import annotations

import tracemalloc
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

T = TypeVar("T")

LIMIT = 64 * 1024  # what the tests hand a provider as its limit


def flood(size: int) -> str:
    """A shell command that prints ``size`` bytes of ``x`` on stdout, then as many of ``e`` on
    stderr, and exits 3: an answer with that code shows the command ran to its end."""
    return (
        f"head -c {size} /dev/zero | tr '\\0' x; head -c {size} /dev/zero | tr '\\0' e >&2; exit 3"
    )


def big_and_fitting_files(size: int) -> str:
    """A shell command that writes ``big.bin`` (``size`` bytes) and ``fits.bin`` (``LIMIT``
    bytes) in its working directory."""
    return f"head -c {size} /dev/zero > big.bin; head -c {LIMIT} /dev/zero > fits.bin"


def bytes_written() -> int:
    """What this process has written so far (``wchar`` of /proc/self/io): files, pipes and
    sockets alike."""
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("wchar:"):
            return int(line.split()[1])
    raise AssertionError("no wchar in /proc/self/io")


def peak_while(call: Callable[[], T]) -> tuple[T, int]:
    """What ``call`` answers, and the most memory this process held at once while it ran
    (as ``tracemalloc`` traces it: Python's own allocations, every thread's)."""
    tracemalloc.start()
    try:
        answer = call()
        return answer, tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
