"""The ledger's arithmetic and parsing, and how the reaper picks its lock."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from corral.providers.descriptors import BUILTIN
from corral.providers.registry import default_registry
from corral.providers.testing import InMemoryProvider
from corral.shared.settings import CoreSettings
from corral.shared.store.db import Database, make_engine
from corral.shared.store.ledger import BillingModel, Price, format_micros, parse_since, price
from corral.shared.store.models import Pool
from corral.shared.store.pools import session_limit_s
from corral.worker.sweep_lock import LocalSweepLock, PostgresSweepLock, sweep_lock


@pytest.mark.parametrize(
    ("model", "rate", "elapsed", "cpu", "expected"),
    [
        (BillingModel.WALL_CLOCK, 1_000, timedelta(seconds=90), None, Price(90_000)),
        # 1.5 microseconds' worth rounds half up; integer arithmetic, no float drift
        (BillingModel.WALL_CLOCK, 3, timedelta(microseconds=500_000), None, Price(2)),
        (BillingModel.WALL_CLOCK, 7, timedelta(hours=10_000), None, Price(252_000_000)),
        (BillingModel.FIXED, 40_000, timedelta(seconds=5), None, Price(40_000)),
        (BillingModel.ACTIVE_CPU, 2_000, timedelta(seconds=90), 1.25, Price(2_500)),
        (BillingModel.ACTIVE_CPU, 2_000, timedelta(seconds=90), None, Price(180_000, True)),
        (BillingModel.WALL_CLOCK, 1_000, timedelta(seconds=-1), None, Price(0)),  # clock skew
    ],
)
def test_price_by_billing_model(
    model: BillingModel, rate: int, elapsed: timedelta, cpu: float | None, expected: Price
) -> None:
    assert price(model, rate, elapsed=elapsed, cpu_seconds=cpu) == expected


def test_micro_units_print_as_decimals() -> None:
    assert [format_micros(v) for v in (0, 1, 1_234_567, -2_500_000)] == [
        "0.000000",
        "0.000001",
        "1.234567",
        "-2.500000",
    ]


def test_since_takes_a_duration_or_an_iso_time() -> None:
    now = datetime(2026, 11, 21, 12, 0, tzinfo=UTC)
    assert parse_since("24h", now=now) == now - timedelta(hours=24)
    assert parse_since("7d", now=now) == now - timedelta(days=7)
    assert parse_since("30m", now=now) == now - timedelta(minutes=30)
    assert parse_since("2026-11-01T00:00:00Z") == datetime(2026, 11, 1, tzinfo=UTC)
    assert parse_since("2026-11-01T00:00:00") == datetime(2026, 11, 1, tzinfo=UTC)
    with pytest.raises(ValueError, match=r"a duration like 24h, 7d, 30m .* or an ISO 8601 time"):
        parse_since("yesterday")


@pytest.mark.parametrize(
    "since",
    [
        "99999999999999d",
        "36501d",
        "1e9h",
        "²h",
        "0001-01-01T00:00:00+05:00",
        "1969-12-31",
        "9999-12-31T23:59:59-05:00",
        "yesterday\x00",
        "h",
        "",
    ],
)
def test_since_out_of_range_or_unparsable_is_refused_without_quoting_it(since: str) -> None:
    with pytest.raises(ValueError) as raised:
        parse_since(since)
    assert "since must be a duration" in str(raised.value)
    assert len(since) < 3 or since not in str(raised.value)


def _pool(provider_id: str, capabilities: dict[str, int] | None = None) -> Pool:
    return Pool(
        id="p",
        org_id="acme",
        name="p",
        provider_id=provider_id,
        priority=0,
        max_concurrent=1,
        capabilities=capabilities,
    )


def test_the_session_limit_is_the_shortest_of_timeout_pool_and_provider() -> None:
    assert session_limit_s(_pool("local"), None) is None
    assert session_limit_s(_pool("local"), 300) == 300
    assert session_limit_s(_pool("local", {"max_session_duration_seconds": 60}), 300) == 60
    assert session_limit_s(_pool("local", {"max_session_duration_seconds": 600}), 300) == 300


def test_a_providers_own_session_cap_holds_whatever_the_pool_says() -> None:
    class Capped(InMemoryProvider):
        id = "capped"
        display_name = "Five-hour sessions"
        default_capabilities = BUILTIN["e2b"].capabilities.model_copy(
            update={"max_session_duration_seconds": 18_000}
        )

    default_registry.register(Capped)
    try:
        assert session_limit_s(_pool("capped"), None) == 18_000
        raised = _pool("capped", {"max_session_duration_seconds": 36_000})
        assert session_limit_s(raised, None) == 18_000
        assert session_limit_s(raised, 60) == 60
    finally:
        default_registry.unregister("capped")


def test_the_sweep_lock_is_in_postgresql_whatever_the_broker(tmp_path: Path) -> None:
    sqlite = Database(make_engine(f"sqlite:///{tmp_path / 'c.db'}"))
    postgres = Database(make_engine("postgresql+psycopg://nobody@127.0.0.1:1/none"))
    try:
        for broker in ("memory://", "redis://127.0.0.1:1/0", "amqp://127.0.0.1:1//"):
            settings = CoreSettings(broker_url=broker, reaper_lock_ttl_s=42)
            assert isinstance(sweep_lock(sqlite, settings), LocalSweepLock)
            on_postgres = sweep_lock(postgres, settings)
            assert isinstance(on_postgres, PostgresSweepLock)
            assert on_postgres.lease_s == 42
    finally:
        sqlite.dispose()
        postgres.dispose()


def test_the_process_lock_admits_one_sweep_and_paces_phases() -> None:
    first, second = LocalSweepLock(30), LocalSweepLock(30)
    assert first.acquire()
    try:
        assert not second.acquire()
    finally:
        first.release()
    assert second.acquire()
    second.release()
    phase = f"test-{id(first)}"
    assert first.due(phase, 60) and not first.due(phase, 60)
    assert first.due(phase, 0)


def test_a_pool_with_an_unknown_billing_model_is_refused_at_creation() -> None:
    from pydantic import ValidationError

    from corral.scheduler.admin.pools import PoolCreate

    pool = {"org_id": "acme", "name": "p", "provider_id": "local"}
    with pytest.raises(ValidationError, match="billing_model"):
        PoolCreate.model_validate({**pool, "billing_model": "per-second"})
    accepted = PoolCreate.model_validate({**pool, "billing_model": "active-cpu"})
    assert accepted.billing_model == "active-cpu"
