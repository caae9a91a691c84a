"""The work-item clients: :class:`Client` on ``httpx.Client``, :class:`AsyncClient` on
``httpx.AsyncClient``, the same calls (written once in :mod:`.calls`) sent or awaited.

    with Client() as corral:  # CORRAL_API_URL and CORRAL_API_KEY, or `corral dev`'s files
        sent = corral.dispatch({"org": "acme", "project": "web", "profile": "default",
                                "work": {"kind": "shell", "command": "make test"}})
        for line in corral.logs(sent.id, follow=True):
            print(line.stream, line.line)
        print(corral.wait(sent.id, timeout_s=600).state)
"""

from __future__ import annotations

import builtins
import os
from collections.abc import AsyncIterator, Iterator, Mapping
from types import TracebackType
from typing import Any, Unpack

import httpx

from corral.client import steps
from corral.client.calls import Dispatched, ItemCalls, ItemFilters, Retry
from corral.client.target import Target, async_transport, find_target, sync_transport
from corral.scheduler.admin.responses import (
    BundleReviewed,
    Cancelled,
    LifecycleEventView,
    LogLineView,
    WorkItemRow,
    WorkItemView,
)
from corral.shared.messages import DispatchRequest

TIMEOUT_S = 30.0  # a request's, but for the waits, which the api holds longer
POLL_S = 1.0  # how often a followed log is read while its item runs


class _Configured:
    """What both clients hold: the api, its token, the calls and their retry policy."""

    def __init__(self, api_url: str | None, token: str | None, retry: Retry | None) -> None:
        self._calls = ItemCalls(find_target(api_url, token), retry or Retry())

    @property
    def target(self) -> Target:
        """The api this client calls (its token is not in the repr)."""
        return self._calls.target

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.target.url!r})"


class Client(_Configured):
    """A client of corral's work-item api, on ``httpx.Client``; use it in ``with``.

    ``api_url`` and ``token`` (an org key or the admin token) default to ``CORRAL_API_URL``
    and ``CORRAL_API_KEY`` (else ``CORRAL_ADMIN_TOKEN``), then to the files ``corral dev``
    writes. Every method raises :class:`~corral.client.errors.ApiError` (a subclass per
    status) when the api refuses, and
    :class:`~corral.client.errors.ApiUnreachableError` when it cannot be reached.

    Raises:
        ClientConfigError: no token was given or found.
    """

    def __init__(
        self,
        api_url: str | None = None,
        token: str | None = None,
        *,
        transport: httpx.BaseTransport | None = None,
        timeout_s: float = TIMEOUT_S,
        retry: Retry | None = None,
    ) -> None:
        super().__init__(api_url, token, retry)
        mount = transport or sync_transport(self.target)
        self._http = httpx.Client(transport=mount, timeout=timeout_s)

    def dispatch(
        self, message: Mapping[str, Any] | DispatchRequest, *, idempotency_key: str | None = None
    ) -> Dispatched:
        """Send one dispatch message; the item's id and state.

        It goes with an idempotency key: ``idempotency_key``, else the message's, else a new
        uuid. The answer names it; dispatching again with it answers the same item, so a
        dispatch is retried safely (and is, after a connection error or a 503).
        """
        return steps.run(self._http, self._calls.dispatch(message, idempotency_key))

    def get(self, item_id: str) -> WorkItemView:
        """The item now."""
        return steps.run(self._http, self._calls.get(item_id))

    def wait(self, item_id: str, timeout_s: float | None = None) -> WorkItemView:
        """The item once it is final (succeeded, failed, cancelled, dispatch_error).

        Raises:
            WaitTimeoutError: not final within ``timeout_s`` (None: no limit).
        """
        return steps.run(self._http, self._calls.wait(item_id, timeout_s))

    def list(self, **filters: Unpack[ItemFilters]) -> Iterator[WorkItemRow]:
        """The items the filters select, newest first, read a page (``limit``) at a time."""
        return steps.iterate(self._http, self._calls.listing(filters))

    def logs(
        self,
        item_id: str,
        *,
        follow: bool = False,
        poll_interval_s: float = POLL_S,
        after: int = 0,
    ) -> Iterator[LogLineView]:
        """The item's log lines (those after line id ``after``); ``follow``: new ones as they
        come, until it is final."""
        calls = self._calls.logs(item_id, follow, poll_interval_s, after)
        return steps.iterate(self._http, calls)

    def events(self, item_id: str) -> builtins.list[LifecycleEventView]:
        """Every lifecycle event of the item, its sandboxes and its bundle, oldest first."""
        return steps.run(self._http, self._calls.events(item_id))

    def cancel(self, item_id: str) -> Cancelled:
        """Cancel the item; a final item is left as it is (its state is answered)."""
        return steps.run(self._http, self._calls.cancel(item_id))

    def bundle(self, item_id: str, to: str | os.PathLike[str]) -> str:
        """Download the item's result bundle (a gzipped tar) into ``to``; its SHA-256, to
        name in :meth:`accept_bundle` or :meth:`reject_bundle`.

        Raises:
            NotFoundError: the item has no bundle.
            BundleDigestError: the bytes are not those the api said it sent.
        """
        return steps.run(self._http, self._calls.bundle(item_id, to))

    def accept_bundle(self, item_id: str, sha256: str) -> BundleReviewed:
        """Accept the bundle held for review, the one ``sha256`` names (needs ``review``).

        Raises:
            ConflictError: ``bundle_changed``, ``item_running`` or ``bundle_conflict``.
        """
        return steps.run(self._http, self._calls.decide(item_id, "accept", sha256))

    def reject_bundle(self, item_id: str, sha256: str) -> BundleReviewed:
        """Reject the bundle held for review, the one ``sha256`` names (needs ``review``).

        Raises:
            ConflictError: ``bundle_changed``, ``item_running`` or ``bundle_conflict``.
        """
        return steps.run(self._http, self._calls.decide(item_id, "reject", sha256))

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()


