"""Docker provider benchmarks on a real engine (started privately when none is named).

1. provision() → the runner's register call: a stand-in control plane on 127.0.0.1 records
   when the runner inside the container calls ``/v1/runner/register``.
2. The provider's overhead against the raw docker SDK: create + start + wait for the same
   image and command (``true``), in the same run, interleaved; the ratio of the medians.

Usage: python -m bench.docker_overhead [--rounds N] [--smoke]
"""

from __future__ import annotations

import argparse
import http.server
import statistics
import threading
import time
import uuid
from typing import Any

import docker
from pydantic import SecretStr

from bench.harness import WaitTimeoutError, add_smoke_flag, say_smoke, until
from corral.providers.base import Egress, SandboxSpec
from corral.providers.docker.provider import DockerProvider
from tests.docker_engine import ensure_engine, ensure_sandbox_image

REGISTER_TIMEOUT_S = 30.0
EXIT_TIMEOUT_S = 60.0


class _RegisterRecorder(http.server.BaseHTTPRequestHandler):
    arrivals: list[float] = []  # noqa: RUF012 - shared by the handler instances

    def do_POST(self) -> None:
        length = int(self.headers.get("Content-Length", 0))
        self.rfile.read(length)
        _RegisterRecorder.arrivals.append(time.perf_counter())
        self.send_response(401)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *_: Any) -> None:
        return


def spec(sandbox_id: str, port: int, command: list[str] | None) -> SandboxSpec:
    return SandboxSpec(
        work_item_id=f"wi-{sandbox_id}",
        sandbox_id=sandbox_id,
        org_id="bench",
        project_id="bench",
        registration_token=SecretStr("crt_bench"),
        control_url=f"http://127.0.0.1:{port}",
        egress=Egress(allow_network=True),
        provider_options={"command": command} if command else {},
    )


def register_latency(provider: DockerProvider, port: int, rounds: int) -> list[float]:
    """Seconds from provision() being called to the runner's register request arriving."""
    latencies = []
    for _ in range(rounds):
        sandbox_id = f"sb-bench-{uuid.uuid4().hex[:10]}"
        started = time.perf_counter()
        handle = provider.provision(spec(sandbox_id, port, None))
        until(
            lambda: _RegisterRecorder.arrivals,
            f"the runner in {handle.external_id} to call /v1/runner/register",
            REGISTER_TIMEOUT_S,
            poll_s=0.001,
        )
        arrived = _RegisterRecorder.arrivals.pop()
        latencies.append(arrived - started)
        provider.terminate(handle)
    return latencies


def overhead(
    provider: DockerProvider, client: docker.DockerClient, image: str, rounds: int
) -> tuple[list[float], list[float]]:
    """(raw SDK seconds, provider seconds) for create + start + the container exiting."""
    raw, ours = [], []
    for _ in range(rounds):
        started = time.perf_counter()
        container = client.containers.create(
            image, entrypoint=["true"], network_mode="host", detach=True
        )
        container.start()
        _wait_exit(container)
        raw.append(time.perf_counter() - started)
        container.remove(force=True)

        started = time.perf_counter()
        handle = provider.provision(spec(f"sb-bench-{uuid.uuid4().hex[:10]}", 9, ["true"]))
        _wait_exit(client.containers.get(handle.external_id))
        ours.append(time.perf_counter() - started)
        provider.terminate(handle)
    return raw, ours


def _wait_exit(container: Any) -> None:
    """Wait for ``container`` to exit, EXIT_TIMEOUT_S at most."""
    try:
        container.wait(timeout=EXIT_TIMEOUT_S)
    except Exception as error:  # the SDK's read timeout, or the engine gone
        raise WaitTimeoutError(
            f"waited {EXIT_TIMEOUT_S:g} s for container {container.name} to exit: {error}"
        ) from error


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=30)
    add_smoke_flag(parser)
    args = parser.parse_args()
    if args.smoke:
        args.rounds = 1
    say_smoke(args.smoke)
    engine = ensure_engine()
    client = docker.DockerClient(base_url=engine.url)
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _RegisterRecorder)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        image = ensure_sandbox_image(client)
        provider = DockerProvider(
            {
                "base_url": engine.url,
                "image": image,
                "network": "host",
                "grace_period_s": 0,
                "deployment": "bench",
            }
        )
        warmup = provider.provision(spec("sb-bench-warmup", 9, ["true"]))  # first-use costs
        provider.terminate(warmup)
        latencies = register_latency(provider, server.server_address[1], args.rounds)
        raw, ours = overhead(provider, client, image, args.rounds)
    finally:
        server.shutdown()
        server.server_close()
        client.close()
        engine.stop()
    print(
        f"provision() -> register: p50 {1000 * statistics.median(latencies):.0f} ms, "
        f"max {1000 * max(latencies):.0f} ms over {len(latencies)} containers"
    )
    ratio = statistics.median(ours) / statistics.median(raw)
    print(
        f"create+start+exit: raw SDK p50 {1000 * statistics.median(raw):.0f} ms, provider "
        f"p50 {1000 * statistics.median(ours):.0f} ms, ratio {ratio:.2f}x over {len(raw)} rounds"
    )


if __name__ == "__main__":
    main()
