"""A code work item as one program, for code interpreters that execute code themselves.

A provider that runs code rather than a runner (an execute-code API) submits the program
:func:`program` builds: it calls ``main(**arguments)`` exactly as the runner's child Python
does (:mod:`runner.python_bootstrap`: same loading, awaiting, JSON checks and error words)
and prints the outcome as one line, ``<marker><JSON>``, at the end of standard output.
:func:`split_output` takes that line back out of the output. The marker carries a random
nonce per run, so that what the code prints cannot pass for it by accident.

The bootstrap runs in a namespace of its own, so neither it nor the work's code touch the
interpreter's globals (a kernel's ``__name__`` is ``__main__``).
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from .records import record

_BOOTSTRAP = Path(__file__).with_name("python_bootstrap.py")
MARKER_PREFIX = "__corral_result_"


def new_marker() -> str:
    """A marker line prefix for one run: ``__corral_result_<nonce>__ ``."""
    return f"{MARKER_PREFIX}{secrets.token_hex(8)}__ "


def program(
    code: str, arguments: Mapping[str, Any], *, marker: str, env: Mapping[str, str] | None = None
) -> str:
    """The Python source that runs ``code``'s ``main(**arguments)`` and prints the marker
    line. ``env`` is added to the process environment first (the work's env)."""
    bootstrap = _BOOTSTRAP.read_text(encoding="utf-8")
    call = (code, dict(arguments), marker, dict(env or {}))
    return (
        "def __corral_run():\n"
        "    namespace = {'__name__': '__corral_bootstrap__'}\n"
        f"    exec(compile({bootstrap!r}, 'corral_bootstrap.py', 'exec'), namespace)\n"
        "    import json\n"
        f"    code, arguments, marker, env = json.loads({json.dumps(call)!r})\n"
        "    return namespace['run_inline'](code, arguments, marker, env)\n"
        "__corral_run()\n"
    )


@record
class InlineOutcome:
    """What a run printed, without the marker line, and what its marker line said."""

    stdout: str
    ok: bool
    result: Any = None
    error: str | None = None


def split_output(stdout: str, marker: str) -> InlineOutcome:
    """Take the marker line out of ``stdout``. No marker line: the program did not get to
    print it (killed, timed out, or the code ended the interpreter)."""
    head, found, tail = stdout.rpartition(marker)
    if not found:
        return InlineOutcome(stdout, ok=False, error="the code ended without a result")
    line, _, rest = tail.partition("\n")
    printed = head.removesuffix("\n") + rest
    try:
        payload = json.loads(line)
    except ValueError:
        return InlineOutcome(printed, ok=False, error="the code's result line is not JSON")
    if isinstance(payload, dict) and payload.get("ok") is True:
        return InlineOutcome(printed, ok=True, result=payload.get("result"))
    error = payload.get("error") if isinstance(payload, dict) else None
    return InlineOutcome(printed, ok=False, error=str(error or "main() gave no result"))
