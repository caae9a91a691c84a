"""Whether a failed phase ran out of memory, so that the item says so (``out_of_memory``)
instead of a bare exit code or ``Segmentation fault``.

The provider tells the runner how its sandbox's memory is limited:

- ``CORRAL_OOM_EVENTS``: a file with the sandbox cgroup's ``oom_kill N`` count (the local
  provider's cgroup mechanism). A count that grew while the phase ran means the kernel's
  OOM killer killed one of its processes: certain.
- ``CORRAL_MEMORY_LIMIT=rlimit``: RLIMIT_AS, where a process over the limit is not killed
  but fails to allocate. The runner recognises the words runtimes print then (Python's
  ``MemoryError``, ``Cannot allocate memory``, Node's ``heap out of memory``, C++'s
  ``std::bad_alloc``) at the end of the phase's stderr or in its error: a good guess, not a
  certainty, and said so in the message.
"""

from __future__ import annotations

import collections
import os
from collections.abc import Mapping

from .protocol import Completion
from .records import replace
from .steps import LineSink

OUT_OF_MEMORY = "out_of_memory"
OOM_EVENTS_ENV = "CORRAL_OOM_EVENTS"
MEMORY_LIMIT_ENV = "CORRAL_MEMORY_LIMIT"
_SIGNS = (
    "MemoryError",
    "Cannot allocate memory",
    "out of memory",
    "Out of memory",
    "std::bad_alloc",
)
_TAIL_LINES = 40


class MemoryWatch:
    """Watches one work phase for running out of memory."""

    def __init__(self, environ: Mapping[str, str] | None = None) -> None:
        environ = os.environ if environ is None else environ
        self._events = environ.get(OOM_EVENTS_ENV)
        self._rlimit = environ.get(MEMORY_LIMIT_ENV) == "rlimit"
        self._kills_before = self._kills()
        self._stderr: collections.deque[str] = collections.deque(maxlen=_TAIL_LINES)

    def _kills(self) -> int | None:
        if not self._events:
            return None
        try:
            with open(self._events, encoding="ascii") as handle:
                for line in handle:
                    if line.startswith("oom_kill "):
                        return int(line.split()[1])
        except (OSError, ValueError):
            return None
        return None

    def sink(self, inner: LineSink) -> LineSink:
        """``inner``, keeping the last stderr lines for :meth:`judge`."""

        def watched(stream: str, line: str) -> None:
            if stream == "stderr" and self._rlimit:
                self._stderr.append(line)
            inner(stream, line)

        return watched

    def judge(self, completion: Completion) -> Completion:
        """``completion``, failing ``out_of_memory`` when its phase ran out of memory."""
        if completion.succeeded or completion.cancelled or completion.error_code is not None:
            return completion
        before, after = self._kills_before, self._kills()
        if before is not None and after is not None and after > before:
            cause = "the kernel's OOM killer killed a process of it at the sandbox's memory limit"
        elif self._rlimit and self._says_out_of_memory(completion.error):
            cause = "a process of it failed to allocate memory at the sandbox's memory limit"
        else:
            return completion
        error = f"{completion.phase} ran out of memory: {cause}"
        if completion.error:
            error += f" ({completion.error})"
        return replace(completion, error=error, error_code=OUT_OF_MEMORY)

    def _says_out_of_memory(self, error: str | None) -> bool:
        texts = [*self._stderr, error or ""]
        return any(sign in text for text in texts for sign in _SIGNS)
