"""The in-memory provider fails, hangs and records as told."""

from __future__ import annotations

import threading

import pytest

from corral.providers.errors import (
    CapacityExhaustedError,
    ProviderTimeoutError,
    ProviderUnavailableError,
    SandboxCreateError,
)
from corral.providers.testing import InMemoryProvider
from tests.conftest import SpecFactory


def test_transient_failures_then_success(make_spec: SpecFactory) -> None:
    provider = InMemoryProvider()
    provider.fail_transiently(2)
    spec = make_spec()
    for _ in range(2):
        with pytest.raises(ProviderUnavailableError) as raised:
            provider.provision(spec)
        assert raised.value.retryable
    assert provider.provision(spec).external_id == spec.sandbox_id
    assert provider.methods() == ["provision"] * 3


def test_permanent_failure_carries_the_message(make_spec: SpecFactory) -> None:
    provider = InMemoryProvider()
    provider.fail_permanently("quota revoked")
    with pytest.raises(SandboxCreateError, match="quota revoked") as raised:
        provider.provision(make_spec())
    assert not raised.value.retryable
    assert provider.boxes == {}


def test_hang_blocks_until_released(make_spec: SpecFactory) -> None:
    provider = InMemoryProvider()
    provider.hang()
    finished = threading.Event()

    def provision() -> None:
        provider.provision(make_spec())
        finished.set()

    thread = threading.Thread(target=provision)
    thread.start()
    assert not finished.wait(0.2)
    provider.release()
    assert finished.wait(5)
    thread.join()


def test_hang_times_out(make_spec: SpecFactory) -> None:
    provider = InMemoryProvider({"hang_timeout_s": 0.05})
    provider.hang()
    with pytest.raises(ProviderTimeoutError):
        provider.provision(make_spec())


def test_capacity_limit(make_spec: SpecFactory) -> None:
    provider = InMemoryProvider({"max_concurrent": 1})
    provider.provision(make_spec())
    with pytest.raises(CapacityExhaustedError):
        provider.provision(make_spec())
