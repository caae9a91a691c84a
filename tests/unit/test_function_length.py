"""No function or method of corral's own code, tests and benchmarks included, is longer than
60 lines, counted from its ``def`` line to its last line (decorators not counted)."""

from __future__ import annotations

import ast
import os
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
FOLDERS = ("shared", "scheduler", "worker", "providers", "runner", "corral", "tests", "bench")
MAX_LINES = 60


def _sources(root: Path) -> list[Path]:
    """Every ``.py`` file under the folders, each once: the links corral/<name> to the other
    folders are not followed."""
    sources = []
    for folder in FOLDERS:
        for directory, subdirectories, files in os.walk(root / folder):
            subdirectories[:] = sorted(
                name
                for name in subdirectories
                if name != "__pycache__" and not (Path(directory) / name).is_symlink()
            )
            sources += [Path(directory) / name for name in sorted(files) if name.endswith(".py")]
    return sources


def _long_functions(path: Path, root: Path) -> list[str]:
    """``file:line name (n lines)`` for each function of ``path`` over the limit, nested
    functions and methods included."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            length = (node.end_lineno or node.lineno) - node.lineno + 1
            if length > MAX_LINES:
                where = path.relative_to(root).as_posix()
                found.append(f"{where}:{node.lineno} {node.name} ({length} lines)")
    return found


def test_no_function_is_longer_than_the_limit() -> None:
    too_long = [entry for path in _sources(REPO) for entry in _long_functions(path, REPO)]
    assert too_long == [], f"over {MAX_LINES} lines:\n" + "\n".join(too_long)


def test_every_folder_is_walked_and_each_file_once() -> None:
    sources = _sources(REPO)
    assert {path.relative_to(REPO).parts[0] for path in sources} == set(FOLDERS)
    assert (
        REPO / "shared" / "store" / "migrations" / "versions" / "0001_initial_schema.py" in sources
    )
    assert REPO / "tests" / "unit" / "test_function_length.py" in sources
    assert len({path.resolve() for path in sources}) == len(sources)


def _function(name: str, lines: int, indent: str = "", keyword: str = "def") -> str:
    """The source of a function ``lines`` long, its ``def`` line included."""
    body = "".join(f"{indent}    x = {number}\n" for number in range(lines - 1))
    return f"{indent}{keyword} {name}():\n{body}"


def test_a_function_over_the_limit_is_found_in_a_file(tmp_path: Path) -> None:
    (tmp_path / "shared").mkdir()
    (tmp_path / "corral").mkdir()
    (tmp_path / "corral" / "shared").symlink_to("../shared")  # as in the repository
    module = tmp_path / "shared" / "long.py"
    source = (
        _function("at_the_limit", MAX_LINES)
        + "@staticmethod\n@staticmethod\n"  # decorators are not counted
        + _function("decorated_at_the_limit", MAX_LINES)
        + _function("one_over", MAX_LINES + 1)
        + "class Holder:\n"
        + _function("method_over", MAX_LINES + 1, indent="    ", keyword="async def")
        + "def outer():\n"
        + _function("inner_over", MAX_LINES + 1, indent="    ")
    )
    module.write_text(source)
    lines = source.splitlines()

    def at(name: str) -> int:
        return next(n for n, line in enumerate(lines, 1) if f"def {name}(" in line)

    assert _sources(tmp_path) == [module]  # once, not again through corral/shared
    assert sorted(_long_functions(module, tmp_path)) == sorted(
        [
            f"shared/long.py:{at('one_over')} one_over ({MAX_LINES + 1} lines)",
            f"shared/long.py:{at('method_over')} method_over ({MAX_LINES + 1} lines)",
            f"shared/long.py:{at('outer')} outer ({MAX_LINES + 2} lines)",
            f"shared/long.py:{at('inner_over')} inner_over ({MAX_LINES + 1} lines)",
        ]
    )
