"""The docker provider with gVisor's runsc as its runtime, on the test engine (which has runsc
registered when it is installed: tests/docker_engine.py), and a runtime's failures: permanent,
with the engine's words, never retried."""

from __future__ import annotations

import re
import shutil
import socket
import tempfile
import threading
import uuid
from collections.abc import Iterator
from contextlib import suppress
from pathlib import Path

import docker
import pytest
from sqlalchemy import select

from corral.providers.docker.provider import DockerProvider, container_name
from corral.providers.errors import SandboxCreateError, SandboxVerificationError
from corral.scheduler.admin.pools import ProfileCreate, create_profile
from corral.scheduler.intake import accept, route_item
from corral.shared.messages import DispatchRequest
from corral.shared.runtime import Runtime
from corral.shared.settings import CoreSettings
from corral.shared.store.db import Database
from corral.shared.store.models import AuthMode, ItemState, Pool, Sandbox, WorkItem
from corral.worker.provision import Outcome, provision_item
from tests.conftest import RUNSC, DockerSandbox, SpecFactory

SLEEP = {"command": ["sh", "-c", "echo up; exec sleep 300"]}
UNKNOWN_RUNTIME = "corral-no-such-runtime"
# The engine's words for a runtime it does not have (Docker 20.10; later releases).
UNKNOWN_RUNTIME_WORDS = re.compile(r"Unknown runtime specified|unknown or invalid runtime name")
GREETING = "corral-api-here"
# What the runner does first: connect to the api's socket (and here, read one line).
CONNECT = (
    "import socket, sys; s = socket.socket(socket.AF_UNIX); s.settimeout(10); "
    "s.connect(sys.argv[1]); print(s.makefile().readline().strip())"
)
SERVE_TIMEOUT_S = 30.0


def _provider(url: str, image: str, runtime: str) -> DockerProvider:
    return DockerProvider(
        {
            "base_url": url,
            "image": image,
            "runtime": runtime,
            "network": "none",
            "grace_period_s": 1,
            "deployment": f"rs-{uuid.uuid4().hex[:10]}",
        }
    )


@pytest.fixture
def runsc_provider(docker_runsc: DockerSandbox) -> Iterator[DockerProvider]:
    built = _provider(docker_runsc.url, docker_runsc.image, RUNSC)
    yield built
    for managed in built.list_managed():
        built.terminate(managed.handle)


@pytest.fixture
def engine(docker_sandbox: DockerSandbox) -> Iterator[docker.DockerClient]:
    client = docker.DockerClient(base_url=docker_sandbox.url)
    yield client
    client.close()


@pytest.fixture
def api_socket() -> Iterator[Path]:
    """A Unix socket standing in for the api's: it greets every connection with a line.

    In a directory of its own with a short path (sun_path), readable by the sandbox's user,
    as the api's socket directory is."""
    folder = Path(tempfile.mkdtemp(prefix="corral-uds-", dir="/tmp"))
    folder.chmod(0o755)
    path = folder / "api.sock"
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(str(path))
    path.chmod(0o666)
    server.listen()
    server.settimeout(SERVE_TIMEOUT_S)  # the thread ends by this deadline at the latest
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            try:
                connection, _ = server.accept()
            except OSError:  # closed, or no one came in time
                return
            with connection, suppress(OSError):  # a peer gone already (the wake-up's)
                connection.sendall(f"{GREETING}\n".encode())

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield path
    finally:
        stop.set()
        with suppress(OSError), socket.socket(socket.AF_UNIX) as wake:
            wake.connect(str(path))  # wakes the accept, which then sees the stop
        thread.join(timeout=SERVE_TIMEOUT_S)
        server.close()
        shutil.rmtree(folder, ignore_errors=True)


