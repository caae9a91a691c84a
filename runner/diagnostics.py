"""The runner's own diagnostics: plain lines on stderr, with anything token-like redacted.

Work output goes to the control plane as logs; stderr is for the runner itself and ends up
in the provider's log of the sandbox, which more people read than the work's logs. The
redaction is a safety net: no code path formats a token into a message on purpose.
"""

from __future__ import annotations

import logging
import re
import sys
from typing import TextIO

# Registration (crt_), session (crs_), enrolment (cre_) and warm-channel (crw_) tokens.
_TOKEN = re.compile(r"\bcr[tsew]_[A-Za-z0-9._~+/=-]+")


def redact(text: str) -> str:
    """Replace every token-like word in ``text`` with its prefix and a marker."""
    return _TOKEN.sub(lambda match: match.group(0)[:4] + "<redacted>", text)


class _RedactingFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        return redact(super().format(record))


def configure_logging(stream: TextIO | None = None) -> None:
    """Send the runner package's loggers to ``stream`` (stderr by default), redacted.

    The package is ``runner`` inside a sandbox and ``corral.runner`` in the control plane."""
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.setFormatter(_RedactingFormatter("corral-runner: %(levelname)s %(message)s"))
    logger = logging.getLogger(__name__.rpartition(".")[0])
    logger.handlers[:] = [handler]
    logger.setLevel(logging.INFO)
    logger.propagate = False
