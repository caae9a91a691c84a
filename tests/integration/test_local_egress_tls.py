"""Secret bindings over HTTPS on the local provider, with real bubblewrap: corral's egress
proxy terminates a bound host's TLS with a certificate of a CA made for the sandbox alone,
puts the value in, and checks the destination's certificate against the deployment's CA
bundle; a host that is not bound is tunnelled untouched; the work, reading everything it
can, finds only the placeholder."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from corral.providers.base import SandboxSpec
from corral.providers.errors import SandboxCreateError
from corral.providers.local.provider import LocalProvider
from tests.conftest import SpecFactory
from tests.egress_probe import proxies_under
from tests.integration.test_local_provider import output_of, wait_until_final
from tests.tls_servers import (
    LoopbackCa,
    assert_https_outcome,
    https_servers,
    probing_spec,
)


def run_to_the_end(provider: LocalProvider, spec: SandboxSpec, root: Path) -> tuple[str, str]:
    """Provision ``spec``, wait for its end; its output and its proxy's log, once the
    sandbox and its proxy are gone."""
    handle = provider.provision(spec)
    box = root / spec.sandbox_id
    wait_until_final(provider, handle, limit=120)
    output = output_of(provider, handle)
    log = (box / "egress.log").read_text()
    provider.terminate(handle)
    deadline = time.monotonic() + 10
    while proxies_under(box) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert proxies_under(box) == [], "the egress proxy outlived its sandbox"
    return output, log


def test_a_bound_https_host_gets_the_value_and_the_work_sees_only_the_placeholder(
    require_bwrap: str, sandbox_root: Path, make_spec: SpecFactory, tmp_path: Path
) -> None:
    ca = LoopbackCa(tmp_path / "ca")
    provider = LocalProvider({"root_dir": sandbox_root, "isolation": "required"})
    with https_servers(ca, tmp_path / "rogue") as servers:
        spec = probing_spec(provider, make_spec, ca, servers)
        output, log = run_to_the_end(provider, spec, sandbox_root)
    assert_https_outcome(output, log, servers)


def test_an_unreadable_upstream_ca_bundle_fails_the_provision_naming_the_setting(
    require_bwrap: str, sandbox_root: Path, make_spec: SpecFactory, tmp_path: Path
) -> None:
    provider = LocalProvider({"root_dir": sandbox_root, "isolation": "required"})
    (tmp_path / "not-a-ca.pem").write_text("nothing here\n")
    spec = make_spec(
        provider_options={"command": ["true"]},
        egress={
            "allow_network": True,
            "allowed_hosts": ["api.example.com"],
            "secret_bindings": {"TOKEN": {"host": "api.example.com", "value": "v"}},
        },
    )
    for path in (tmp_path / "missing.pem", tmp_path / "not-a-ca.pem"):
        provider.use_egress_upstream_ca(path)
        with pytest.raises(SandboxCreateError, match="CORRAL_EGRESS_UPSTREAM_CA_FILE") as raised:
            provider.provision(spec)
        assert str(tmp_path) not in str(raised.value)  # the deployment's path is not the item's
        assert list(sandbox_root.iterdir()) == [sandbox_root / ".lock"]  # nothing half-made
