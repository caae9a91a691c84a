"""Runs a code work item: source whose ``main`` returns the result.

Python code (``main(**arguments)``) runs in a child Python (the runner's own interpreter)
driven by :mod:`runner.python_bootstrap`; JavaScript code (``main(arguments)``, may be
async) in a child ``node`` found on the work's ``PATH``, driven by ``node_bootstrap.js``.
Either is a step like any other: same streaming, cancellation and deadline. Files pass the
arguments in and the result out, as the same payloads.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from .protocol import SUPPORTED_LANGUAGES, CodeWork
from .records import record
from .steps import Cancellation, LineSink, StepOutcome, run_step

_BOOTSTRAPS = {
    "python": Path(__file__).with_name("python_bootstrap.py"),
    "javascript": Path(__file__).with_name("node_bootstrap.js"),
}
_INTERPRETERS = {"python": "python", "javascript": "node"}


@record
class CodeOutcome:
    """The child's step outcome, plus ``main``'s result or why there is none."""

    step: StepOutcome
    result: Any = None
    error: str | None = None


def unsupported_language_error(work: CodeWork) -> str | None:
    """The error to report for ``work``'s language, or None when the runner supports it."""
    if work.language in SUPPORTED_LANGUAGES:
        return None
    return f"unsupported language {work.language}; supported: {', '.join(SUPPORTED_LANGUAGES)}"


def run_code(
    work: CodeWork,
    *,
    env: Mapping[str, str],
    sink: LineSink,
    cancellation: Cancellation,
    deadline: float | None,
) -> CodeOutcome:
    """Run ``work.code``'s ``main`` in a child of its language (a language the runner
    supports: see :func:`unsupported_language_error`) and collect its JSON result."""
    with tempfile.TemporaryDirectory(prefix="corral-code-") as scratch:
        suffix = ".py" if work.language == "python" else ".js"
        code_path = os.path.join(scratch, "work_item" + suffix)
        arguments_path = os.path.join(scratch, "arguments.json")
        result_path = os.path.join(scratch, "result.json")
        Path(code_path).write_text(work.code, encoding="utf-8")
        Path(arguments_path).write_text(json.dumps(dict(work.arguments)), encoding="utf-8")
        bootstrap = _BOOTSTRAPS[work.language].read_text(encoding="utf-8")
        if work.language == "python":
            argv = [sys.executable or "python3", "-c", bootstrap]
        else:
            argv = ["node", "-e", bootstrap]
        argv += [code_path, arguments_path, result_path]
        step = run_step(argv, env=env, sink=sink, cancellation=cancellation, deadline=deadline)
        if step.interrupted is not None:
            return CodeOutcome(step)
        return _read_result(step, result_path, _INTERPRETERS[work.language])


def _read_result(step: StepOutcome, result_path: str, interpreter: str) -> CodeOutcome:
    try:
        with open(result_path, encoding="utf-8") as handle:
            saved = json.load(handle)
    except (OSError, ValueError):
        # No result: the child was killed, did not start, or the code ended the process.
        error = f"the {interpreter} process exited with code {step.returncode} without a result"
        if step.returncode == 127:
            error += f" ({interpreter} was not found on the sandbox's PATH)"
        return CodeOutcome(StepOutcome(step.returncode or 1), error=error)
    if saved.get("ok") is True:
        return CodeOutcome(step, result=saved.get("result"))
    return CodeOutcome(StepOutcome(step.returncode or 1), error=str(saved.get("error")))
