"""corral installs one top-level name, ``corral``.

The folders ``shared/``, ``scheduler/``, ``worker/``, ``providers/`` and ``runner/`` sit at
the repository's root and are packages only as ``corral.<name>``, through the symlinks
``corral/<name> -> ../<name>``; PyPI has packages called ``shared``, ``scheduler``,
``providers`` and ``worker``, which must not be able to replace them. The runner also runs
inside sandboxes as the top-level package ``runner``, so it imports the standard library and
itself (relatively) only.
"""

from __future__ import annotations

import ast
import importlib.util
import json
import os
import subprocess
import sys
import tomllib
from collections.abc import Iterable, Iterator
from importlib import metadata
from pathlib import Path

from packaging.requirements import Requirement
from typer.testing import CliRunner

from corral.cli.app import app

ROOT = Path(__file__).resolve().parents[2]
FOLDERS = ("shared", "scheduler", "worker", "providers", "runner")
# Every folder whose Python files may import corral's packages.
SOURCES = ("corral", *FOLDERS, "tests", "bench")


def python_files(*folders: str) -> Iterator[Path]:
    """Each file once, under its real path (corral/'s symlinks are not walked)."""
    for folder in folders:
        for directory, subdirectories, files in os.walk(ROOT / folder):
            subdirectories[:] = [
                name for name in subdirectories if not Path(directory, name).is_symlink()
            ]
            for name in files:
                if name.endswith(".py"):
                    yield Path(directory, name)


def imported_modules(path: Path) -> Iterator[tuple[int, str]]:
    """(line, module) for every absolute import in ``path``."""
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            yield node.lineno, node.module


def test_corral_links_each_folder_relatively() -> None:
    for name in FOLDERS:
        link = ROOT / "corral" / name
        assert link.is_symlink(), link
        assert os.readlink(link) == f"../{name}"
        assert (link / "__init__.py").is_file()


def test_nothing_imports_the_folders_as_top_level_packages() -> None:
    found = [
        f"{path.relative_to(ROOT)}:{line}: {module}"
        for path in python_files(*SOURCES)
        for line, module in imported_modules(path)
        if module.split(".")[0] in FOLDERS
    ]
    assert found == []


def test_the_runner_imports_the_standard_library_and_itself_only() -> None:
    allowed = set(sys.stdlib_module_names) | {"__future__"}
    found = [
        f"{path.relative_to(ROOT)}:{line}: {module}"
        for path in python_files("runner")
        for line, module in imported_modules(path)
        if module.split(".")[0] not in allowed
    ]
    assert found == []


def test_the_distribution_packages_corral_alone_with_its_data() -> None:
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert setuptools["packages"]["find"]["include"] == ["corral*"]
    data = setuptools["package-data"]
    assert "py.typed" in data["corral"]
    assert (ROOT / "corral" / "py.typed").is_file()
    for pattern in data["corral.shared"]:
        assert (ROOT / "shared" / pattern).is_file(), pattern


def test_the_installed_corral_exposes_no_other_top_level_name(tmp_path: Path) -> None:
    """Run away from the checkout, so that only the install decides what is importable."""
    probe = (
        "import importlib.util, json; "
        f"print(json.dumps({{n: getattr(importlib.util.find_spec(n), 'origin', None) "
        f"for n in {FOLDERS!r}}}))"
    )
    env = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
    result = subprocess.run(
        [sys.executable, "-c", probe],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    origins = json.loads(result.stdout)
    # A package of that name from elsewhere (PyPI's) may be installed; never one of corral's.
    assert [name for name, origin in origins.items() if origin and str(ROOT) in origin] == []
    spec = importlib.util.find_spec("corral.providers")
    assert spec is not None and spec.origin is not None
    assert Path(spec.origin).resolve() == ROOT / "providers" / "__init__.py"


def test_version_option_prints_the_installed_version() -> None:
    from importlib.metadata import version

    result = CliRunner().invoke(app, ["--version"])
    assert result.exit_code == 0, result.output
    assert result.output.strip() == f"corral {version('corral')}"


# What a file may import beyond the base install: a provider's SDK (its extra), boto3 for the
# S3 bundle store. The egress proxy's siblings (http1, tls) and the supervisor's are files
# beside them, run as scripts in a sandbox.
EXTRAS_OF = {
    "providers/docker/": "docker",
    "providers/kubernetes/": "kubernetes",
    "providers/e2b.py": "e2b",
    "providers/vercel.py": "vercel",
    "providers/modal.py": "modal",
    "providers/daytona/": "daytona",
    "providers/agentrun.py": "agentrun",
    "shared/store/bundle_store.py": "s3",
}


def distributions(requirements: Iterable[str], extras: Iterable[str] = ()) -> set[str]:
    """The installed distributions ``requirements`` (with ``extras`` of the first) bring,
    dependencies of dependencies included, by canonical name."""
    seen: set[tuple[str, frozenset[str]]] = set()
    todo = [(Requirement(text), set(extras)) for text in requirements]
    while todo:
        requirement, wanted = todo.pop()
        if requirement.marker and not any(
            requirement.marker.evaluate({"extra": extra}) for extra in wanted | {""}
        ):
            continue
        name = requirement.name.lower().replace("_", "-")
        if (name, frozenset(requirement.extras)) in seen:
            continue
        seen.add((name, frozenset(requirement.extras)))
        needs = metadata.requires(requirement.name) or []
        todo += [(Requirement(text), set(requirement.extras)) for text in needs]
    return {name for name, _ in seen}


def test_the_base_install_holds_every_module_corral_imports_outside_the_extras() -> None:
    """`make run` installs corral without extras: its commands, api, client and the local
    provider import nothing more (a provider's SDK or boto3 only where their extra says)."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    base = project["dependencies"]
    owners = metadata.packages_distributions()
    missing = []
    for path in python_files("corral", *FOLDERS[:-1]):
        where = str(path.relative_to(ROOT))
        extra = next((e for prefix, e in EXTRAS_OF.items() if where.startswith(prefix)), None)
        extras = project["optional-dependencies"][extra] if extra else []
        allowed = distributions([*base, *extras])
        for line, module in imported_modules(path):
            top = module.split(".")[0]
            if top in sys.stdlib_module_names or top in ("__future__", "corral"):
                continue
            if (path.parent / f"{top}.py").is_file():  # a script's sibling
                continue
            names = {name.lower().replace("_", "-") for name in owners.get(top, [top])}
            if not names & allowed:
                missing.append(f"{where}:{line}: {module}")
    assert missing == []
