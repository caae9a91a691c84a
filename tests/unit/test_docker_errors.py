"""The docker provider's reading of the engine's errors: the container runtime's failures are
permanent, with the engine's words; the engine's own 5xx trouble is transient. (The answers
below are a real engine's: tests/integration/test_docker_runsc.py meets them for real.)"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import docker.errors
import pytest
import requests

from corral.providers.docker.provider import DockerProvider, engine_trouble, runtime_failure
from corral.providers.errors import (
    ProviderUnavailableError,
    SandboxCreateError,
    SandboxVerificationError,
)
from tests.conftest import SpecFactory

RUNSC_FAILED = (
    "failed to create shim task: OCI runtime create failed: /data/runtimes/runsc did not "
    "terminate successfully: exit status 137: unknown"
)
UNKNOWN_RUNTIME = "Unknown runtime specified nope"  # Docker 20.10, to the create
UNKNOWN_RUNTIME_LATER = "unknown or invalid runtime name: nope"  # later releases
NO_SUCH_COMMAND = (
    "OCI runtime start failed: starting container: starting root container: starting sandbox: "
    "creating process: failed to load /no/such: no such file or directory: unknown"
)
ENGINE_TROUBLE = "write /var/lib/docker/containers/x/config.v2.json: no space left on device"


def api_error(status: int, explanation: str) -> docker.errors.APIError:
    response = requests.Response()
    response.status_code = status
    return docker.errors.APIError("the engine's answer", response=response, explanation=explanation)


@pytest.mark.parametrize(
    ("status", "explanation", "by_runtime", "may_pass"),
    [
        (500, RUNSC_FAILED, True, False),
        (400, UNKNOWN_RUNTIME, True, False),
        (400, UNKNOWN_RUNTIME_LATER, True, False),
        (500, UNKNOWN_RUNTIME_LATER, True, False),
        (400, NO_SUCH_COMMAND, True, False),
        (500, ENGINE_TROUBLE, False, True),
        (503, "Service Unavailable", False, True),
        (404, "No such container: x", False, False),
        (409, "Conflict", False, True),  # the one table: transient
        (429, "Too Many Requests", False, True),
        (401, "Unauthorized", False, True),  # the engine refuses corral: not the caller's
        (400, "bad parameter", False, False),
    ],
)
def test_runtime_failures_are_told_from_the_engines_trouble(
    status: int, explanation: str, by_runtime: bool, may_pass: bool
) -> None:
    error = api_error(status, explanation)
    assert (runtime_failure(error), engine_trouble(error)) == (by_runtime, may_pass)


@dataclass
class FakeContainer:
    name: str
    start_error: Exception | None
    removed: bool = False
    volumes_removed: bool = False

    def start(self) -> None:
        if self.start_error is not None:
            raise self.start_error

    def remove(self, force: bool = False, v: bool = False) -> None:
        self.removed, self.volumes_removed = True, v


@dataclass
class FakeContainers:
    """An engine's containers: ``create`` fails with ``create_error``, else the container
    it makes fails to start with ``start_error``."""

    create_error: Exception | None = None
    start_error: Exception | None = None
    made: dict[str, FakeContainer] = field(default_factory=dict)

    def get(self, name: str) -> FakeContainer:
        if name not in self.made or self.made[name].removed:
            raise docker.errors.NotFound(f"No such container: {name}")
        return self.made[name]

    def create(self, **args: Any) -> FakeContainer:
        if self.create_error is not None:
            raise self.create_error
        self.made[args["name"]] = FakeContainer(args["name"], self.start_error)
        return self.made[args["name"]]


@dataclass
class FakeImage:
    attrs: dict[str, Any]


class FakeImages:
    """Every image runs as corral's sandbox user, as corral-sandbox does."""

    def get(self, name: str) -> FakeImage:
        return FakeImage({"Config": {"User": "10001:10001"}})


@dataclass
class FakeClient:
    containers: FakeContainers
    images: FakeImages = field(default_factory=FakeImages)


def provider_on(containers: FakeContainers, runtime: str | None = "runsc") -> DockerProvider:
    provider = DockerProvider({"runtime": runtime})
    provider._client = FakeClient(containers)  # type: ignore[assignment]
    return provider


def test_runsc_failing_to_start_the_container_is_permanent_and_removes_it(
    make_spec: SpecFactory,
) -> None:
    containers = FakeContainers(start_error=api_error(500, RUNSC_FAILED))
    with pytest.raises(SandboxVerificationError) as raised:
        provider_on(containers).provision(make_spec())
    assert raised.value.message.endswith(f"did not start: {RUNSC_FAILED}")
    assert not raised.value.retryable
    assert [c.removed for c in containers.made.values()] == [True]


def test_an_unknown_runtime_is_permanent_and_says_what_to_do(make_spec: SpecFactory) -> None:
    containers = FakeContainers(create_error=api_error(400, UNKNOWN_RUNTIME))
    with pytest.raises(SandboxCreateError) as raised:
        provider_on(containers, runtime="nope").provision(make_spec())
    assert raised.value.message == (
        f"the Docker Engine refused the container: {UNKNOWN_RUNTIME} (the docker provider's "
        "runtime is 'nope': register it with the engine, in daemon.json \"runtimes\", or "
        "change the runtime)"
    )
    assert not raised.value.retryable


@pytest.mark.parametrize("when", ["create", "start"])
def test_the_engines_own_trouble_is_transient(when: str, make_spec: SpecFactory) -> None:
    trouble = api_error(500, ENGINE_TROUBLE)
    containers = FakeContainers(**{f"{when}_error": trouble})
    with pytest.raises(ProviderUnavailableError, match="no space left on device") as raised:
        provider_on(containers).provision(make_spec())
    assert raised.value.retryable
    assert all(c.removed for c in containers.made.values())


def test_the_runtime_goes_to_the_create_and_none_leaves_the_engines_default(
    make_spec: SpecFactory,
) -> None:
    spec = make_spec()
    for runtime, expected in (("runsc", {"runtime": "runsc"}), (None, {})):
        provider = DockerProvider({"runtime": runtime})
        provider._client = FakeClient(FakeContainers())  # type: ignore[assignment]
        args = provider._create_args(spec, provider.parse_options(spec), "image")  # type: ignore[arg-type]
        assert {k: v for k, v in args.items() if k == "runtime"} == expected
