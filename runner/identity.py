"""Keeping the runner's tokens from the work it runs.

In most sandboxes the work runs as the runner's own user, and a process can read another
of its user's processes' memory (``/proc/<pid>/mem``) and initial environment
(``/proc/<pid>/environ``). Two things close that:

* The runner makes itself non-dumpable (``prctl(PR_SET_DUMPABLE, 0)``) before it holds any
  token: then only a process with ``CAP_SYS_PTRACE`` may read its memory or environment, or
  trace it. The work is a fresh ``execve``, so it is dumpable again (it holds no secret).
* The registration token is never in the runner's environment block. Removing a variable
  from ``os.environ`` does not change the block ``/proc/<pid>/environ`` shows, which is the
  one ``execve`` was given; so a runner started with the token in its environment re-executes
  itself at once with an environment without it, and gets the token on an inherited pipe
  (``CORRAL_REGISTRATION_TOKEN_FD``) instead. A provider that can start the runner with the
  pipe itself (the local one does) spares it the second start.
"""

from __future__ import annotations

import ctypes
import os
import sys
from collections.abc import Mapping, MutableMapping, Sequence

REGISTRATION_TOKEN_VARIABLE = "CORRAL_REGISTRATION_TOKEN"  # noqa: S105 - a name, not a token
REGISTRATION_TOKEN_FD_VARIABLE = "CORRAL_REGISTRATION_TOKEN_FD"  # noqa: S105 - a name
# A warm sandbox's runner gets a single-use enrolment credential where a cold one gets its
# registration token, by the same way (docs/warm-pools.md).
ENROLMENT_PREFIX = "cre_"
PR_GET_DUMPABLE = 3  # linux/prctl.h
PR_SET_DUMPABLE = 4
_TOKEN_LIMIT = 4096


def _prctl(option: int, value: int = 0) -> int:
    """``prctl(option, value, 0, 0, 0)``; -1 where there is no prctl (not Linux)."""
    try:
        result: int = ctypes.CDLL(None, use_errno=True).prctl(option, value, 0, 0, 0)
    except (OSError, AttributeError):
        return -1
    return result


def make_undumpable() -> bool:
    """Make this process non-dumpable; whether it now is."""
    _prctl(PR_SET_DUMPABLE, 0)
    return _prctl(PR_GET_DUMPABLE) == 0


def protect(
    environ: Mapping[str, str] | None = None,
    argv: Sequence[str] | None = None,
    executable: str | None = None,
) -> None:
    """The runner's first act: become non-dumpable, then, if the registration token is in
    the environment block, re-execute without it (this call then does not return)."""
    if not make_undumpable():
        print("runner: could not make itself non-dumpable", file=sys.stderr)
    environ = os.environ if environ is None else environ
    token = environ.get(REGISTRATION_TOKEN_VARIABLE)
    if not token:
        return
    executable = executable or sys.executable
    argv = list(argv or sys.orig_argv)
    os.execve(executable, [executable, *argv[1:]], token_on_pipe(environ, token))  # noqa: S606


def token_on_pipe(environ: Mapping[str, str], token: str) -> dict[str, str]:
    """``environ`` without the token, naming instead an inheritable pipe that holds it."""
    read_end, write_end = os.pipe()
    os.write(write_end, token.encode())  # far below a pipe's buffer: it cannot block
    os.close(write_end)
    os.set_inheritable(read_end, True)
    env = {k: v for k, v in environ.items() if k != REGISTRATION_TOKEN_VARIABLE}
    env[REGISTRATION_TOKEN_FD_VARIABLE] = str(read_end)
    return env


def take_registration_token(environ: MutableMapping[str, str]) -> str:
    """The registration token, from the environment or the pipe it names; both variables
    are removed and the pipe is closed, so that nothing the runner starts inherits them."""
    token = environ.pop(REGISTRATION_TOKEN_VARIABLE, "").strip()
    descriptor = environ.pop(REGISTRATION_TOKEN_FD_VARIABLE, "").strip()
    if descriptor.isdigit():
        piped = _read_pipe(int(descriptor))
        token = token or piped
    return token


def _read_pipe(fd: int) -> str:
    """What the pipe holds up to its end (at most a few KiB), then closed; "" if unreadable."""
    data = b""
    try:
        while len(data) < _TOKEN_LIMIT:
            chunk = os.read(fd, _TOKEN_LIMIT)
            if not chunk:
                break
            data += chunk
        os.close(fd)
    except OSError:
        return ""
    return data.decode("utf-8", "replace").strip()
