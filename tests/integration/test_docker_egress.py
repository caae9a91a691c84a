"""Enforced egress on the docker provider, on the private Docker Engine: the container has
no network (network mode none) and corral's egress proxy, a host process, is its only way
out, through a mounted Unix socket; it ends when the sandbox is terminated."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from corral.providers.base import SandboxState, SecretBinding
from corral.providers.docker.provider import DockerProvider
from tests.conftest import DockerSandbox, SpecFactory
from tests.egress_probe import PROBE, proxies_under, recording_server
from tests.tls_servers import (
    LoopbackCa,
    assert_https_outcome,
    https_servers,
    probing_spec,
)

SECRET = "sk-bound-docker-never-in-the-sandbox"


@pytest.fixture
def provider(docker_sandbox: DockerSandbox, tmp_path: Path) -> Iterator[DockerProvider]:
    built = DockerProvider(
        {
            "base_url": docker_sandbox.url,
            "image": docker_sandbox.image,
            "network": "host",  # what allowed_hosts must not fall back to
            "grace_period_s": 1,
            "deployment": f"it-{uuid.uuid4().hex[:10]}",
        }
    )
    built.use_state_dir(tmp_path / "state")
    yield built
    for managed in built.list_managed():
        built.terminate(managed.handle)


def _wait_final(provider: DockerProvider, handle: object, limit: float = 60) -> None:
    deadline = time.monotonic() + limit
    while not provider.status(handle).state.is_final:  # type: ignore[arg-type]
        assert time.monotonic() < deadline, "the container did not finish in time"
        time.sleep(0.1)


def test_only_the_allowed_host_is_reached_and_the_proxy_ends_with_the_container(
    provider: DockerProvider, make_spec: SpecFactory, tmp_path: Path
) -> None:
    with recording_server() as (port_a, seen_a), recording_server() as (port_b, seen_b):
        allowed = f"127.0.0.1:{port_a}"
        # Loopback is closed to every sandbox unless the deployment opens it.
        provider.use_egress_openings((allowed, f"127.0.0.1:{port_b}"))
        probe = [f"http://{allowed}/a", f"http://127.0.0.1:{port_b}/b", str(port_a)]
        spec = make_spec(
            provider_options={"command": ["python3", "-c", PROBE, *probe]},
            egress={
                "allow_network": True,
                "allowed_hosts": [allowed],
                "secret_bindings": {"API_TOKEN": {"host": allowed, "value": SECRET}},
            },
        )
        handle = provider.provision(spec)
        assert proxies_under(tmp_path / "state"), "no egress proxy runs for the container"
        _wait_final(provider, handle)
        assert provider.status(handle).state is SandboxState.TERMINATED
        output = "\n".join(provider.stream_logs(handle))
        refusals = provider._egress.log(handle.external_id)
        provider.terminate(handle)
        deadline = time.monotonic() + 10
        while proxies_under(tmp_path / "state") and time.monotonic() < deadline:
            time.sleep(0.02)

    assert "A=200 hello from the host" in output, output
    assert "B=403" in output, output
    assert "direct=refused" in output  # network mode none, though the pool says host
    assert [path for path, _ in seen_a] == ["/a"] and seen_b == []
    assert seen_a[0][1]["Authorization"] == f"Bearer {SECRET}"
    refused = [json.loads(line) for line in refusals.splitlines()]
    assert any(
        r["event"] == "egress_refused" and r["host"] == "127.0.0.1" and r["port"] == port_b
        for r in refused
    ), refusals
    assert f'"API_TOKEN": "{SecretBinding.placeholder_for("API_TOKEN")}"' in output
    assert SECRET not in output and SECRET not in refusals
    assert proxies_under(tmp_path / "state") == [], "the egress proxy outlived its container"


def test_allowed_hosts_naming_the_broker_or_the_database_do_not_reach_them(
    provider: DockerProvider, make_spec: SpecFactory
) -> None:
    # The proxy runs on the host, where Redis and PostgreSQL listen: naming them in
    # allowed_hosts (or all of IPv4) must not open them, whatever the container asks.
    targets = ["127.0.0.1:6379", "127.0.0.1:5432", "localhost:6379"]
    probe = [*(f"http://{target}/" for target in targets[:2]), "6379"]
    spec = make_spec(
        provider_options={"command": ["python3", "-c", PROBE, *probe]},
        egress={"allow_network": True, "allowed_hosts": [*targets, "0.0.0.0/0"]},
    )
    handle = provider.provision(spec)
    _wait_final(provider, handle)
    output = "\n".join(provider.stream_logs(handle))
    refusals = provider._egress.log(handle.external_id)
    provider.terminate(handle)
    assert "A=403" in output and "B=403" in output, output
    assert "direct=refused" in output
    assert '"closed address"' in refusals


def test_a_bound_https_host_gets_the_value_and_the_container_sees_only_the_placeholder(
    provider: DockerProvider, make_spec: SpecFactory, tmp_path: Path
) -> None:
    ca = LoopbackCa(tmp_path / "ca")
    with https_servers(ca, tmp_path / "rogue") as servers:
        handle = provider.provision(probing_spec(provider, make_spec, ca, servers))
        _wait_final(provider, handle, limit=120)
        output = "\n".join(provider.stream_logs(handle))
        log = provider._egress.log(handle.external_id)
        provider.terminate(handle)
    assert_https_outcome(output, log, servers)
