"""Whether each provider answered the maintenance worker, said once per change.

A provider that is not installed, not configured (no credential, no kubeconfig) or not
reachable fails every pass that asks it, once a minute for reconciliation. Logging each
failure with its traceback filled the log (some kilobytes per provider a minute) and said
nothing new. :class:`ProviderStates` logs one line when a provider's state changes: it
fails (with its error's code and message; an error that is not one of corral's, which may
be a bug, with its traceback, once), it fails for another reason, or it answers again.
While it stays as it was, a DEBUG line at most.
"""

from __future__ import annotations

import logging
import threading

from corral.shared.errors import CorralError

log = logging.getLogger(__name__)


def _state_of(error: BaseException) -> str:
    """A failure's state: corral's error code, else the exception's type (a message may
    differ from call to call, and each difference would be a line again)."""
    return error.code if isinstance(error, CorralError) else type(error).__name__


class ProviderStates:
    """The last state of each provider as this process saw it: failing (and why), or not."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._failing: dict[str, str] = {}

    def failed(self, provider_id: str, error: BaseException, *, doing: str) -> None:
        """``provider_id`` failed while ``doing`` something: said if that is news."""
        state = _state_of(error)
        with self._lock:
            before = self._failing.get(provider_id)
            self._failing[provider_id] = state
        extra = {"provider_id": provider_id, "code": state}
        if before == state:
            log.debug("provider still unavailable (%s)", doing, extra=extra)
            return
        if isinstance(error, CorralError):
            log.warning(
                "provider %s is unavailable for %s: %s: %s (said again when this changes)",
                provider_id,
                doing,
                state,
                error.message,
                extra=extra,
            )
        else:
            log.warning(
                "provider %s failed %s with an unexpected error (said again when this changes)",
                provider_id,
                doing,
                exc_info=error,
                extra=extra,
            )

    def answered(self, provider_id: str) -> None:
        """``provider_id`` answered: said if it was failing."""
        with self._lock:
            before = self._failing.pop(provider_id, None)
        if before is not None:
            log.info(
                "provider %s answers again (it was unavailable: %s)",
                provider_id,
                before,
                extra={"provider_id": provider_id},
            )
