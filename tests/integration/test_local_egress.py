"""Enforced egress on the local provider, with real bubblewrap: the sandbox's only way out
is corral's egress proxy, which lets through the allowed hosts alone, logs what it refuses,
substitutes a secret binding the sandbox never sees, and ends with the sandbox."""

from __future__ import annotations

import json
import time
from pathlib import Path

from corral.providers.base import SecretBinding
from corral.providers.local.provider import LocalProvider
from tests.conftest import SpecFactory
from tests.egress_probe import PROBE, proxies_under, recording_server
from tests.integration.test_local_provider import output_of, wait_until_final

SECRET = "sk-bound-local-never-in-the-sandbox"


def test_only_the_allowed_host_is_reached_and_the_binding_is_substituted_outside(
    require_bwrap: str, sandbox_root: Path, make_spec: SpecFactory
) -> None:
    provider = LocalProvider({"root_dir": sandbox_root, "isolation": "required"})
    with recording_server() as (port_a, seen_a), recording_server() as (port_b, seen_b):
        allowed = f"127.0.0.1:{port_a}"
        # Loopback is closed to every sandbox unless the deployment opens it.
        provider.use_egress_openings((allowed, f"127.0.0.1:{port_b}"))
        command = [
            "python3",
            "-c",
            PROBE,
            f"http://{allowed}/a",
            f"http://127.0.0.1:{port_b}/b",
            str(port_a),
        ]
        spec = make_spec(
            provider_options={"command": command},
            egress={
                "allow_network": True,
                "allowed_hosts": [allowed],
                "secret_bindings": {
                    "API_TOKEN": {"host": allowed, "value": SECRET, "header": "Authorization"}
                },
            },
        )
        handle = provider.provision(spec)
        box = sandbox_root / spec.sandbox_id
        assert proxies_under(box), "no egress proxy runs for the sandbox"
        wait_until_final(provider, handle, limit=30)
        output = output_of(provider, handle)
        refusals = (box / "egress.log").read_text()
        work_files = [p.read_bytes() for p in (box / "work").rglob("*") if p.is_file()]
        provider.terminate(handle)
        deadline = time.monotonic() + 10
        while proxies_under(box) and time.monotonic() < deadline:
            time.sleep(0.02)

    assert "A=200 hello from the host" in output, output
    assert "B=403" in output, output
    assert "direct=refused" in output  # no network of its own: only the proxy
    assert [path for path, _ in seen_a] == ["/a"] and seen_b == []
    assert seen_a[0][1]["Authorization"] == f"Bearer {SECRET}"
    refused = [json.loads(line) for line in refusals.splitlines()]
    assert {"event": "egress_refused", "host": "127.0.0.1", "port": port_b}.items() <= {
        **next(r for r in refused if r["event"] == "egress_refused")
    }.items()
    placeholder = SecretBinding.placeholder_for("API_TOKEN")
    assert f'"API_TOKEN": "{placeholder}"' in output
    assert SECRET not in output and SECRET not in refusals
    assert all(SECRET.encode() not in content for content in work_files)
    assert proxies_under(box) == [], "the egress proxy outlived its sandbox"


def test_terminating_a_running_sandbox_ends_its_proxy(
    require_bwrap: str, sandbox_root: Path, make_spec: SpecFactory
) -> None:
    provider = LocalProvider({"root_dir": sandbox_root, "isolation": "required"})
    spec = make_spec(
        provider_options={"command": ["sleep", "60"]},
        egress={"allow_network": True, "allowed_hosts": ["pypi.org:443"]},
    )
    handle = provider.provision(spec)
    box = sandbox_root / spec.sandbox_id
    assert proxies_under(box)
    provider.terminate(handle)
    deadline = time.monotonic() + 10
    while proxies_under(box) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert proxies_under(box) == []


def test_allowed_hosts_without_isolation_are_refused(
    sandbox_root: Path, make_spec: SpecFactory
) -> None:
    provider = LocalProvider({"root_dir": sandbox_root, "isolation": "off"})
    spec = make_spec(
        provider_options={"command": ["true"]},
        egress={"allow_network": True, "allowed_hosts": ["pypi.org"]},
    )
    try:
        provider.provision(spec)
    except Exception as error:
        assert "allowed_hosts needs bubblewrap" in str(error)
    else:
        raise AssertionError("provisioned allowed_hosts without isolation")
