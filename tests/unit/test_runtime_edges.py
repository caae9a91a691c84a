"""The process's runtime global (:mod:`corral.shared.runtime`'s ``current``, and the other
functions that read or set it) is reached only at a process's edges: Celery tasks, the
api's one dependency, commands, and what Celery or kombu build with no way to hand it
anything. Domain modules take what they need (a database, settings) as arguments
(docs/architecture.md; CONVENTIONS: dependencies passed, not fetched).
"""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PACKAGES = ("runner", "providers", "shared", "scheduler", "worker", "corral")
RUNTIME = "corral.shared.runtime"
GLOBAL = frozenset({"current", "message_limits", "install", "reset"})

# Modules (paths from the repository's root) that may reach the global, and why.
EDGES = {
    "shared/runtime.py": "it holds the global",
    "corral/celery.py": "the Celery app's entry point, which prepares the worker process",
    "worker/tasks.py": "Celery tasks",
    "scheduler/tasks.py": "Celery tasks",
    "scheduler/api/process_runtime.py": "the api's runtime dependency (get_runtime)",
    "scheduler/api/metrics.py": "the Prometheus collector, called by a scrape outside routes",
    "shared/broker/worker_consumer.py": "Celery's worker consumer, built by Celery",
    "shared/broker/redis_transport.py": "kombu's Redis channel, built by kombu",
}
EDGE_FOLDERS = {"corral/cli/": "commands"}


def _runtime_names(tree: ast.AST) -> set[str]:
    """The names a module binds to the runtime module (``corral.shared.runtime`` itself
    for a plain ``import corral.shared.runtime``)."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module == "corral.shared" and node.level == 0:
            names |= {alias.asname or alias.name for alias in node.names if alias.name == "runtime"}
        elif isinstance(node, ast.Import):
            names |= {alias.asname or RUNTIME for alias in node.names if alias.name == RUNTIME}
    return names


def _dotted(node: ast.expr) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        head = _dotted(node.value)
        return f"{head}.{node.attr}" if head else None
    return None


def uses_of_the_global(source: str) -> list[int]:
    """The lines where ``source`` imports one of the global's functions or reaches one
    through the runtime module."""
    tree = ast.parse(source)
    modules = _runtime_names(tree)
    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module == RUNTIME and node.level == 0:
            if any(alias.name in GLOBAL for alias in node.names):
                lines.append(node.lineno)
        elif (
            isinstance(node, ast.Attribute)
            and node.attr in GLOBAL
            and _dotted(node.value) in modules
        ):
            lines.append(node.lineno)
    return sorted(lines)


def _sources() -> list[Path]:
    sources = []
    for package in PACKAGES:
        for path in sorted((REPO / package).rglob("*.py")):
            inside = path.relative_to(REPO / package).parts
            if package == "corral" and (REPO / "corral" / inside[0]).is_symlink():
                continue  # corral/<name> are the links to the other folders
            sources.append(path)
    return sources


def _is_edge(relative: str) -> bool:
    return relative in EDGES or relative.startswith(tuple(EDGE_FOLDERS))


def test_only_edge_modules_reach_the_runtime_global() -> None:
    found = {}
    for path in _sources():
        relative = path.relative_to(REPO).as_posix()
        lines = uses_of_the_global(path.read_text())
        if lines and not _is_edge(relative):
            found[relative] = lines
    assert found == {}, "pass the runtime (or its db, settings) in from the edge instead"


def test_every_edge_named_exists() -> None:
    for relative in [*EDGES, *EDGE_FOLDERS]:
        assert (REPO / relative).exists(), relative


def test_every_way_of_reaching_the_global_is_found() -> None:
    source = (
        "from corral.shared import runtime\n"
        "import corral.shared.runtime as rt_module\n"
        "import corral.shared.runtime\n"
        "from corral.shared.runtime import current as now\n"
        "from corral.shared.runtime import Runtime, message_limits\n"
        "def f(given: Runtime):\n"
        "    runtime.current().db\n"
        "    rt_module.install(given)\n"
        "    corral.shared.runtime.reset()\n"
        "    lookup = runtime.current\n"
    )
    assert uses_of_the_global(source) == [4, 5, 7, 8, 9, 10]


def test_what_is_not_the_global_is_not_found() -> None:
    source = (
        "from corral.shared.runtime import Runtime\n"
        "from corral.shared import kits\n"
        "def f(rt: Runtime):\n"
        "    kits.current()\n"
        "    rt.settings.message_limits()\n"
        "    rt.db\n"
    )
    assert uses_of_the_global(source) == []
