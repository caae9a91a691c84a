"""Runs in the child Python of a code work item: load the code, call ``main``, save the result.

Not imported by the runner: its source is passed with ``python -c``, so that the child's
``sys.path`` starts with the work directory (as for any script run there) and not with the
runner's package, whose module names could shadow the work's. Usage::

    python -c <this source> CODE_PATH ARGUMENTS_PATH RESULT_PATH

The arguments come in a JSON file (not argv or env, which other processes can read), and
the result goes to a JSON file, ``{"ok": true, "result": ...}`` or
``{"ok": false, "error": "..."}``, so that whatever ``main`` prints stays plain output.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import runpy
import sys
import traceback
from typing import Any

_TRACEBACK_LINES = 30


def _save(result_path: str, payload: dict[str, Any]) -> None:
    text = json.dumps(payload, allow_nan=False)  # strict JSON: no NaN or Infinity
    with open(result_path, "w", encoding="utf-8") as handle:
        handle.write(text)


def _fail(result_path: str, error: str, *, show_traceback: bool = True) -> int:
    """Report ``error``; the end of the traceback being handled goes to stderr, the logs."""
    if show_traceback and sys.exc_info()[0] is not None:
        lines = traceback.format_exc().rstrip("\n").splitlines()
        sys.stderr.write("\n".join(lines[-_TRACEBACK_LINES:]) + "\n")
    _save(result_path, {"ok": False, "error": error})
    return 1


def _describe(error: BaseException) -> str:
    text = str(error)
    return f"{type(error).__name__}: {text}" if text else type(error).__name__


async def _awaited(awaitable: Any) -> Any:
    return await awaitable


def main(argv: list[str]) -> int:
    code_path, arguments_path, result_path = argv
    with open(arguments_path, encoding="utf-8") as handle:
        arguments = json.load(handle)
    try:
        # A name other than __main__, so that an `if __name__ == "__main__":` block stays idle.
        namespace = runpy.run_path(code_path, run_name="__corral_work__")
    except Exception as error:
        return _fail(result_path, f"loading the code raised {_describe(error)}")
    entry = namespace.get("main")
    if not callable(entry):
        return _fail(result_path, "the code defines no main() function")
    try:
        value = entry(**arguments)
        if inspect.isawaitable(value):
            value = asyncio.run(_awaited(value))
    except Exception as error:
        return _fail(result_path, f"main() raised {_describe(error)}")
    try:
        _save(result_path, {"ok": True, "result": value})
    except (TypeError, ValueError) as error:
        message = f"main() returned a value that is not JSON-serialisable: {error}"
        return _fail(result_path, message, show_traceback=False)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
