"""A provider the maintenance worker cannot ask is logged once per change of its state, not
at every pass: the E2B provider without its key (corral's real provider code) and a fake
that fails and recovers, over several reconciliation passes."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from corral.providers.errors import ProviderUnavailableError
from corral.providers.testing import InMemoryProvider
from corral.shared.runtime import Runtime
from corral.shared.settings import CoreSettings
from corral.shared.store.db import Database
from corral.shared.store.models import Pool
from corral.worker.reaper import SweepReport, reconcile


class Flaky(InMemoryProvider):
    """The in-memory provider, whose listing raises ``failure`` while one is set."""

    failure: Exception | None = None

    def list_managed(self) -> list:  # type: ignore[type-arg]
        if self.failure is not None:
            raise self.failure
        return super().list_managed()


def _pool(db: Database, provider_id: str) -> None:
    with db.session() as session:
        session.add(
            Pool(
                id=f"pool-{provider_id}",
                org_id="acme",
                name=provider_id,
                provider_id=provider_id,
                max_concurrent=1,
            )
        )


def _passes(rt: Runtime, count: int, caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    """Reconcile ``count`` times; the records of those passes at INFO or above."""
    caplog.clear()
    for _ in range(count):
        reconcile(rt, SweepReport())
    return [record for record in caplog.records if record.levelno >= logging.INFO]


def test_a_provider_that_cannot_be_asked_is_said_once_per_change(
    sqlite_db: Database,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("CORRAL_E2B_API_KEY", raising=False)
    rt = Runtime(settings=CoreSettings(state_dir=tmp_path), db=sqlite_db)
    flaky = Flaky()
    rt.use_provider(flaky)
    _pool(sqlite_db, "e2b")
    _pool(sqlite_db, flaky.id)
    flaky.failure = ProviderUnavailableError("the API answered 503")
    caplog.set_level(logging.DEBUG)

    said = _passes(rt, 4, caplog)

    assert [(r.levelname, r.provider_id) for r in said] == [  # type: ignore[attr-defined]
        ("WARNING", "e2b"),
        ("WARNING", "in-memory"),
    ]
    assert [_traceback(record) for record in said] == ["", ""]  # one line each
    e2b, fake = (record.getMessage() for record in said)
    assert "credential_missing" in e2b and "CORRAL_E2B_API_KEY" in e2b
    assert "provider_unavailable: the API answered 503" in fake
    assert sum(len(record.getMessage()) for record in said) < 1000

    flaky.failure = None  # it answers again: said once, and then nothing
    said = _passes(rt, 3, caplog)
    assert [(r.levelname, r.getMessage()) for r in said] == [
        ("INFO", "provider in-memory answers again (it was unavailable: provider_unavailable)")
    ]

    flaky.failure = RuntimeError("a bug")  # unexpected: said once, with its traceback
    said = _passes(rt, 3, caplog)
    assert [(r.levelname, r.provider_id) for r in said] == [("WARNING", "in-memory")]  # type: ignore[attr-defined]
    assert "RuntimeError: a bug" in _traceback(said[0])


def _traceback(record: logging.LogRecord) -> str:
    """The traceback a record carries (as its exception, or as the text corral's redaction
    filter, when a logging setup installed it, made of it); empty: none."""
    if record.exc_info:
        return logging.Formatter().formatException(record.exc_info)
    return record.exc_text or ""
