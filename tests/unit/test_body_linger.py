"""The body limit's lingering read before a 413: it drops at most LINGER_BYTES more of a
body and waits at most LINGER_S, so a client cannot hold the api by trickling or by sending
far past the limit."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from corral.scheduler.api import bodies
from corral.shared.settings import CoreSettings

LIMIT = 1000


async def _refuse(
    headers: list[tuple[bytes, bytes]], parts: Any, *, handles: bool = False
) -> tuple[int, int]:
    """Send a request through the middleware (the app behind it reads the whole body and,
    if it ``handles`` the refusal, answers 413 itself, as FastAPI's handler does); the
    status answered and how many body parts the middleware asked for."""
    asked = 0
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        nonlocal asked
        asked += 1
        return await parts()

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    async def app(_scope: Any, receive_: Any, send_: Any) -> None:
        try:
            while (await receive_()).get("more_body"):
                pass
        except bodies.BodyTooLargeError:
            if not handles:
                raise
            await send_({"type": "http.response.start", "status": 413, "headers": []})
            await send_({"type": "http.response.body", "body": b""})

    middleware = bodies.BodyLimitMiddleware(
        app, settings=lambda: CoreSettings(api_body_limit_default=LIMIT)
    )
    scope = {"type": "http", "path": "/v1/admin/pools", "headers": headers}
    await asyncio.wait_for(middleware(scope, receive, send), timeout=30)
    return sent[0]["status"], asked


def _endless(size: int) -> Any:
    async def part() -> dict[str, Any]:
        return {"type": "http.request", "body": b"x" * size, "more_body": True}

    return part


def _silent() -> Any:
    async def part() -> dict[str, Any]:
        await asyncio.Event().wait()  # never comes
        raise AssertionError

    return part


@pytest.mark.parametrize(("declared", "handles"), [(True, False), (False, False), (False, True)])
def test_a_body_past_its_limit_is_read_at_most_linger_bytes_further(
    declared: bool, handles: bool
) -> None:
    headers = [(b"content-length", str(LIMIT + bodies.LINGER_BYTES).encode())] if declared else []
    status, asked = asyncio.run(_refuse(headers, _endless(1024), handles=handles))
    assert status == 413
    # Declared: nothing is read for the app, at most LINGER_BYTES by the drain. Chunked: the
    # app reads just past the limit (2 parts), the drain LINGER_BYTES more.
    most = bodies.LINGER_BYTES // 1024 + (0 if declared else 2)
    assert most - 1 <= asked <= most + 1


def test_a_body_declared_far_past_its_limit_is_refused_unread() -> None:
    headers = [(b"content-length", str(LIMIT + bodies.LINGER_BYTES + 1).encode())]
    assert asyncio.run(_refuse(headers, _endless(1024))) == (413, 0)


def test_a_client_waiting_to_be_asked_for_its_body_is_answered_without_it() -> None:
    # Reading would make the server send "100 Continue", and the client its whole body.
    headers = [(b"content-length", str(LIMIT + 1).encode()), (b"expect", b"100-continue")]
    assert asyncio.run(_refuse(headers, _endless(1024))) == (413, 0)


@pytest.mark.parametrize("declared", [True, False])
def test_a_client_that_stops_sending_is_answered_after_linger_s(
    monkeypatch: pytest.MonkeyPatch, declared: bool
) -> None:
    monkeypatch.setattr(bodies, "LINGER_S", 0.05)
    first = True

    async def part() -> dict[str, Any]:  # chunked: one part past the limit, then silence
        nonlocal first
        if first and not declared:
            first = False
            return {"type": "http.request", "body": b"x" * (LIMIT + 1), "more_body": True}
        return await _silent()()

    headers = [(b"content-length", str(LIMIT + 1).encode())] if declared else []
    status, _ = asyncio.run(_refuse(headers, part))
    assert status == 413
