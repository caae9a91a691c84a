"""The benchmarks ``make bench`` runs, read from the Makefile: the one list of them."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MAKEFILE = REPO / "Makefile"
TARGET = "bench: $(STAMP)"
PYTHON, ARGS = "$(BIN)/python", "$(BENCH_ARGS)"
# Modules of bench/ that are run by benchmarks, not benchmarks themselves.
HELPERS = frozenset({"bench.slow_provider"})


def bench_lines(makefile: Path = MAKEFILE) -> list[list[str]]:
    """Each command of the Makefile's ``bench`` recipe, as the arguments after ``python``
    and before ``$(BENCH_ARGS)``: ``["-m", "bench.routing", "--what", "anchor"]``.

    Raises:
        ValueError: the recipe has no line, or one that is not ``$(BIN)/python ...
            $(BENCH_ARGS)`` (a benchmark that could not be run in its smoke mode).
    """
    lines = makefile.read_text().splitlines()
    start = lines.index(TARGET) + 1
    commands = []
    for line in lines[start:]:
        if not line.startswith("\t"):
            break
        words = line.split()
        if words[0] != PYTHON or words[-1] != ARGS or words[1] != "-m":
            raise ValueError(f"not `{PYTHON} -m bench.<name> ... {ARGS}`: {line.strip()!r}")
        commands.append(words[1:-1])
    if not commands:
        raise ValueError(f"the Makefile's {TARGET!r} recipe runs nothing")
    return commands


def bench_modules(folder: Path = REPO / "bench") -> set[str]:
    """The modules of ``folder`` a person runs (they have a ``__main__`` guard), helpers
    left out."""
    found = set()
    for path in folder.glob("*.py"):
        tree = ast.parse(path.read_text(), filename=str(path))
        if any(_is_main_guard(node) for node in tree.body):
            found.add(f"{folder.name}.{path.stem}")
    return found - HELPERS


def _is_main_guard(node: ast.stmt) -> bool:
    return (
        isinstance(node, ast.If)
        and isinstance(node.test, ast.Compare)
        and isinstance(node.test.left, ast.Name)
        and node.test.left.id == "__name__"
    )
