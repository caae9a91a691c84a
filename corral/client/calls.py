"""The work-item calls, each written once as a generator of steps (:mod:`.steps`).

What a call sends, how it retries and how its answer reads live here; :class:`~.items.Client`
and :class:`~.items.AsyncClient` only drive them. Retried, with back-off, on a connection
error or a 503: the reads, and the calls the api makes idempotent — a dispatch with an
idempotency key (always set), cancel (a final item is left as it is) and a bundle decision
(the same decision again answers the same).
"""

from __future__ import annotations

import hashlib
import os
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import IO, Any, Literal, TypedDict, TypeVar
from urllib.parse import quote

import httpx
from pydantic import BaseModel, Field

from corral.client.errors import (
    ApiUnreachableError,
    BundleDigestError,
    UnexpectedAnswerError,
    WaitTimeoutError,
    api_error,
)
from corral.client.steps import Answer, Download, Emit, Flow, Steps
from corral.client.target import Target
from corral.scheduler.admin import responses
from corral.shared.messages import DispatchRequest

M = TypeVar("M", bound=BaseModel)

MAX_WAIT_S = 60.0  # the api holds a wait at most this long
SLACK_S = 30.0  # a held request's read timeout: the wait and this
BUNDLE_SHA256 = "X-Corral-Bundle-Sha256"


class Dispatched(responses.Dispatched):
    """The api's answer to a dispatch, and the idempotency key it was sent with."""

    idempotency_key: str = Field(
        description="dispatching again with this key answers this item, never a new one"
    )


# The api's model names ItemError before defining it: resolved in the api's module.
Dispatched.model_rebuild(_types_namespace=vars(responses))


@dataclass(frozen=True)
class Retry:
    """How often a retried call is sent again, and how long it pauses before each."""

    attempts: int = 4  # sends in all
    backoff_s: float = 0.5  # before the first resend; doubled for each next
    max_backoff_s: float = 10.0

    def pause(self, sent: int, retry_after: str | None) -> float:
        """The pause before the next send, after ``sent`` sends (the api's ``Retry-After``
        when it says more, within ``max_backoff_s``)."""
        pause = self.backoff_s * 2.0 ** (sent - 1)
        if retry_after is not None and retry_after.isdigit():
            pause = max(pause, float(retry_after))
        return min(pause, self.max_backoff_s)


def _query(filters: Mapping[str, Any]) -> list[tuple[str, str]]:
    """Query parameters: None left out, a list repeated, a datetime in ISO 8601."""
    params = []
    for name, value in filters.items():
        values = value if isinstance(value, list | tuple | set | frozenset) else [value]
        for one in values:
            if one is not None:
                params.append((name, one.isoformat() if isinstance(one, datetime) else str(one)))
    return params


class ItemFilters(TypedDict, total=False):
    """What ``GET /v1/work-items`` selects by; ``limit`` is the page size (1 to 200)."""

    org: str
    project: str
    state: str | Sequence[str]  # one state, or any of several
    idempotency_key: str
    task_id: str  # the Celery task id of the corral.dispatch message that made it
    created_after: datetime
    created_before: datetime
    provider: str
    pool: str
    limit: int


def parse(model: type[M], answer: httpx.Response, **added: Any) -> M:
    """The answer's JSON (and ``added``) as ``model``, the api's own answer model.

    Raises:
        UnexpectedAnswerError: it does not read as the model.
    """
    try:
        return model.model_validate({**answer.json(), **added})
    except (ValueError, TypeError) as exc:  # pydantic's ValidationError is a ValueError
        where = f"{answer.request.method} {answer.request.url.path}"
        raise UnexpectedAnswerError(
            f"{where}: the answer does not read as {model.__name__} (is this client older "
            "than the api? keep them at one version)"
        ) from exc


class _FileSink:
    """A download into ``file``, hashed as it comes."""

    def __init__(self, file: IO[bytes]) -> None:
        self.file = file
        self.digest = hashlib.sha256()

    def write(self, chunk: bytes) -> None:
        self.file.write(chunk)
        self.digest.update(chunk)

    def reset(self) -> None:
        self.file.seek(0)
        self.file.truncate()
        self.digest = hashlib.sha256()


