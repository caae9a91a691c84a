"""The runner's own diagnostics: plain lines on stderr, with anything token-like redacted.

Work output goes to the control plane as logs; stderr is for the runner itself and ends up
in the provider's log of the sandbox, which more people read than the work's logs. The
redaction is a safety net: no code path formats a token into a message on purpose.

The runner starts once per work item, so this is a few lines rather than the standard
library's ``logging``, whose import (traceback, string, threading's friends) cost the runner
more CPU than anything else it loads. The lines are the ones that ``logging`` configured as
below wrote: ``corral-runner: LEVEL message``, INFO and above.
"""

from __future__ import annotations

import functools
import sys
import threading

TYPE_CHECKING = False  # not typing's: see corral.runner.records
if TYPE_CHECKING:
    import re
    from typing import Any, TextIO


PREFIX = "corral-runner: "
INFO, WARNING, ERROR = 20, 30, 40
_LEVEL_NAMES = {INFO: "INFO", WARNING: "WARNING", ERROR: "ERROR"}


@functools.cache
def _token() -> re.Pattern[str]:
    import re  # noqa: PLC0415  # compiled when first needed, not at every runner start

    # Registration (crt_), session (crs_), enrolment (cre_) and warm-channel (crw_) tokens.
    return re.compile(r"\bcr[tsew]_[A-Za-z0-9._~+/=-]+")


def redact(text: str) -> str:
    """Replace every token-like word in ``text`` with its prefix and a marker."""
    return _token().sub(lambda match: match.group(0)[:4] + "<redacted>", text)


class RunnerLogger:
    """``logger.info/warning/error/exception(msg, *args)``, ``msg % args`` as ``logging`` does.

    Until :func:`configure_logging`, WARNING and above go to ``sys.stderr`` as it is at each
    line (where an unconfigured ``logging`` sent them); after it, INFO and above go to the
    stream it was given. Lines from several threads never interleave."""

    def __init__(self) -> None:
        self._stream: TextIO | None = None
        self._level = WARNING
        self._lock = threading.Lock()

    def configure(self, stream: TextIO, level: int = INFO) -> None:
        self._stream, self._level = stream, level

    def info(self, msg: str, *args: object) -> None:
        self._log(INFO, msg, args)

    def warning(self, msg: str, *args: object) -> None:
        self._log(WARNING, msg, args)

    def error(self, msg: str, *args: object) -> None:
        self._log(ERROR, msg, args)

    def exception(self, msg: str, *args: object) -> None:
        """An ERROR line followed by the traceback of the exception being handled."""
        if self._level > ERROR:
            return
        import traceback  # noqa: PLC0415  # only a failure pays for it

        trace = "".join(traceback.format_exception(*sys.exc_info())).rstrip("\n")
        self._log(ERROR, msg, args, trace)

    def _log(self, level: int, msg: str, args: tuple[Any, ...], trace: str = "") -> None:
        if level < self._level:
            return
        try:
            message = str(msg) % args if args else str(msg)
        except (TypeError, ValueError):  # a bad format still says what it could
            message = f"{msg} {args!r}"
        line = f"{PREFIX}{_LEVEL_NAMES[level]} {message}"
        if trace:
            line = f"{line}\n{trace}"
        stream = self._stream or sys.stderr
        with self._lock:
            try:
                stream.write(redact(line) + "\n")
                stream.flush()
            except (OSError, ValueError):  # stderr gone or closed: diagnostics never fail
                pass


# The runner's one logger; its modules import it.
logger = RunnerLogger()


def configure_logging(stream: TextIO | None = None) -> None:
    """Send the runner's lines at INFO and above to ``stream`` (stderr by default), redacted."""
    logger.configure(stream or sys.stderr)
