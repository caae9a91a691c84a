"""A docker sandbox holds no capabilities and cannot gain privileges, on the test engine,
under runc and under gVisor's runsc: ``CapEff`` is zero and ``NoNewPrivs`` set, a set-uid
root binary in the chosen image runs as the sandbox's user, and a fork bomb stops at the
configured pids limit."""

from __future__ import annotations

import io
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import docker
import docker.errors
import pytest

from corral.providers.base import SandboxHandle, SandboxState
from corral.providers.docker.provider import DockerProvider
from tests.conftest import RUNSC, DockerSandbox, SpecFactory

SLEEP = {"command": ["sh", "-c", "exec sleep 300"]}
SETUID_TAG = "corral-sandbox-setuid:test"
# The sandbox image with a set-uid-root copy of python3: what a tenant's chosen image may hold.
SETUID_RECIPE = """\
FROM {base}
USER 0
RUN cp "$(readlink -f /usr/bin/python3)" /usr/local/bin/rootpython \\
    && chown 0:0 /usr/local/bin/rootpython && chmod 4755 /usr/local/bin/rootpython
USER 10001:10001
"""
SETUID_MODE = (
    "import os, stat; s = os.stat('/usr/local/bin/rootpython'); "
    "print(oct(stat.S_IMODE(s.st_mode)), s.st_uid)"
)
EFFECTIVE_UID = "import os; print(os.geteuid(), os.getuid())"
PIDS_LIMIT = 48
FORK_CAP = 400  # far past the limit; bounded, so a missing limit cannot hurt the host
BOMB_TIMEOUT_S = 60.0
FINAL = (SandboxState.TERMINATED, SandboxState.FAILED)
# Forks children that wait on a pipe (they end with it, whatever happens to the parent)
# until a fork fails: prints how many it made and the failure's errno name.
FORK_BOMB = f"""
import errno, os
read_end, write_end = os.pipe()
made, failure = 0, "none"
for _ in range({FORK_CAP}):
    try:
        pid = os.fork()
    except OSError as exc:
        failure = errno.errorcode.get(exc.errno, str(exc.errno))
        break
    if pid == 0:
        os.close(write_end)
        os.read(read_end, 1)
        os._exit(0)
    made += 1
print(made, failure)
"""
BOMB_COMMAND = ["python3", "-c", FORK_BOMB]


@pytest.fixture(params=["runc", RUNSC])
def engine_for(request: pytest.FixtureRequest) -> Iterator[tuple[DockerSandbox, str | None]]:
    """The test engine and the runtime to use: its default (runc), then runsc."""
    if request.param == RUNSC:
        yield request.getfixturevalue("docker_runsc"), RUNSC
    else:
        yield request.getfixturevalue("docker_sandbox"), None


ProviderFactory = Callable[..., DockerProvider]


@pytest.fixture
def make_provider(engine_for: tuple[DockerSandbox, str | None]) -> Iterator[ProviderFactory]:
    """Docker providers on the engine and runtime of ``engine_for``, with config changes;
    their containers are removed after the test."""
    sandbox, runtime = engine_for
    made: list[DockerProvider] = []

    def make(**config: Any) -> DockerProvider:
        built = DockerProvider(
            {
                "base_url": sandbox.url,
                "image": sandbox.image,
                "network": "none",
                "grace_period_s": 1,
                "deployment": f"cf-{uuid.uuid4().hex[:10]}",
                **({"runtime": runtime} if runtime else {}),
                **config,
            }
        )
        made.append(built)
        return built

    yield make
    for built in made:
        for managed in built.list_managed():
            built.terminate(managed.handle)


@pytest.fixture(scope="module")
def setuid_image(docker_sandbox: DockerSandbox) -> str:
    """The sandbox image with a set-uid-root python3 at /usr/local/bin/rootpython."""
    client = docker.DockerClient(base_url=docker_sandbox.url)
    try:
        recipe = SETUID_RECIPE.format(base=docker_sandbox.image).encode()
        client.images.build(
            fileobj=io.BytesIO(recipe), tag=SETUID_TAG, network_mode="none", pull=False, rm=True
        )
    finally:
        client.close()
    return SETUID_TAG


def _status_fields(provider: DockerProvider, handle: SandboxHandle, pid: str, **exec: Any) -> Any:
    probe = provider.exec_command(handle, ["cat", f"/proc/{pid}/status"], **exec)
    assert probe.exit_code == 0, probe
    fields = dict(line.split(":", 1) for line in probe.stdout.splitlines() if ":" in line)
    return {name: value.strip() for name, value in fields.items()}


def test_the_sandbox_holds_no_capability_and_may_gain_no_privilege(
    make_provider: ProviderFactory, make_spec: SpecFactory
) -> None:
    provider = make_provider()
    handle = provider.provision(make_spec(provider_options=SLEEP))
    # The container's own process, a command run in it, and one run in it as root.
    for pid, user in (("1", None), ("self", None), ("self", "0")):
        fields = _status_fields(provider, handle, pid, user=user)
        assert fields["CapEff"] == "0000000000000000", (pid, user, fields)
        assert fields["CapPrm"] == "0000000000000000", (pid, user, fields)
        assert fields["CapBnd"] == "0000000000000000", (pid, user, fields)  # none to regain
        if "NoNewPrivs" in fields:  # gVisor's /proc (Debian 12's runsc) does not show it
            assert fields["NoNewPrivs"] == "1", (pid, user, fields)


def test_a_set_uid_root_binary_in_the_image_runs_as_the_sandbox_user(
    make_provider: ProviderFactory, setuid_image: str, make_spec: SpecFactory
) -> None:
    provider = make_provider(image=setuid_image)
    handle = provider.provision(make_spec(provider_options=SLEEP))
    mode = provider.exec_command(handle, ["python3", "-c", SETUID_MODE])
    assert mode.stdout.split() == ["0o4755", "0"], mode  # set-uid root, as built
    probe = provider.exec_command(handle, ["/usr/local/bin/rootpython", "-c", EFFECTIVE_UID])
    assert probe.stdout.split() == ["10001", "10001"], probe  # not 0: no new privileges


def test_a_fork_bomb_stops_at_the_pids_limit(
    make_provider: ProviderFactory, make_spec: SpecFactory
) -> None:
    provider = make_provider(pids_limit=PIDS_LIMIT)
    # The container's own command: an exec's stream outlives a runsc sandbox that died.
    handle = provider.provision(make_spec(provider_options={"command": BOMB_COMMAND}))
    deadline = time.monotonic() + BOMB_TIMEOUT_S
    status = provider.status(handle)
    while status.state not in FINAL and time.monotonic() < deadline:
        time.sleep(0.1)
        status = provider.status(handle)
    assert status.state in FINAL, status
    said = list(provider.stream_logs(handle))
    if status.state is SandboxState.TERMINATED:  # runc: the fork failed, the bomb stopped
        made, failure = said[-1].split()
        assert failure == "EAGAIN", said
        assert 0 < int(made) < PIDS_LIMIT, said  # python3 holds one of them
    else:  # runsc (this release) ends the whole sandbox at the limit: stopped all the same
        assert status.reason == "exited with code 2", status
        assert not said, said
