"""The runner tells a phase that ran out of memory from one that failed otherwise."""

from __future__ import annotations

from pathlib import Path

from corral.runner.memory import MemoryWatch
from corral.runner.protocol import Completion

FAILED = Completion(137, "work", error="work failed with exit code 137")


def test_a_grown_oom_kill_count_is_out_of_memory(tmp_path: Path) -> None:
    events = tmp_path / "memory.events"
    events.write_text("low 0\nhigh 0\nmax 3\noom 1\noom_kill 0\n")
    watch = MemoryWatch({"CORRAL_OOM_EVENTS": str(events)})
    assert watch.judge(FAILED) is FAILED  # nothing was killed yet
    events.write_text("low 0\nhigh 0\nmax 9\noom 2\noom_kill 1\n")
    judged = watch.judge(FAILED)
    assert judged.error_code == "out_of_memory"
    assert judged.error == (
        "work ran out of memory: the kernel's OOM killer killed a process of it at the "
        "sandbox's memory limit (work failed with exit code 137)"
    )
    # A success, a cancellation or another code stays what it was.
    done = Completion(0, "work")
    assert watch.judge(done) is done
    cancelled = Completion(-15, "work", cancelled=True)
    assert watch.judge(cancelled) is cancelled


def test_under_rlimit_an_allocation_failure_is_out_of_memory() -> None:
    watch = MemoryWatch({"CORRAL_MEMORY_LIMIT": "rlimit"})
    lines: list[tuple[str, str]] = []
    sink = watch.sink(lambda stream, line: lines.append((stream, line)))
    sink("stderr", "Traceback (most recent call last):")
    sink("stderr", "MemoryError")
    judged = watch.judge(Completion(1, "install", error="install step 1 failed"))
    assert lines[-1] == ("stderr", "MemoryError")  # passed on as it came
    assert judged.error_code == "out_of_memory"
    assert judged.error is not None and judged.error.startswith("install ran out of memory")


def test_without_a_limit_nothing_is_guessed() -> None:
    watch = MemoryWatch({})
    watch.sink(lambda stream, line: None)("stderr", "MemoryError")
    failed = Completion(1, "work", error="main() raised MemoryError")
    assert watch.judge(failed) is failed
