"""corral.client's drivers: a pause given as an int is a pause, not a request to send."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx

from corral.client import AsyncSession, Session


def _api() -> tuple[list[str], Any]:
    """An answering function for httpx.MockTransport: the session is provisioning at its
    creation and ready at the first read; the requests it saw."""
    seen: list[str] = []

    def answer(request: httpx.Request) -> httpx.Response:
        seen.append(f"{request.method} {request.url.path}")
        state = "provisioning" if request.method == "POST" else "ready"
        return httpx.Response(
            201 if request.method == "POST" else 200, json={"id": "ses-1", "state": state}
        )

    return seen, answer


def test_an_int_poll_interval_waits_and_reads_again() -> None:
    seen, answer = _api()
    session = Session.create(
        "http://127.0.0.1:1",
        "t",
        org="o",
        project="p",
        profile="d",
        poll_interval_s=0,
        transport=httpx.MockTransport(answer),
    )
    assert session.id == "ses-1"
    assert seen == ["POST /v1/sessions", "GET /v1/sessions/ses-1"]


def test_an_int_poll_interval_waits_and_reads_again_async() -> None:
    seen, answer = _api()

    async def create() -> str:
        session = await AsyncSession.create(
            "http://127.0.0.1:1",
            "t",
            org="o",
            project="p",
            profile="d",
            poll_interval_s=0,
            transport=httpx.MockTransport(answer),
        )
        return session.id

    assert asyncio.run(create()) == "ses-1"
    assert seen == ["POST /v1/sessions", "GET /v1/sessions/ses-1"]
