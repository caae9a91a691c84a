"""corral's packages form a line, each importing only the ones below it
(docs/architecture.md §9):

    runner  <  providers  <  shared  <  scheduler  <  worker  <  corral (the CLI)

``runner`` stands alone (standard library only). ``corral.shared.errors`` (the one exception
root), ``corral.shared.text`` (identifier patterns) and ``corral.shared.keyring`` (sealing
at rest) are foundation modules every layer may use; they import nothing of corral but one
another. No import points up, and the test keeps it so.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
LAYERS = {"runner": 0, "providers": 1, "shared": 2, "scheduler": 3, "worker": 4, "corral": 5}
FOUNDATION = {"corral.shared.errors", "corral.shared.text", "corral.shared.keyring"}


def _layer(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in LAYERS else "corral"


def _parse(path: Path) -> ast.Module:
    """``path``'s syntax tree. CPython 3.11.7's parser refuses every later parse with a
    SystemError ("AST constructor recursion depth mismatch", gh-106905) once another test of
    the process has hit a RecursionError: then the tree is parsed afresh in an interpreter of
    its own and handed back through its dump."""
    try:
        return ast.parse(path.read_text())
    except SystemError:
        dumped = subprocess.run(
            [
                sys.executable,
                "-c",
                "import ast, sys; print(ast.dump(ast.parse(open(sys.argv[1]).read())))",
                str(path),
            ],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        tree = eval(dumped, vars(ast))  # ast.dump of our own source: names of ast alone
        assert isinstance(tree, ast.Module)
        return tree


def _imports(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(_parse(path)):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            if node.module == "corral":  # `from corral import runner`
                found |= {f"corral.{alias.name}" for alias in node.names}
    return {name for name in found if name == "corral" or name.startswith("corral.")}


def _sources() -> list[tuple[str, Path]]:
    sources = []
    for package in LAYERS:
        for path in sorted((REPO / package).rglob("*.py")):
            inside = path.relative_to(REPO / package).parts
            if (
                package == "corral"
                and len(inside) > 1
                and (REPO / "corral" / inside[0]).is_symlink()
            ):
                continue  # corral/<name> are the links to the other folders
            sources.append((package, path))
    return sources


def _upward(sources: list[tuple[str, Path]]) -> set[tuple[str, str]]:
    upward = set()
    for package, path in sources:
        for module in _imports(path):
            if module in FOUNDATION or (module == "corral" and package != "corral"):
                continue
            if LAYERS[_layer(module)] > LAYERS[package]:
                upward.add((path.as_posix(), module))
    return upward


def test_no_package_imports_a_layer_above_it() -> None:
    assert _upward(_sources()) == set()


def test_an_upward_import_anywhere_in_a_module_is_found(tmp_path: Path) -> None:
    # Also inside a function or a TYPE_CHECKING block, and as `from corral import ...`.
    module = tmp_path / "providers" / "late.py"
    module.parent.mkdir()
    module.write_text(
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from corral.shared.store.models import Pool\n"
        "def f():\n    from corral import worker\n"
    )
    found = {name for _, name in _upward([("providers", module)])}
    assert found == {"corral.shared.store.models", "corral.worker"}


def test_the_foundation_modules_import_nothing_of_corral_but_one_another() -> None:
    for module in FOUNDATION:
        path = REPO / (module.removeprefix("corral.").replace(".", "/") + ".py")
        assert _imports(path) <= FOUNDATION - {module}, module


def test_the_runner_imports_nothing_of_corral() -> None:
    for path in sorted((REPO / "runner").rglob("*.py")):
        assert _imports(path) == set(), path


# The processes that are not the api: each loads none of FastAPI (nor, so, of the api's HTTP
# layer). A fresh interpreter each, so that nothing an earlier import loaded counts.
NOT_THE_API = (
    "corral.worker.reaper",
    "corral.worker.tasks",
    "corral.worker.maintenance",
    "corral.worker.provision",
    "corral.scheduler.intake",
    "corral.scheduler.batch",
    "corral.scheduler.consumer",
    "corral.scheduler.tasks",
)


def test_the_workers_and_the_intake_load_nothing_of_the_api() -> None:
    probe = (
        "import importlib, sys\n"
        "for name in sys.argv[1:]:\n"
        "    importlib.import_module(name)\n"
        "    if 'fastapi' in sys.modules:\n"
        "        print(name)\n"
        "        break\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe, *NOT_THE_API], capture_output=True, text=True, check=True
    )
    assert done.stdout == "", f"{done.stdout.strip()} loads FastAPI"


# Inside the scheduler: the intake (its top-level modules) < what operators do and read
# (scheduler/admin/) < the api process (scheduler/api/). The workers sit with the admin part:
# they may use it, never the api.
SCHEDULER_PARTS = {"admin": 1, "api": 2}


def _scheduler_part(module: str) -> int:
    parts = module.split(".")
    return (
        SCHEDULER_PARTS.get(parts[2], 0)
        if parts[:2] == ["corral", "scheduler"] and len(parts) > 2
        else 0
    )


def _own_part(path: Path) -> int:
    relative = path.relative_to(REPO).parts
    if relative[0] == "worker":
        return SCHEDULER_PARTS["admin"]
    return SCHEDULER_PARTS.get(relative[1], 0) if len(relative) > 2 else 0


def test_the_intake_and_the_workers_import_nothing_of_the_api() -> None:
    upward = set()
    for package in ("scheduler", "worker"):
        for path in sorted((REPO / package).rglob("*.py")):
            own = _own_part(path)
            upward |= {
                (path.relative_to(REPO).as_posix(), module)
                for module in _imports(path)
                if _scheduler_part(module) > own
            }
    assert upward == set()
