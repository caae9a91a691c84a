"""A call written once for both clients: a generator of steps, and a driver per transport.

A call yields what it needs done and is answered: an HTTP request (answered with the
response), a :class:`Download` (a request whose body goes to a sink; answered with the
response), a pause in seconds (answered with None), and, in a call that iterates, an
:class:`Emit` holding a value for the caller (answered with None). A connection error is
raised inside the call at the step that sent it, so that the call decides whether to retry.
:func:`run` and :func:`iterate` drive a call with ``httpx.Client``, :func:`run_async` and
:func:`iterate_async` with ``httpx.AsyncClient``: only the transport differs.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncGenerator, AsyncIterator, Generator, Iterator
from dataclasses import dataclass
from typing import Any, Generic, Protocol, TypeVar

import httpx

T = TypeVar("T")
R = TypeVar("R")


class Sink(Protocol):
    """Where a download's bytes go; emptied again before a retry."""

    def write(self, chunk: bytes) -> None: ...

    def reset(self) -> None: ...


@dataclass(frozen=True)
class Download:
    """A GET whose 200 body is streamed into ``sink`` (any other answer is read whole)."""

    request: httpx.Request
    sink: Sink


@dataclass(frozen=True)
class Emit(Generic[T]):
    """A value an iterating call hands to its caller."""

    value: T


Step = httpx.Request | Download | float
Answer = httpx.Response | None
# A call: yields steps, is answered with responses (None after a pause), returns its result.
Steps = Generator[Step, Answer, T]
# An iterating call: also yields values for the caller; returns R (None at the top).
Flow = Generator[Step | Emit[T], Answer, R]


@dataclass(frozen=True)
class _Done(Generic[T]):
    value: T


def _advance(call: Generator[Any, Answer, Any], answer: Answer | httpx.TransportError) -> Any:
    """The call's next step (or :class:`_Done`), given the last one's answer or error."""
    try:
        if isinstance(answer, httpx.TransportError):
            return call.throw(answer)
        return call.send(answer)
    except StopIteration as done:
        return _Done(done.value)


def _perform(client: httpx.Client, step: Step) -> Answer | httpx.TransportError:
    try:
        if isinstance(step, httpx.Request):
            return client.send(step)
        if isinstance(step, Download):
            got = client.send(step.request, stream=True)
            try:
                if got.status_code == 200:
                    for chunk in got.iter_bytes():
                        step.sink.write(chunk)
                else:
                    got.read()
            finally:
                got.close()
            return got
    except httpx.TransportError as error:
        return error
    time.sleep(step)  # a pause, in seconds (an int too)
    return None


async def _perform_async(client: httpx.AsyncClient, step: Step) -> Answer | httpx.TransportError:
    try:
        if isinstance(step, httpx.Request):
            return await client.send(step)
        if isinstance(step, Download):
            got = await client.send(step.request, stream=True)
            try:
                if got.status_code == 200:
                    async for chunk in got.aiter_bytes():
                        step.sink.write(chunk)
                else:
                    await got.aread()
            finally:
                await got.aclose()
            return got
    except httpx.TransportError as error:
        return error
    await asyncio.sleep(step)
    return None


def _drive(client: httpx.Client, call: Flow[T, R]) -> Generator[Emit[T] | _Done[R], None, None]:
    answer: Answer | httpx.TransportError = None
    while not isinstance(step := _advance(call, answer), _Done):
        answer = None
        if isinstance(step, Emit):
            yield step
        else:
            answer = _perform(client, step)
    yield step


async def _drive_async(
    client: httpx.AsyncClient, call: Flow[T, R]
) -> AsyncGenerator[Emit[T] | _Done[R], None]:
    answer: Answer | httpx.TransportError = None
    while not isinstance(step := _advance(call, answer), _Done):
        answer = None
        if isinstance(step, Emit):
            yield step
        else:
            answer = await _perform_async(client, step)
    yield step


def run(client: httpx.Client, call: Steps[T]) -> T:
    """Drive ``call`` to its end with ``client``; its result."""
    outs: Iterator[Emit[Any] | _Done[T]] = _drive(client, call)
    for out in outs:
        if isinstance(out, _Done):
            return out.value
    raise AssertionError("a driven call always ends")  # pragma: no cover


def iterate(client: httpx.Client, call: Flow[T, None]) -> Iterator[T]:
    """Drive ``call`` with ``client``, handing on each value it emits."""
    return (out.value for out in _drive(client, call) if isinstance(out, Emit))


async def run_async(client: httpx.AsyncClient, call: Steps[T]) -> T:
    """:func:`run` with ``httpx.AsyncClient``."""
    driven: AsyncGenerator[Emit[Any] | _Done[T], None] = _drive_async(client, call)
    async with contextlib.aclosing(driven) as outs:
        async for out in outs:
            if isinstance(out, _Done):
                return out.value
    raise AssertionError("a driven call always ends")  # pragma: no cover


async def iterate_async(client: httpx.AsyncClient, call: Flow[T, None]) -> AsyncIterator[T]:
    """:func:`iterate` with ``httpx.AsyncClient``."""
    async with contextlib.aclosing(_drive_async(client, call)) as outs:
        async for out in outs:
            if isinstance(out, Emit):
                yield out.value