@dataclass(frozen=True)
class ItemCalls:
    """The requests of each work-item call, and how their answers read; no transport."""

    target: Target
    retry: Retry = Retry()

    def request(self, method: str, path: str, **kwargs: Any) -> httpx.Request:
        headers = {"Authorization": f"Bearer {self.target.token}", **kwargs.pop("headers", {})}
        return httpx.Request(method, self.target.base_url + path, headers=headers, **kwargs)

    def send(self, step: httpx.Request | Download, *expected: int) -> Steps[httpx.Response]:
        """Send ``step``, again after a connection error or a 503 (every call here may be
        sent twice: module docstring); the answer, once it has an expected status.

        Raises:
            ApiError: the api refused it (a subclass for its status).
            ApiUnreachableError: no answer, after the retries.
        """
        request = step.request if isinstance(step, Download) else step
        sent = 0
        while True:
            if isinstance(step, Download):
                step.sink.reset()
            sent += 1
            last = sent >= self.retry.attempts
            try:
                answer: Answer = yield step
            except httpx.TransportError as error:
                if last:
                    where = f"{request.method} {request.url.path}"
                    raise ApiUnreachableError(
                        f"{where}: {type(error).__name__}: {error}"
                    ) from error
                yield self.retry.pause(sent, None)
                continue
            assert answer is not None
            if answer.status_code == 503 and not last:
                yield self.retry.pause(sent, answer.headers.get("Retry-After"))
                continue
            if answer.status_code not in expected:
                raise api_error(answer)
            return answer

    def read(self, model: type[M], path: str, **kwargs: Any) -> Steps[M]:
        """GET ``path``, its answer as ``model``."""
        answer = yield from self.send(self.request("GET", path, **kwargs), 200)
        return parse(model, answer)

    def post(self, model: type[M], path: str, body: Any = None) -> Steps[M]:
        """POST ``path`` (a call the api makes idempotent), its answer as ``model``."""
        answer = yield from self.send(self.request("POST", path, json=body), 200)
        return parse(model, answer)

    # -- the calls -----------------------------------------------------------------------

    def dispatch(
        self, message: Mapping[str, Any] | DispatchRequest, idempotency_key: str | None
    ) -> Steps[Dispatched]:
        if isinstance(message, DispatchRequest):
            body = message.model_dump(mode="json", exclude_unset=True)
        else:
            body = dict(message)
        key = idempotency_key or body.get("idempotency_key") or str(uuid.uuid4())
        request = self.request("POST", "/v1/dispatch", json=body, headers={"Idempotency-Key": key})
        answer = yield from self.send(request, 200, 202)
        return parse(Dispatched, answer, idempotency_key=key)

    def get(self, item_id: str, wait_s: float = 0.0) -> Steps[responses.WorkItemView]:
        """The item; with ``wait_s``, once it is final or that has passed."""
        if wait_s <= 0:
            return (yield from self.read(responses.WorkItemView, _item(item_id)))
        timeout = httpx.Timeout(SLACK_S, read=wait_s + SLACK_S).as_dict()
        return (
            yield from self.read(
                responses.WorkItemView,
                _item(item_id),
                params={"wait": f"{wait_s:.3f}"},
                extensions={"timeout": timeout},
            )
        )

    def hold(self, item_id: str, wait_s: float) -> Steps[responses.WorkItemView]:
        """:meth:`get` with a wait, and a pause when the api answered early with the item
        not final (a process holds a bounded number of waits, past it answers at once)."""
        started = time.monotonic()
        view = yield from self.get(item_id, wait_s)
        early = time.monotonic() - started < wait_s / 2
        if early and not view.state.is_final:
            yield min(1.0, wait_s)
        return view

    def wait(self, item_id: str, timeout_s: float | None) -> Steps[responses.WorkItemView]:
        """The item once it is final, asking at most :data:`MAX_WAIT_S` a request.

        Raises:
            WaitTimeoutError: not final within ``timeout_s``.
        """
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            left = MAX_WAIT_S if deadline is None else deadline - time.monotonic()
            view = yield from self.hold(item_id, max(0.0, min(MAX_WAIT_S, left)))
            if view.state.is_final:
                return view
            if deadline is not None and time.monotonic() >= deadline:
                raise WaitTimeoutError(item_id, timeout_s or 0.0, view.state)

    def listing(self, filters: ItemFilters) -> Flow[responses.WorkItemRow, None]:
        """Every item the filters select, newest first, a page a request."""
        params = _query(filters)
        cursor: str | None = None
        while True:
            query = params if cursor is None else [*params, ("cursor", cursor)]
            page = yield from self.read(responses.WorkItemList, "/v1/work-items", params=query)
            for row in page.items:
                yield Emit(row)
            if page.next_cursor is None:
                return
            cursor = page.next_cursor

    def drain(self, item_id: str, after: int) -> Flow[responses.LogLineView, int]:
        """The stored log lines after line ``after``, to the last; the last one's id."""
        while True:
            page = yield from self.read(
                responses.WorkItemLogs, f"{_item(item_id)}/logs", params={"after": after}
            )
            if not page.lines:
                return after
            for line in page.lines:
                yield Emit(line)
            after = page.lines[-1].id

    def logs(
        self, item_id: str, follow: bool, poll_s: float, after: int = 0
    ) -> Flow[responses.LogLineView, None]:
        """The item's log lines after line ``after``; ``follow``: until it is final and its
        lines are read."""
        final = not follow or (yield from self.get(item_id)).state.is_final
        while True:
            after = yield from self.drain(item_id, after)
            if final:  # known before the lines were read: none can come after them
                return
            final = (yield from self.hold(item_id, poll_s)).state.is_final

    def events(self, item_id: str) -> Steps[list[responses.LifecycleEventView]]:
        answer = yield from self.read(responses.WorkItemEvents, f"{_item(item_id)}/events")
        return answer.events

    def cancel(self, item_id: str) -> Steps[responses.Cancelled]:
        return (yield from self.post(responses.Cancelled, f"{_item(item_id)}/cancel"))

    def decide(
        self, item_id: str, decision: Literal["accept", "reject"], sha256: str
    ) -> Steps[responses.BundleReviewed]:
        path = f"{_item(item_id)}/bundle/{decision}"
        return (yield from self.post(responses.BundleReviewed, path, {"sha256": sha256}))

    def bundle(self, item_id: str, to: str | os.PathLike[str]) -> Steps[str]:
        """Stream the bundle into the file ``to`` (whole or not at all); its SHA-256.

        Raises:
            BundleDigestError: the bytes are not those the api said it sent.
        """
        target = Path(to)
        partial = target.with_name(f".{target.name}.part")
        try:
            with partial.open("wb") as file:
                sink = _FileSink(file)
                request = self.request("GET", f"{_item(item_id)}/bundle")
                answer = yield from self.send(Download(request, sink), 200)
            digest = sink.digest.hexdigest()
            stated = answer.headers.get(BUNDLE_SHA256)
            if stated is not None and stated != digest:
                raise BundleDigestError(f"{BUNDLE_SHA256} says {stated}, the bytes are {digest}")
            partial.replace(target)
        finally:
            partial.unlink(missing_ok=True)
        return digest


def _item(item_id: str) -> str:
    return f"/v1/work-items/{quote(item_id, safe='')}"