def test_a_sandbox_without_network_reaches_the_api_socket_under_runsc(
    runsc_provider: DockerProvider,
    engine: docker.DockerClient,
    make_spec: SpecFactory,
    api_socket: Path,
) -> None:
    spec = make_spec(
        provider_options=SLEEP, egress={"allow_network": False}, control_url=f"unix://{api_socket}"
    )
    handle = runsc_provider.provision(spec)
    host = engine.containers.get(handle.external_id).attrs["HostConfig"]
    assert (host["Runtime"], host["NetworkMode"]) == (RUNSC, "none")
    assert host["Binds"] == [f"{api_socket.parent}:{api_socket.parent}:ro"]
    kernel = runsc_provider.exec_command(handle, ["dmesg"])
    assert "gVisor" in kernel.stdout, kernel  # the sandbox's kernel is gVisor's

    # runsc lets the sandbox connect to a host socket only with --host-uds=open.
    reply = runsc_provider.exec_command(handle, ["python3", "-c", CONNECT, str(api_socket)])
    assert (reply.exit_code, reply.stdout, reply.stderr) == (0, f"{GREETING}\n", "")


def test_an_unknown_runtime_fails_permanently_with_the_engines_message(
    docker_sandbox: DockerSandbox, engine: docker.DockerClient, make_spec: SpecFactory
) -> None:
    provider = _provider(docker_sandbox.url, docker_sandbox.image, UNKNOWN_RUNTIME)
    spec = make_spec(provider_options=SLEEP)
    with pytest.raises(SandboxCreateError) as raised:
        provider.provision(spec)
    message = raised.value.message
    assert UNKNOWN_RUNTIME_WORDS.search(message), message
    assert f"runtime is '{UNKNOWN_RUNTIME}': register it with the engine" in message
    assert not raised.value.retryable
    assert engine.containers.list(all=True, filters={"name": container_name(spec.sandbox_id)}) == []

    health = provider.health_check()
    assert not health.healthy
    assert f"has no runtime '{UNKNOWN_RUNTIME}' registered" in health.message


def test_runsc_failing_to_start_the_container_is_permanent_and_leaves_nothing(
    runsc_provider: DockerProvider, engine: docker.DockerClient, make_spec: SpecFactory
) -> None:
    # 6 MB, the engine's least: too little for runsc itself, which is killed while it
    # creates the sandbox (runc starts such a container).
    spec = make_spec(provider_options=SLEEP, resources={"memory_mb": 6})
    with pytest.raises(SandboxVerificationError) as raised:
        runsc_provider.provision(spec)
    assert "OCI runtime create failed" in raised.value.message
    assert not raised.value.retryable
    assert engine.containers.list(all=True, filters={"name": container_name(spec.sandbox_id)}) == []


@pytest.fixture
def rt(sqlite_db: Database, docker_sandbox: DockerSandbox, tmp_path: Path) -> Runtime:
    """corral.provision's runtime, with a docker provider whose runtime the engine lacks."""
    runtime = Runtime(settings=CoreSettings(state_dir=tmp_path), db=sqlite_db)
    runtime.use_provider(_provider(docker_sandbox.url, docker_sandbox.image, UNKNOWN_RUNTIME))
    create_profile(sqlite_db, ProfileCreate(name="default", model="m", auth_mode=AuthMode.BYOK))
    with sqlite_db.session() as session:
        session.add(
            Pool(id="pool-dk", org_id="acme", name="dk", provider_id="docker", max_concurrent=4)
        )
    return runtime


def test_a_provision_with_an_unknown_runtime_fails_its_item_at_once(rt: Runtime) -> None:
    work = {"kind": "shell", "command": "echo hi"}
    request = DispatchRequest.model_validate(
        {"org": "acme", "project": "web", "profile": "default", "work": work}
    )
    item_id = accept(rt.db, request, actor="test").item_id
    assert (
        route_item(rt.db, item_id, actor="test", settings=rt.settings).queue == "provision.docker"
    )

    # Not RetryLater: the provision task does not retry it; its one pool failed it, so
    # routing finds no other to fail over to.
    assert provision_item(rt, item_id, actor="test") is Outcome.FAILED_OVER
    assert route_item(rt.db, item_id, actor="test", settings=rt.settings).state is ItemState.FAILED

    with rt.db.session() as session:
        item = session.get(WorkItem, item_id)
        assert item is not None
        sandboxes = list(session.scalars(select(Sandbox).where(Sandbox.work_item_id == item_id)))
        assert (item.state, item.error_code, len(sandboxes)) == (
            ItemState.FAILED.value,
            "create_failed",
            1,
        )
        assert UNKNOWN_RUNTIME_WORDS.search(item.error_message or ""), item.error_message
