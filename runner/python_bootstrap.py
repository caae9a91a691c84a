"""Runs in the child Python of a code work item: load the code, call ``main``, save the result.

Not imported by the runner: its source is passed with ``python -c``, so that the child's
``sys.path`` starts with the work directory (as for any script run there) and not with the
runner's package, whose module names could shadow the work's. Usage::

    python -c <this source> CODE_PATH ARGUMENTS_PATH RESULT_PATH

The arguments come in a JSON file (not argv or env, which other processes can read), and
the result goes to a JSON file, ``{"ok": true, "result": ...}`` or
``{"ok": false, "error": "..."}``, so that whatever ``main`` prints stays plain output.

A code interpreter (a provider that executes code itself, with no runner) has no files to
pass: :func:`run_inline` calls ``main`` the same way and prints the same payload as one
marker line on standard output (see :mod:`runner.inline_code`, which builds that program).
"""

from __future__ import annotations

import asyncio
import inspect
import json
import os
import runpy
import sys
import threading
import traceback
from collections.abc import Callable
from typing import Any

_TRACEBACK_LINES = 30


def _save(result_path: str, payload: dict[str, Any]) -> None:
    text = json.dumps(payload, allow_nan=False)  # strict JSON: no NaN or Infinity
    with open(result_path, "w", encoding="utf-8") as handle:
        handle.write(text)


def _describe(error: BaseException) -> str:
    text = str(error)
    return f"{type(error).__name__}: {text}" if text else type(error).__name__


async def _awaited(awaitable: Any) -> Any:
    return await awaitable


def _call(load: Callable[[], dict[str, Any]], arguments: dict[str, Any]) -> dict[str, Any]:
    """Load the code, call its ``main(**arguments)`` (awaited if it is a coroutine) and
    return the payload to save: ``{"ok": true, "result": ...}`` or ``{"ok": false, ...}``.
    The end of the traceback of a failure goes to stderr."""
    try:
        namespace = load()
    except Exception as error:
        return _failure(f"loading the code raised {_describe(error)}")
    entry = namespace.get("main")
    if not callable(entry):
        return _failure("the code defines no main() function")
    try:
        value = entry(**arguments)
        if inspect.isawaitable(value):
            value = _await(value)
    except Exception as error:
        return _failure(f"main() raised {_describe(error)}")
    try:
        json.dumps(value, allow_nan=False)  # strict JSON: no NaN or Infinity
    except (TypeError, ValueError) as error:
        message = f"main() returned a value that is not JSON-serialisable: {error}"
        return _failure(message, show_traceback=False)
    return {"ok": True, "result": value}


def _failure(error: str, *, show_traceback: bool = True) -> dict[str, Any]:
    if show_traceback and sys.exc_info()[0] is not None:
        lines = traceback.format_exc().rstrip("\n").splitlines()
        sys.stderr.write("\n".join(lines[-_TRACEBACK_LINES:]) + "\n")
    return {"ok": False, "error": error}


def _await(awaitable: Any) -> Any:
    """Run ``awaitable`` to its end; in a thread of its own when this thread already runs an
    event loop (a code interpreter's kernel does)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(_awaited(awaitable))
    outcome: dict[str, Any] = {}

    def run() -> None:
        try:
            outcome["value"] = asyncio.run(_awaited(awaitable))
        except BaseException as error:  # re-raised in the calling thread
            outcome["error"] = error

    worker = threading.Thread(target=run, name="corral-main")
    worker.start()
    worker.join()
    if "error" in outcome:
        raise outcome["error"]
    return outcome.get("value")


def main(argv: list[str]) -> int:
    code_path, arguments_path, result_path = argv
    with open(arguments_path, encoding="utf-8") as handle:
        arguments = json.load(handle)
    # A name other than __main__, so that an `if __name__ == "__main__":` block stays idle.
    payload = _call(lambda: runpy.run_path(code_path, run_name="__corral_work__"), arguments)
    _save(result_path, payload)
    return 0 if payload["ok"] else 1


def run_inline(code: str, arguments: dict[str, Any], marker: str, env: dict[str, str]) -> bool:
    """Call ``code``'s ``main(**arguments)`` in this process, with ``env`` added to its
    environment, and print the payload as one line ``<marker><JSON>`` on stdout, after
    whatever the code printed. True when ``main`` returned a result."""
    os.environ.update(env)

    def load() -> dict[str, Any]:
        namespace: dict[str, Any] = {"__name__": "__corral_work__"}
        exec(compile(code, "work_item.py", "exec"), namespace)  # noqa: S102 - the work itself
        return namespace

    payload = _call(load, arguments)
    sys.stderr.flush()
    sys.stdout.write("\n" + marker + json.dumps(payload, allow_nan=False) + "\n")
    sys.stdout.flush()
    return bool(payload["ok"])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
