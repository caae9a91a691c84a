"""What the docker provider leaves on its engine's disk: of a container's output,
``max_log_mb`` in json-file's two rotated files (or the engine's own choice); of the
anonymous volumes of its image's VOLUMEs, nothing once it is removed."""

from __future__ import annotations

from corral.providers.docker.provider import DockerProvider
from tests.conftest import SpecFactory
from tests.unit.test_docker_errors import FakeClient, FakeContainers


def _log_config(make_spec: SpecFactory, **config: object) -> object:
    provider = DockerProvider(config)
    provider._client = FakeClient(FakeContainers())  # type: ignore[assignment]  # no engine
    spec = make_spec()
    options = provider.parse_options(spec)
    args = provider._create_args(spec, options, "image")  # type: ignore[arg-type]  # its options
    return args.get("log_config")


def test_a_containers_log_is_bounded_by_default_and_by_the_deployments_setting(
    make_spec: SpecFactory,
) -> None:
    assert _log_config(make_spec) == {
        "type": "json-file",
        "config": {"max-size": "32768k", "max-file": "2"},
    }
    assert _log_config(make_spec, max_log_mb=1) == {
        "type": "json-file",
        "config": {"max-size": "512k", "max-file": "2"},
    }


def test_null_leaves_the_engines_own_log_driver(make_spec: SpecFactory) -> None:
    assert _log_config(make_spec, max_log_mb=None) is None


def test_a_removed_container_takes_its_anonymous_volumes_with_it() -> None:
    containers = FakeContainers()
    containers.create(name="corral-sb-1")
    provider = DockerProvider({})
    provider._client = FakeClient(containers)  # type: ignore[assignment]  # no engine
    provider._remove("corral-sb-1")
    assert containers.made["corral-sb-1"].volumes_removed
