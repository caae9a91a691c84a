"""Shared fixtures. A missing service or tool skips a test locally but fails it in CI."""

from __future__ import annotations

import gc
import os
import shutil
import uuid
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import Engine, create_engine, text
from sqlalchemy.engine import make_url

from corral.providers.base import SandboxSpec
from corral.providers.local.disk import unmount_below
from corral.shared.store.db import Database, make_engine
from corral.shared.store.migrate import upgrade

IN_CI = bool(os.environ.get("CI"))
# Dispatch env values are stored sealed with the deployment's key: every process the tests
# start (they inherit this environment) shares this one. Tests of a missing key say so.
TEST_SECRET_KEY = "corral-tests-only-secret-key-0123456789"
os.environ["CORRAL_SECRET_KEY"] = TEST_SECRET_KEY
POSTGRES_URL = os.environ.get(
    "CORRAL_TEST_POSTGRES_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test"
)


# A ResourceWarning raised while the cyclic garbage collector runs is about an object some
# earlier test left in a reference cycle: it lands in whichever test happens to allocate
# then, so as an error it fails an unrelated test by chance. During a collection such
# warnings are shown (pytest's warnings summary), not raised; a resource freed the moment
# its last reference goes (the usual leak, in the test that made it) stays an error.
_DURING_COLLECTION = ("always", None, ResourceWarning, None, 0)


def _collection_warnings(phase: str, info: dict[str, int]) -> None:
    if phase == "start":  # before the first "error" that would take it; an "ignore" stays
        errors = (
            index
            for index, (action, _, category, _, _) in enumerate(warnings.filters)
            if action == "error" and issubclass(ResourceWarning, category)
        )
        warnings.filters.insert(next(errors, 0), _DURING_COLLECTION)
    elif _DURING_COLLECTION in warnings.filters:
        warnings.filters.remove(_DURING_COLLECTION)
    warnings._filters_mutated()  # type: ignore[attr-defined]


gc.callbacks.append(_collection_warnings)


def require(available: bool, what: str) -> None:
    """Skip when ``what`` is missing here; fail in CI, where it must be present."""
    if available:
        return
    if IN_CI:
        pytest.fail(f"{what} is required in CI but is not available")
    pytest.skip(f"{what} is not available")


def require_bwrap_path() -> str:
    path = shutil.which("bwrap")
    require(path is not None, "bubblewrap (apt-get install bubblewrap)")
    assert path is not None
    return path


@pytest.fixture
def require_bwrap() -> str:
    return require_bwrap_path()


@pytest.fixture(scope="session")
def postgres_engine() -> Iterator[Engine]:
    engine = create_engine(POSTGRES_URL)
    try:
        with engine.connect() as connection:
            connection.execute(text("select 1"))
    except Exception:  # any connection failure means: no PostgreSQL here
        engine.dispose()
        require(False, f"PostgreSQL at {POSTGRES_URL}")
    yield engine
    engine.dispose()


@contextmanager
def _database(postgres_engine: Engine, prefix: str, template: str | None = None) -> Iterator[str]:
    """A new database (empty, or a copy of ``template``), dropped afterwards; its name."""
    name = f"{prefix}{uuid.uuid4().hex[:12]}"
    admin = postgres_engine.execution_options(isolation_level="AUTOCOMMIT")
    copy = f' TEMPLATE "{template}"' if template else ""
    with admin.connect() as connection:
        connection.execute(text(f'CREATE DATABASE "{name}"{copy}'))
    try:
        yield name
    finally:
        with admin.connect() as connection:
            connection.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))


def _url(name: str) -> str:
    return make_url(POSTGRES_URL).set(database=name).render_as_string(hide_password=False)


@contextmanager
def database_copy(postgres_engine: Engine, prefix: str, template: str) -> Iterator[str]:
    """A new database copied from ``template``, dropped afterwards; its URL."""
    with _database(postgres_engine, prefix, template) as name:
        yield _url(name)


@pytest.fixture(scope="session")
def postgres_template(postgres_engine: Engine) -> Iterator[str]:
    """A database at the newest schema, copied by the fixtures below (CREATE ... TEMPLATE)."""
    with _database(postgres_engine, "corral_tpl_") as name:
        engine = make_engine(_url(name))
        upgrade(engine)
        engine.dispose()  # a template must have no connections when it is copied
        yield name


@pytest.fixture(scope="session")
def postgres_database_url(postgres_engine: Engine, postgres_template: str) -> Iterator[str]:
    """A PostgreSQL database for this test session, at the newest schema."""
    with database_copy(postgres_engine, "corral_t_", postgres_template) as url:
        yield url


@pytest.fixture
def fresh_pg_url(postgres_engine: Engine, postgres_template: str) -> Iterator[str]:
    """A database of this test's own, at the newest schema: for code that reads every row
    (the reaper), so that other tests' rows cannot change what it sees."""
    with database_copy(postgres_engine, "corral_f_", postgres_template) as url:
        yield url


@pytest.fixture
def pg_db(postgres_database_url: str) -> Iterator[Database]:
    db = Database(make_engine(postgres_database_url))
    yield db
    db.dispose()


