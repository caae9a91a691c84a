"""The client's exceptions: one root, :class:`ClientError`, under corral's own.

An answer the api refused is an :class:`ApiError` with the HTTP status, the api's error code
and its message (a subclass per status a caller acts on); the request's token is never in
it. What never reached an answer is :class:`ApiUnreachableError`; an answer that does not
read as the api's model is :class:`UnexpectedAnswerError`; a wait that ran out is
:class:`WaitTimeoutError`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import httpx

from corral.shared.errors import CorralError

_MAX_TEXT = 500  # of an answer that is not the api's JSON (a proxy's page, say)
# The code of an answer that names none (401, 404 and most 409s say only a detail).
_CODES = {401: "unauthorized", 403: "forbidden", 404: "not_found", 409: "conflict"}


class ClientError(CorralError):
    """a call to corral's api failed"""

    code = "client_error"


class ClientConfigError(ClientError, ValueError):
    """the client's api URL or token is missing or wrong"""

    code = "client_config"


class ApiUnreachableError(ClientError, ConnectionError):
    """the api could not be reached"""

    code = "api_unreachable"


class WaitTimeoutError(ClientError, TimeoutError):
    """a work item did not end within the time waited"""

    code = "wait_timeout"

    def __init__(self, item_id: str, timeout_s: float, state: str) -> None:
        super().__init__(f"work item {item_id} did not end within {timeout_s:g} s (it is {state})")
        self.item_id = item_id
        self.state = state


class BundleDigestError(ClientError):
    """the downloaded bundle is not the one the api said it sent"""

    code = "bundle_digest"


class UnexpectedAnswerError(ClientError):
    """the api's answer is not what this client reads"""

    code = "unexpected_answer"


@dataclass(frozen=True)
class Problem:
    """One thing the api found wrong: where (a field path) and what."""

    field: str
    message: str


class ApiError(ClientError):
    """the api refused the call"""

    code = "api_error"

    def __init__(
        self, status: int, error: str, message: str, problems: Sequence[Problem] = ()
    ) -> None:
        super().__init__(f"HTTP {status} {error}: {message}")
        self.status = status
        self.error = error  # the api's code: invalid_message, bundle_changed, not_found…
        self.detail = message
        self.problems = tuple(problems)


class UnauthorizedError(ApiError):
    """401: no valid token"""


class ForbiddenError(ApiError):
    """403: the token may not do this (another org's, or a scope it lacks)"""


class NotFoundError(ApiError):
    """404: no such item, or not the caller's to see"""


class ConflictError(ApiError):
    """409: not possible in the item's state (``error`` says why)"""


class InvalidRequestError(ApiError):
    """413 or 422: the request is refused as it is (``problems`` name the fields)"""


class UnavailableError(ApiError):
    """503: the api cannot serve now (its database, or admin endpoints disabled)"""


_BY_STATUS: dict[int, type[ApiError]] = {
    401: UnauthorizedError,
    403: ForbiddenError,
    404: NotFoundError,
    409: ConflictError,
    413: InvalidRequestError,
    422: InvalidRequestError,
    503: UnavailableError,
}


def _problems(detail: Any) -> list[Problem]:
    if not isinstance(detail, list):
        return []
    return [
        Problem(str(entry.get("field", "")), str(entry.get("message", "")))
        for entry in detail
        if isinstance(entry, dict)
    ]


def api_error(response: httpx.Response) -> ApiError:
    """The exception for an answer the api refused, read from its body's one of two shapes:
    ``{"error", "detail": [{"field", "message"}]}`` or ``{"detail": "..."}``."""
    status = response.status_code
    try:
        body = response.json()
    except ValueError:
        body = None
    if not isinstance(body, dict):
        text = response.text[:_MAX_TEXT] or response.reason_phrase
        return _BY_STATUS.get(status, ApiError)(status, _CODES.get(status, f"http_{status}"), text)
    detail = body.get("detail")
    problems = _problems(detail)
    if problems:
        message = "; ".join(f"{p.field}: {p.message}" for p in problems)
    else:
        message = str(detail if detail is not None else response.reason_phrase)
    error = str(body.get("error") or _CODES.get(status, f"http_{status}"))
    return _BY_STATUS.get(status, ApiError)(status, error, message, problems)
