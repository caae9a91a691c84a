"""The api's error answers: one shape, ``{"error": code, "detail": [{"field", "message"}]}``,
and never a value the client sent nor a traceback.

- 413 ``body_too_large`` (:mod:`corral.scheduler.api.bodies`), 422 ``invalid_request`` /
  ``invalid_message``, 429 ``rate_limited`` (:mod:`corral.scheduler.api.throttle`);
- 409 with a code where the caller's next step depends on it (:class:`Conflict`; other
  409s are ``{"detail": "..."}``);
- 503 ``database_unavailable`` with ``Retry-After`` while the database cannot be reached;
- 500 ``internal_error`` for anything unexpected (logged, with its traceback, server-side).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

from fastapi import FastAPI, HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field
from sqlalchemy.exc import DataError, DBAPIError, DisconnectionError, InterfaceError
from sqlalchemy.exc import OperationalError as DatabaseOperationalError
from sqlalchemy.exc import TimeoutError as PoolTimeoutError

from corral.shared.messages import error_message, field_path, schema_names

log = logging.getLogger(__name__)

DATABASE_RETRY_AFTER_S = 5
# The words FastAPI puts first in a parameter's location.
_LOCATIONS = frozenset({"body", "query", "path", "header", "cookie"})


class Problem(BaseModel):
    field: str = Field(description="where: a field path, (body), (request) or (service)")
    message: str


class ErrorAnswer(BaseModel):
    """Every error answer of the api but 401, 404 and most 409s."""

    model_config = ConfigDict(extra="allow")  # 413 adds limit_bytes

    error: str = Field(
        description="a code: invalid_request, invalid_message, body_too_large, "
        "rate_limited, database_unavailable, admin_disabled, internal_error"
    )
    detail: list[Problem]


class PlainError(BaseModel):
    """401, 404 and 409: what went wrong, in a word or two."""

    detail: str


# The error answers every route may give, documented so that clients (and the schema
# fuzz test) know their shape.
ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    401: {"model": PlainError, "description": "No valid token."},
    404: {"model": PlainError, "description": "Not found, or not the caller's to see."},
    409: {"model": PlainError, "description": "Not possible in the item's state."},
    413: {"model": ErrorAnswer, "description": "The body is over this route's limit."},
    422: {"model": ErrorAnswer, "description": "Invalid input; values are never echoed."},
    429: {"model": ErrorAnswer, "description": "Too many runner calls; see Retry-After."},
    500: {"model": ErrorAnswer, "description": "An unexpected error (logged)."},
    503: {
        "model": ErrorAnswer,
        "description": "The database is unreachable (see "
        "Retry-After), or admin endpoints are disabled.",
    },
}


# A route whose 409 may say why in the error shape (:class:`Conflict`: a code and a
# field), or, as every route's, in a word or two.
CONFLICT_ANSWER: dict[int | str, dict[str, Any]] = {
    409: {
        "model": ErrorAnswer | PlainError,
        "description": "Not possible now: its error says why (for a capacity: "
        "capacity_name_taken, capacity_in_use; for a pool: capacity_already_linked).",
    }
}


class ServiceUnavailable(HTTPException):
    """A 503 in the error shape."""

    def __init__(self, error: str, message: str) -> None:
        super().__init__(status_code=503, detail=message)
        self.error = error
        self.message = message


def problem(
    status: int,
    error: str,
    field: str,
    message: str,
    *,
    headers: Mapping[str, str] | None = None,
    **extra: Any,
) -> JSONResponse:
    """An error answer with one problem."""
    content = {"error": error, "detail": [{"field": field, "message": message}], **extra}
    return JSONResponse(status_code=status, content=content, headers=dict(headers or {}))


class Conflict(HTTPException):
    """A 409 in the error shape: the request is not possible now, for the reason ``error``
    names (a route documents its codes)."""

    def __init__(self, error: str, field: str, message: str) -> None:
        super().__init__(status_code=409, detail=message)
        self.error, self.field, self.message = error, field, message


class InvalidFields(HTTPException):
    """A 422 with these problems, raised from anywhere in a request (an HTTPException, so
    FastAPI passes it on even while it reads the body)."""

    def __init__(self, problems: list[dict[str, str]], *, error: str = "invalid_request") -> None:
        super().__init__(status_code=422, detail=error)
        self.problems = problems
        self.error = error


class InvalidRequest(InvalidFields):
    """A 422 with one problem."""

    def __init__(self, field: str, message: str, *, error: str = "invalid_request") -> None:
        super().__init__([{"field": field, "message": message}], error=error)


def install_handlers(api: FastAPI) -> None:
    """The exception handlers that give every error answer the shape above."""
    names: list[frozenset[str]] = []

    def known_names() -> frozenset[str]:
        if not names:  # the OpenAPI document is complete only once every route is added
            names.append(schema_names(api.openapi()) | _LOCATIONS)
        return names[0]

    def invalid(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, RequestValidationError)
        errors = [
            {
                "field": field_path(
                    _without_body(e["loc"]),
                    known_names(),
                    unknown_key=e.get("type") == "extra_forbidden",
                ),
                "message": error_message(e),
            }
            for e in exc.errors()
        ]
        return _invalid_fields(request, InvalidFields(errors))

    api.add_exception_handler(RequestValidationError, invalid)
    api.add_exception_handler(InvalidFields, _invalid_fields)
    api.add_exception_handler(ServiceUnavailable, _service_unavailable)
    api.add_exception_handler(Conflict, _conflict)
    for unavailable in (
        DatabaseOperationalError,
        InterfaceError,
        DisconnectionError,
        PoolTimeoutError,
    ):
        api.add_exception_handler(unavailable, _database_unavailable)
    api.add_exception_handler(DataError, _unstorable)
    api.add_exception_handler(DBAPIError, _database_error)
    api.add_exception_handler(Exception, _internal_error)


def _without_body(loc: Sequence[Any]) -> Sequence[Any]:
    # A body field is named as in the body ("lines.0.line"); parameters keep their
    # location ("query.org").
    return loc[1:] if loc and loc[0] == "body" else loc


def _invalid_fields(_: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, InvalidFields)
    return JSONResponse(status_code=422, content={"error": exc.error, "detail": exc.problems})


def _service_unavailable(_: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, ServiceUnavailable)
    return problem(503, exc.error, "(service)", exc.message)


def _conflict(_: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, Conflict)
    return problem(409, exc.error, exc.field, exc.message)


def _database_unavailable(request: Request, exc: Exception) -> JSONResponse:
    log.warning(
        "database unavailable: %s %s answered 503 (%s)",
        request.method,
        request.url.path,
        type(exc).__name__,
    )
    return problem(
        503,
        "database_unavailable",
        "(service)",
        "the database cannot be reached; retry later",
        headers={"Retry-After": str(DATABASE_RETRY_AFTER_S)},
    )


def _database_error(request: Request, exc: Exception) -> JSONResponse:
    if isinstance(exc, DBAPIError) and exc.connection_invalidated:
        return _database_unavailable(request, exc)
    log.error("database error: %s %s answered 500", request.method, request.url.path, exc_info=exc)
    return _internal_error(request, exc)


def _unstorable(request: Request, exc: Exception) -> JSONResponse:
    # The last line of defence: validation should have refused the value before.
    log.warning(
        "a value the database refused: %s %s answered 422",
        request.method,
        request.url.path,
        exc_info=exc,
    )
    return problem(
        422,
        "invalid_request",
        "(body)",
        "a value cannot be stored: out of range, too long or holding characters the "
        "database refuses",
    )


def _internal_error(_: Request, exc: Exception) -> JSONResponse:
    # Starlette raises the exception on after this answer, and uvicorn logs its traceback.
    return problem(500, "internal_error", "(service)", "the api failed; the error is logged")
