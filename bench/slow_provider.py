"""A provider worker for ``bench.provisions``: ``corral worker`` with a slow provider.

``python -m bench.slow_provider worker --provider slow --concurrency 256`` runs corral's own
command line, in a process that first registers :class:`SlowProvider` (the in-memory
provider, whose ``provision()`` sleeps ``delay_s`` first) and counts, inside the process,
provisions in flight (now, most, and their integral over time) and the SQL statements and
commits of every engine. Every ``stats_interval_s`` these counts are written, as JSON, to
``stats_path`` (both from the provider's configuration).

With ``BENCH_CELERY_ONLY=1`` in the environment the provision task calls the provider and
nothing else (no database): the anchor, what the same Celery worker costs per task.
"""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path
from typing import Any

from pydantic import Field, SecretStr
from sqlalchemy import Engine, event

from corral.providers.base import SandboxHandle, SandboxSpec
from corral.providers.registry import register_provider
from corral.providers.testing import InMemoryProvider, InMemoryProviderConfig


class SlowProviderConfig(InMemoryProviderConfig):
    delay_s: float = Field(default=0.5, ge=0, description="how long each provision() takes")
    stats_path: str | None = Field(default=None, description="where to write the counts")
    stats_interval_s: float = Field(default=0.1, gt=0)
    calls_path: str | None = Field(
        default=None, description="append '<work item id> <wall-clock time>' per provision() call"
    )


class _Counts:
    """Provisions in flight and SQL statements of this process, written to a file."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.in_flight = self.most = self.started = self.finished = 0
        self.statements = self.commits = 0
        self.area = 0.0  # in flight integrated over time: provision-seconds
        self.last = time.monotonic()
        self.first_start: float | None = None
        self.last_end: float | None = None

    def step(self, change: int) -> None:
        with self.lock:
            now = time.monotonic()
            self.area += self.in_flight * (now - self.last)
            self.last = now
            self.in_flight += change
            if change > 0:
                self.started += 1
                self.first_start = self.first_start or now
                self.most = max(self.most, self.in_flight)
            else:
                self.finished += 1
                self.last_end = now

    def snapshot(self) -> dict[str, Any]:
        with self.lock:
            busy = (self.last_end or 0) - (self.first_start or 0)
            return {
                "in_flight": self.in_flight,
                "most": self.most,
                "started": self.started,
                "finished": self.finished,
                "area": self.area,
                "busy_s": max(busy, 0.0),
                "statements": self.statements,
                "commits": self.commits,
            }


COUNTS = _Counts()
_CALLS_LOCK = threading.Lock()
_calls: Any = None  # the calls_path file, line-buffered


def _count_statement(*_: Any) -> None:
    COUNTS.statements += 1  # under the GIL; a lost increment would be noise, not a bias


def _count_commit(*_: Any) -> None:
    COUNTS.commits += 1


class SlowProvider(InMemoryProvider):
    """The in-memory provider, with a ``provision()`` that takes ``delay_s``."""

    id = "slow"
    display_name = "Slow in-memory (benchmarks)"
    config_model = SlowProviderConfig
    config: SlowProviderConfig

    def __init__(self, config: Any = None) -> None:
        super().__init__(config)
        if self.config.stats_path:
            writer = threading.Thread(target=self._write_stats, daemon=True, name="bench-stats")
            writer.start()

    def provision(self, spec: SandboxSpec) -> SandboxHandle:
        if self.config.calls_path:
            self._note_call(spec.work_item_id, time.time())
        COUNTS.step(+1)
        try:
            time.sleep(self.config.delay_s)
            # No box kept: memory that grew with every provision would hide what one in
            # flight costs.
            return self._handle(spec, spec.sandbox_id)
        finally:
            COUNTS.step(-1)

    def _note_call(self, item_id: str, at: float) -> None:
        with _CALLS_LOCK:
            global _calls  # noqa: PLW0603 - one file per process, opened on the first call
            if _calls is None:
                assert self.config.calls_path is not None
                _calls = Path(self.config.calls_path).open("a", buffering=1)  # noqa: SIM115
            _calls.write(f"{item_id} {at:.6f}\n")

    def _record(self, method: str, target: str) -> None:
        pass  # a long benchmark would keep every call in memory

    def _write_stats(self) -> None:
        assert self.config.stats_path is not None
        path = Path(self.config.stats_path)
        partial = path.with_suffix(".partial")
        while True:
            partial.write_text(json.dumps(COUNTS.snapshot()))
            os.replace(partial, path)
            time.sleep(self.config.stats_interval_s)


def _provider_only(rt: Any, item_id: str, **_: Any) -> Any:
    """The provision task's work without corral's: one spec, one provider call."""
    from corral.worker.provision import Outcome  # noqa: PLC0415 - loaded with the tasks

    rt.provider(SlowProvider.id).provision(
        SandboxSpec(
            work_item_id=item_id,
            sandbox_id=f"sb-{item_id}",
            org_id="bench",
            project_id="bench",
            registration_token=SecretStr("crt_anchor"),
            control_url="http://127.0.0.1:9",
        )
    )
    return Outcome.PROVISIONED


def main() -> None:
    from corral.cli.main import main as corral  # noqa: PLC0415 - after the provider is registered

    if os.environ.get("BENCH_CELERY_ONLY"):
        from corral.worker import tasks  # noqa: PLC0415

        vars(tasks)["provision_item"] = _provider_only  # the name the provision task calls
    register_provider(SlowProvider)
    event.listen(Engine, "before_cursor_execute", _count_statement)
    event.listen(Engine, "commit", _count_commit)
    corral()


if __name__ == "__main__":
    main()