@pytest.fixture(scope="session")
def sqlite_template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An SQLite database at the newest schema, migrated once per session."""
    path = tmp_path_factory.mktemp("sqlite-template") / "corral.db"
    engine = make_engine(f"sqlite:///{path}")
    upgrade(engine)
    engine.dispose()
    return path


@pytest.fixture
def sqlite_db(tmp_path: Path, sqlite_template: Path) -> Iterator[Database]:
    """A database of this test's own: a copy of the migrated template (the migration runs
    once, not per test)."""
    path = tmp_path / "corral.db"
    shutil.copyfile(sqlite_template, path)
    db = Database(make_engine(f"sqlite:///{path}"))
    yield db
    db.dispose()


@pytest.fixture(scope="session")
def redis_url() -> str:
    import redis

    url = os.environ.get("CORRAL_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")
    client = redis.Redis.from_url(url)
    try:
        client.ping()
        available = True
    except redis.RedisError:
        available = False
    finally:
        client.close()
    require(available, f"Redis at {url}")
    return url


@dataclass(frozen=True)
class DockerSandbox:
    """A Docker Engine the tests may use, and the sandbox image built on it."""

    url: str
    image: str


@pytest.fixture(scope="session")
def docker_sandbox() -> Iterator[DockerSandbox]:
    """A running engine (started here when none answers) with the sandbox image built; the
    pytest-xdist workers of a run share one, which the last of them stops."""
    import docker

    from tests.docker_engine import ensure_engine, ensure_sandbox_image

    try:
        engine = ensure_engine(install=IN_CI, run_id=os.environ.get("PYTEST_XDIST_TESTRUNUID"))
    except Exception as exc:  # no engine and none could be started
        require(False, f"a Docker Engine ({exc})")
        raise
    client = docker.DockerClient(base_url=engine.url)
    try:
        image = ensure_sandbox_image(client)
        yield DockerSandbox(url=engine.url, image=image)
    finally:
        client.close()
        engine.stop()  # whoever started it: the engine stops once its last user is done


RUNSC = "runsc"


@pytest.fixture(scope="session")
def docker_runsc(docker_sandbox: DockerSandbox) -> DockerSandbox:
    """The Docker Engine, which must have gVisor's runsc registered as the runtime ``runsc``:
    the private engine registers it when runsc is installed (tests/docker_engine.py)."""
    import docker

    client = docker.DockerClient(base_url=docker_sandbox.url)
    try:
        runtimes = client.info().get("Runtimes") or {}
    finally:
        client.close()
    require(
        RUNSC in runtimes,
        f"gVisor's runsc as the Docker Engine's runtime {RUNSC!r} (apt-get install runsc)",
    )
    return docker_sandbox


@pytest.fixture(scope="session")
def e2b_standin() -> Iterator[Any]:
    """The E2B stand-in (tests/standins/e2b.py) on free loopback ports, for the session."""
    from tests.standins.e2b import E2BStandin

    with E2BStandin() as standin:
        yield standin


@pytest.fixture(scope="session")
def vercel_standin() -> Iterator[Any]:
    """The Vercel Sandbox stand-in (tests/standins/vercel.py) on a free loopback port, for the
    session. Its commands run as local processes with this host's PATH."""
    from tests.standins.vercel import VercelStandin

    with VercelStandin() as standin:
        yield standin


@pytest.fixture(scope="session")
def modal_standin() -> Iterator[Any]:
    """The Modal stand-in (tests/standins/modal.py) on a free loopback port, for the session:
    the SDK's own gRPC services; each sandbox's entrypoint and exec'd commands run as local
    processes."""
    from tests.standins.modal import ModalStandin

    with ModalStandin() as standin:
        yield standin


@pytest.fixture(scope="session")
def daytona_standin() -> Iterator[Any]:
    """The Daytona stand-in (tests/standins/daytona.py) on free loopback ports, for the session.
    The commands its sandboxes are given run for real, as local processes."""
    from tests.standins.daytona import DaytonaStandin

    with DaytonaStandin() as standin:
        yield standin


@pytest.fixture(scope="session")
def agentrun_standin() -> Iterator[Any]:
    """The AgentRun data API stand-in (tests/standins/agentrun.py) on a free loopback port."""
    from tests.standins.agentrun import AgentRunStandin

    with AgentRunStandin() as standin:
        yield standin


@pytest.fixture(scope="session")
def kubernetes_standin() -> Iterator[Any]:
    """The Kubernetes API stand-in (tests/standins/kubernetes.py) on a free loopback port, for
    the session. It plays each pod's command (``run_commands``), so a sandbox started with
    ``sh -c "echo ...; exec sleep ..."`` logs and runs, and one with ``exit 3`` fails with 3."""
    from tests.standins.kubernetes import KubernetesStandin

    with KubernetesStandin(namespace="corral", run_commands=True) as standin:
        yield standin


SpecFactory = Callable[..., SandboxSpec]


@pytest.fixture
def make_spec(request: pytest.FixtureRequest) -> SpecFactory:
    """Build SandboxSpecs with unique ids; keyword arguments override any field."""
    counter = iter(range(1_000_000))
    prefix = f"t{abs(hash(request.node.nodeid)) % 10**8:08d}"

    def build(**overrides: Any) -> SandboxSpec:
        number = next(counter)
        fields: dict[str, Any] = {
            "work_item_id": f"wi-{prefix}-{number}",
            "sandbox_id": f"sb-{prefix}-{number}",
            "org_id": "acme",
            "project_id": "web",
            "registration_token": f"crt_test-token-{prefix}-{number}",
            "control_url": "http://127.0.0.1:9",
            "egress": {"allow_network": True},
        }
        fields.update(overrides)
        return SandboxSpec.model_validate(fields)

    return build


@pytest.fixture(scope="session", autouse=True)
def _no_sandbox_disk_outlives_the_session(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[None]:
    """Local sandboxes made under a test's temporary directory and never terminated leave
    their disk images mounted: unmounted at the end, before pytest removes old directories."""
    yield
    unmount_below(tmp_path_factory.getbasetemp())


@pytest.fixture
def sandbox_root(tmp_path: Path) -> Iterator[Path]:
    root = tmp_path / "sandboxes"
    root.mkdir()
    yield root
    # A local sandbox a test did not terminate leaves its disk image mounted: not beyond it.
    unmount_below(root)