class AsyncClient(_Configured):
    """:class:`Client` for asyncio: the same calls, awaited (``list`` and ``logs`` are
    async iterators); use it in ``async with``."""

    def __init__(
        self,
        api_url: str | None = None,
        token: str | None = None,
        *,
        transport: httpx.AsyncBaseTransport | None = None,
        timeout_s: float = TIMEOUT_S,
        retry: Retry | None = None,
    ) -> None:
        super().__init__(api_url, token, retry)
        mount = transport or async_transport(self.target)
        self._http = httpx.AsyncClient(transport=mount, timeout=timeout_s)

    async def dispatch(
        self, message: Mapping[str, Any] | DispatchRequest, *, idempotency_key: str | None = None
    ) -> Dispatched:
        return await steps.run_async(self._http, self._calls.dispatch(message, idempotency_key))

    async def get(self, item_id: str) -> WorkItemView:
        return await steps.run_async(self._http, self._calls.get(item_id))

    async def wait(self, item_id: str, timeout_s: float | None = None) -> WorkItemView:
        return await steps.run_async(self._http, self._calls.wait(item_id, timeout_s))

    def list(self, **filters: Unpack[ItemFilters]) -> AsyncIterator[WorkItemRow]:
        return steps.iterate_async(self._http, self._calls.listing(filters))

    def logs(
        self,
        item_id: str,
        *,
        follow: bool = False,
        poll_interval_s: float = POLL_S,
        after: int = 0,
    ) -> AsyncIterator[LogLineView]:
        calls = self._calls.logs(item_id, follow, poll_interval_s, after)
        return steps.iterate_async(self._http, calls)

    async def events(self, item_id: str) -> builtins.list[LifecycleEventView]:
        return await steps.run_async(self._http, self._calls.events(item_id))

    async def cancel(self, item_id: str) -> Cancelled:
        return await steps.run_async(self._http, self._calls.cancel(item_id))

    async def bundle(self, item_id: str, to: str | os.PathLike[str]) -> str:
        return await steps.run_async(self._http, self._calls.bundle(item_id, to))

    async def accept_bundle(self, item_id: str, sha256: str) -> BundleReviewed:
        return await steps.run_async(self._http, self._calls.decide(item_id, "accept", sha256))

    async def reject_bundle(self, item_id: str, sha256: str) -> BundleReviewed:
        return await steps.run_async(self._http, self._calls.decide(item_id, "reject", sha256))

    async def aclose(self) -> None:
        await self._http.aclose()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        await self.aclose()
