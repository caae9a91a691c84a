"""What one local sandbox can put on its host's disk: at most its deployment's bound, whatever
it writes. A flood of output stops growing the sandbox's log at ``max_log_mb`` (its end is
still kept, so the end log tells how the work ended). Real bubblewrap, real processes; each
attack caps itself at a few times the bound, so that on a host without the bound it shows
"far more than the limit" without filling the disk."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from corral.providers.base import SandboxHandle
from corral.providers.local.provider import LOG_TAIL_BYTES, LocalProvider
from tests.conftest import SpecFactory
from tests.integration.test_local_provider import output_of, wait_until_final

MIB = 1024 * 1024
LOG_MB = 1


def _provider(sandbox_root: Path, **config: Any) -> LocalProvider:
    return LocalProvider(
        {
            "root_dir": sandbox_root,
            "isolation": "required",
            "max_log_mb": LOG_MB,
            **config,
        }
    )


def _run(provider: LocalProvider, make_spec: SpecFactory, command: list[str]) -> SandboxHandle:
    spec = make_spec(egress={"allow_network": False}, provider_options={"command": command})
    handle = provider.provision(spec)
    wait_until_final(provider, handle, limit=120)
    return handle


def test_an_output_flood_stops_growing_the_log_and_its_end_is_kept(
    require_bwrap: str, sandbox_root: Path, make_spec: SpecFactory
) -> None:
    """64 MiB on stdout and stderr, in a log capped at 1 MiB: the work is not stopped or
    blocked (it runs to its end and exits 0), the log keeps its head, says what was dropped,
    and ends with the work's last words, which the end log shows."""
    provider = _provider(sandbox_root)
    flood = (
        "echo first words; head -c 33554432 /dev/zero | tr '\\0' x; "
        "head -c 33554432 /dev/zero | tr '\\0' e >&2; echo; echo last words >&2"
    )
    handle = _run(provider, make_spec, ["sh", "-c", flood])
    try:
        log = sandbox_root / handle.external_id / "output.log"
        size = log.stat().st_size
        head = log.read_bytes()[:100]
        end_log = provider.end_log(handle, max_lines=5, max_bytes=4096)
        status = provider.status(handle)
        output = output_of(provider, handle)
    finally:
        provider.terminate(handle)

    assert status.exit_code == 0, status
    assert size <= LOG_MB * MIB + LOG_TAIL_BYTES + 4096, size
    assert head.startswith(b"first words\n")
    assert f"the sandbox's output is capped at {LOG_MB} MiB" in output
    assert end_log is not None and end_log.rstrip().endswith("last words"), end_log
