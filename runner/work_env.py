"""The work's environment, handed over inside the sandbox. Standard library only.

What a dispatch or a session sends as environment is the tenant's: it must never be the
environment of a process outside the sandbox (bubblewrap, setpriv, nsenter and ``timeout``
run on the host, some as root, and the dynamic loader acts on ``LD_PRELOAD`` and its
kind before any of them runs). So the local provider starts those with a fixed environment
of its own and hands the work's variables over in a memory file (memfd), named by
``CORRAL_WORK_ENV_FD`` (a JSON object of names to values). It is applied here, inside the
sandbox, once privileges are dropped: by the runner at its start, or, for any other
command, by this module run as a script in front of it::

    python -I -S work_env.py ARGV...    (applies the variables, then executes ARGV)

corral's own variables (``CORRAL_*`` names already set) are never replaced from it.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
from collections.abc import MutableMapping

WORK_ENV_FD_VARIABLE = "CORRAL_WORK_ENV_FD"
RESERVED_PREFIX = "CORRAL_"
# Far above what a message may carry (the intake bounds it): a bound on a broken writer.
MAX_WORK_ENV_BYTES = 64 * 1024 * 1024


class WorkEnvError(Exception):
    """The work's environment could not be read from the descriptor it was handed on."""


def take_work_env(environ: MutableMapping[str, str]) -> dict[str, str]:
    """Apply the work's variables that ``CORRAL_WORK_ENV_FD`` names to ``environ`` (the
    variable is removed and the descriptor closed); what was applied.

    Raises:
        WorkEnvError: the descriptor holds no JSON object of strings.
    """
    descriptor = environ.pop(WORK_ENV_FD_VARIABLE, "").strip()
    if not descriptor.isdigit():
        return {}
    variables = _read(int(descriptor))
    applied = {
        name: value
        for name, value in variables.items()
        if not (name.startswith(RESERVED_PREFIX) and name in environ)
    }
    environ.update(applied)
    return applied


def _read(fd: int) -> dict[str, str]:
    chunks: list[bytes] = []
    size = 0
    try:
        os.lseek(fd, 0, os.SEEK_SET)
        while chunk := os.read(fd, 1 << 20):
            size += len(chunk)
            if size > MAX_WORK_ENV_BYTES:
                raise WorkEnvError("the work's environment is larger than corral hands over")
            chunks.append(chunk)
    except OSError as exc:
        raise WorkEnvError(f"the work's environment could not be read: {exc}") from exc
    finally:
        with contextlib.suppress(OSError):
            os.close(fd)
    try:
        loaded = json.loads(b"".join(chunks))
    except ValueError as exc:
        raise WorkEnvError("the work's environment is not JSON") from exc
    if not isinstance(loaded, dict) or not all(
        isinstance(k, str) and isinstance(v, str) and "=" not in k and "\0" not in k + v
        for k, v in loaded.items()
    ):
        raise WorkEnvError("the work's environment is not an object of names and values")
    return loaded


def main(argv: list[str]) -> int:
    """Apply the work's environment, then become ``argv``; 127 if that cannot be done."""
    if not argv:
        print("work_env: nothing to run", file=sys.stderr)
        return 127
    try:
        take_work_env(os.environ)
        os.execvp(argv[0], argv)  # noqa: S606
    except (WorkEnvError, OSError) as exc:
        print(f"corral: {argv[0]}: {exc}", file=sys.stderr)
    return 127


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
