"""Runs a code work item: Python source whose ``main(**arguments)`` returns the result.

The code runs in a child Python (the runner's own interpreter) driven by
:mod:`runner.python_bootstrap`, as a step like any other: same streaming, cancellation and
deadline. Files pass the arguments in and the result out.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .protocol import SUPPORTED_LANGUAGES, CodeWork
from .steps import Cancellation, LineSink, StepOutcome, run_step

_BOOTSTRAP = Path(__file__).with_name("python_bootstrap.py")


@dataclass(frozen=True)
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


def run_python(
    work: CodeWork,
    *,
    env: Mapping[str, str],
    sink: LineSink,
    cancellation: Cancellation,
    deadline: float | None,
) -> CodeOutcome:
    """Run ``work.code``'s ``main`` in a child Python and collect its JSON result."""
    with tempfile.TemporaryDirectory(prefix="corral-code-") as scratch:
        code_path = os.path.join(scratch, "work_item.py")
        arguments_path = os.path.join(scratch, "arguments.json")
        result_path = os.path.join(scratch, "result.json")
        Path(code_path).write_text(work.code, encoding="utf-8")
        Path(arguments_path).write_text(json.dumps(dict(work.arguments)), encoding="utf-8")
        argv = [
            sys.executable or "python3",
            "-c",
            _BOOTSTRAP.read_text(encoding="utf-8"),
            code_path,
            arguments_path,
            result_path,
        ]
        step = run_step(argv, env=env, sink=sink, cancellation=cancellation, deadline=deadline)
        if step.interrupted is not None:
            return CodeOutcome(step)
        return _read_result(step, result_path)


def _read_result(step: StepOutcome, result_path: str) -> CodeOutcome:
    try:
        with open(result_path, encoding="utf-8") as handle:
            saved = json.load(handle)
    except (OSError, ValueError):
        # No result: the child was killed, or the code ended the process itself.
        error = f"the python process exited with code {step.returncode} without a result"
        return CodeOutcome(StepOutcome(step.returncode or 1), error=error)
    if saved.get("ok") is True:
        return CodeOutcome(step, result=saved.get("result"))
    return CodeOutcome(StepOutcome(step.returncode or 1), error=str(saved.get("error")))
