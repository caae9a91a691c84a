"""The in-memory provider fails, hangs and records as told."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from corral.providers.errors import (
    CapacityExhaustedError,
    FileTooLargeError,
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


def test_exec_output_and_downloads_keep_to_the_callers_limits(
    make_spec: SpecFactory, tmp_path: Path
) -> None:
    provider = InMemoryProvider()
    handle = provider.provision(make_spec())
    source = tmp_path / "big.bin"
    source.write_bytes(b"x" * 100)
    provider.upload_file(handle, source, "big.bin")

    cut = provider.exec_command(handle, ["cat", "big.bin"], max_output_bytes=10)
    assert (cut.stdout, cut.truncated) == ("x" * 10, True)
    whole = provider.exec_command(handle, ["cat", "big.bin"], max_output_bytes=100)
    assert (len(whole.stdout), whole.truncated) == (100, False)
    with pytest.raises(FileTooLargeError):
        provider.download_file(handle, "big.bin", tmp_path / "out", max_bytes=99)
    assert not (tmp_path / "out").exists()
    provider.download_file(handle, "big.bin", tmp_path / "out", max_bytes=100)
    assert (tmp_path / "out").read_bytes() == b"x" * 100
